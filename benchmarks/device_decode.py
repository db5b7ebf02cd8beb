"""What decoding JPEGs on the scoring device does to scores: the device's path against the CPU's, on real photographs.

The CPU path is the service's (Pillow; a large JPEG decoded at a reduced scale, then resized); the device path is
:class:`padim.service.device.device_decoding.DeviceDecode` (torchvision's decoder: nvJPEG on a GPU, libjpeg-turbo on
a CPU; the whole picture decoded, then resized on the device). Pictures: the JPEG photographs that ship with installed
packages (scikit-learn's, matplotlib's), as they are and re-encoded as 1920x1080 camera frames (quality 90). The
model: seeded random resnet18 weights, fitted on 224 px crops of the same photographs, so that its threshold sits
among their scores.

Prints, per picture, both raw scores and their relative difference, then the largest difference and the verdicts
that differ. ``--device cuda`` decodes with nvJPEG (the figure docs/gpu.md asks for); ``--device cpu`` measures the
same arithmetic with the CPU's decoder, which differs from nvJPEG only in the inverse DCT's last bit.

    python benchmarks/device_decode.py --device cpu
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import work_folder  # noqa: E402 (the benchmarks' own helpers)

from padim.models import PadimConfig, fit_detector, training_images  # noqa: E402
from padim.models.deploy.runtimes import load_scorer  # noqa: E402
from padim.models.fit.model_file import save_detector  # noqa: E402
from padim.service.device.decoding import Decoder  # noqa: E402
from padim.service.device.device_decoding import DeviceDecode, jpeg_tensor  # noqa: E402


def photographs() -> list[Path]:
    """JPEG photographs shipped with installed packages (no download)."""
    found = []
    for module, pattern in (("sklearn", "datasets/images/*.jpg"), ("matplotlib", "mpl-data/sample_data/*.jpg")):
        try:
            root = Path(__import__(module).__file__).parent
        except ImportError:
            continue
        found += sorted(root.glob(pattern))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    sources = photographs()
    if not sources:
        print("no JPEG photographs found in the installed packages (scikit-learn, matplotlib)", file=sys.stderr)
        return 2
    folder = work_folder(args.workdir, "padim-device-decode-")
    crops = folder / "train"
    crops.mkdir(exist_ok=True)
    pictures: dict[str, bytes] = {}
    generator = torch.Generator().manual_seed(0)
    for source in sources:
        image = Image.open(source).convert("RGB")
        pictures[source.name] = source.read_bytes()
        frame = io.BytesIO()
        image.resize((1920, 1080), Image.BICUBIC).save(frame, format="JPEG", quality=90)
        pictures[f"{source.stem}-1080p.jpg"] = frame.getvalue()
        for i in range(12):
            side = min(image.size) // 2
            x = int(torch.randint(0, image.width - side, (1,), generator=generator))
            y = int(torch.randint(0, image.height - side, (1,), generator=generator))
            image.crop((x, y, x + side, y + side)).resize((224, 224)).save(crops / f"{source.stem}-{i}.png")
    model = folder / "photos.padim"
    config = PadimConfig(weights="random", image_size=224, device=args.device)
    save_detector(fit_detector(config, training_images(crops), progress=False)[0], model)
    scorer = load_scorer(model, "torch", args.device)
    decoder = Decoder(1, 80_000_000, 40_000_000, 1024)
    on_device = DeviceDecode(torch.device(args.device), scorer.framing)
    rows = []
    for name, data in pictures.items():
        on_cpu = scorer.score(decoder.decode(scorer, data, False).tensor.unsqueeze(0)).raw_scores.item()
        (tensor,) = on_device.decode([jpeg_tensor(data)])
        assert tensor is not None, name
        there = scorer.score(tensor.unsqueeze(0)).raw_scores.item()
        threshold = scorer.calibration.threshold
        rows.append(
            {
                "picture": name,
                "size": Image.open(io.BytesIO(data)).size,
                "cpu_raw_score": on_cpu,
                "device_raw_score": there,
                "relative_difference": abs(there - on_cpu) / abs(on_cpu),
                "same_verdict": (there >= threshold) == (on_cpu >= threshold),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(
        json.dumps(
            {
                "device": args.device,
                "pictures": len(rows),
                "largest_relative_difference": max(r["relative_difference"] for r in rows),
                "verdicts_that_differ": sum(not r["same_verdict"] for r in rows),
                "raw_threshold": scorer.calibration.threshold,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
