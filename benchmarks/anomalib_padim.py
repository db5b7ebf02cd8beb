"""anomalib's PaDiM torch model, driven on the same inputs as padim, for the benchmarks.

Run by benchmarks/compare_anomalib.py, benchmarks/fit_cost.py and benchmarks/throughput.py with an
interpreter that has anomalib (``pip install .[bench]``, or a separate virtual environment). Two modes:

- ``fit-score``: fit on --train-list, score --test-list, write ``scores.npy`` (N,),
  ``maps.npy`` (N, S, S) and ``result.json`` (fit time, throughput at batch 1 and 16, size of
  the saved state_dict) into --out;
- ``fit-only``: fit on --train-list, print ``{"fit_seconds": ...}`` (embedding and ``fit()``, as
  padim's fit phases count them) and exit (the parent reads this process's peak RSS).

Inputs are resized and normalised exactly as padim does (bilinear, ImageNet mean/std), the
backbone weights come from the same state_dict file, and the channel subset is padim's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from timing import median_seconds

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def to_input(paths, size: int) -> torch.Tensor:
    """Same preprocessing as padim.models.data.images.to_pixels, then normalise (the scorer's model_input)."""
    arrays = []
    for path in paths:
        pixels = np.asarray(Image.open(path).convert("RGB").resize((size, size), Image.BILINEAR), dtype=np.float32)
        arrays.append(((pixels / 255.0 - MEAN) / STD).transpose(2, 0, 1))
    return torch.from_numpy(np.ascontiguousarray(np.stack(arrays)))


def build(
    weights: Path, channel_index: Path, device: str, backbone: str = "resnet18", layers: tuple[str, ...] | None = None
):
    """anomalib's PaDiM on ``backbone``'s ``layers`` with the weights of a torchvision state_dict file: a ResNet as
    timm's network (anomalib's own path; the same keys), any other as torchvision's network handed to anomalib's
    feature extractor (its ``nn.Module`` path: torch.fx nodes, as padim's stages)."""
    from anomalib.models.image.padim.torch_model import PadimModel

    channels = json.loads(channel_index.read_text())
    state = torch.load(weights, map_location="cpu", weights_only=True)
    if backbone.startswith(("resnet", "wide_resnet", "resnext")):
        model = PadimModel(
            backbone=backbone, layers=list(layers or ("layer1", "layer2", "layer3")), pre_trained=False,
            n_features=len(channels),
        )  # fmt: skip
        model.feature_extractor.feature_extractor.load_state_dict(state, strict=False)
    else:
        import torchvision

        network = torchvision.models.get_model(backbone, weights=None).eval()
        network.load_state_dict(state, strict=False)
        model = PadimModel(backbone=network, layers=list(layers), pre_trained=False, n_features=len(channels))
    model.idx = torch.tensor(channels)
    return model.to(device)


def fit(model, train: list[str], size: int, batch_size: int, device: str) -> float:
    start = time.perf_counter()
    model.train()
    model.feature_extractor.eval()
    with torch.no_grad():
        for i in range(0, len(train), batch_size):
            model(to_input(train[i : i + batch_size], size).to(device))
    model.fit()
    model.eval()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["fit-score", "fit-only"])
    parser.add_argument("--train-list", type=Path, required=True, help="JSON list of training image paths")
    parser.add_argument("--test-list", type=Path, help="JSON list of test image paths (fit-score)")
    parser.add_argument("--weights", type=Path, required=True, help="the backbone's state_dict file")
    parser.add_argument("--channel-index", type=Path, required=True, help="JSON list of the channels kept")
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--layers", help="comma-separated stages (default layer1,layer2,layer3)")
    parser.add_argument("--scores-only", action="store_true", help="fit-score: scores.npy and the fit time only")
    parser.add_argument("--out", type=Path, help="output folder (fit-score)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import anomalib

    layers = tuple(args.layers.split(",")) if args.layers else None
    model = build(args.weights, args.channel_index, args.device, args.backbone, layers)
    fit_seconds = fit(model, json.loads(args.train_list.read_text()), args.image_size, args.batch_size, args.device)
    if args.mode == "fit-only":
        cuda = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None
        print(json.dumps({"fit_seconds": fit_seconds, "cuda_max_memory_allocated": cuda}))
        return

    test = json.loads(args.test_list.read_text())
    scores, maps = [], []
    with torch.no_grad():
        for i in range(0, len(test), args.batch_size):
            out = model(to_input(test[i : i + args.batch_size], args.image_size).to(args.device))
            scores.append(out.pred_score.flatten().cpu())
            if not args.scores_only:
                maps.append(out.anomaly_map.reshape(-1, args.image_size, args.image_size).cpu())
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / "scores.npy", torch.cat(scores).numpy())
    if args.scores_only:
        (args.out / "result.json").write_text(json.dumps({"version": anomalib.__version__, "fit_seconds": fit_seconds}))
        return
    with torch.no_grad():
        batch = to_input((test * args.batch_size)[: args.batch_size], args.image_size).to(args.device)
        per_batch = median_seconds(lambda: model(batch), args.repeats)
        single = median_seconds(lambda: model(batch[:1]), args.repeats)
    np.save(args.out / "maps.npy", torch.cat(maps).numpy().astype(np.float32))
    artifact = args.out / "anomalib_padim_state_dict.pt"
    torch.save(model.state_dict(), artifact)
    (args.out / "result.json").write_text(
        json.dumps(
            {
                "version": anomalib.__version__,
                "fit_seconds": fit_seconds,
                "images_per_second_batch": args.batch_size / per_batch,
                "images_per_second_batch1": 1 / single,
                "artifact_bytes": artifact.stat().st_size,
            }
        )
    )


if __name__ == "__main__":
    main()
