"""Peak resident memory of `padim train` against the number of training images.

Each fit runs in its own process (the real CLI) and reports its own peak RSS (``VmHWM``,
through benchmarks/peak_rss.py), so runs do not mix.

    python benchmarks/fit_memory.py --counts 100 1000 --image-size 224
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from timing import work_folder

from padim.models.data.synthetic import generate


def fit_once(data: Path, output: Path, args: argparse.Namespace) -> dict:
    peak_file = output.with_suffix(".peak-kb")
    command = [
        sys.executable,
        str(Path(__file__).parent / "peak_rss.py"),
        str(peak_file),
        "-m",
        "padim",
        "-q",
        "train",
        str(data),
        "--output",
        str(output),
        "--weights",
        args.weights,
        "--backbone",
        args.backbone,
        "--image-size",
        str(args.image_size),
        "--batch-size",
        str(args.batch_size),
        "--device",
        args.device,
    ]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    return {"peak_rss_mb": int(peak_file.read_text()) / 1024, "seconds": seconds, "model_bytes": output.stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--weights", default="random", help="random (default here: no download) or a state_dict path")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()

    work = work_folder(args.workdir, "padim-mem-")
    pool = work / "data" / "carpet" / "train" / "good"
    if len(list(pool.glob("*.png"))) < max(args.counts):
        generate(
            work / "data", ("carpet",), train=max(args.counts), test_good=0, test_defect=0, size=args.image_size, seed=2
        )
    images = sorted(pool.glob("*.png"))
    rows = []
    for count in args.counts:
        subset = work / f"subset-{count}"
        subset.mkdir(exist_ok=True)
        for image in images[:count]:
            link = subset / image.name
            if not link.exists():
                link.symlink_to(image)
        result = fit_once(subset, work / f"model-{count}.padim", args)
        rows.append({"images": count, **result, "images_per_second": count / result["seconds"]})
        print(
            f"N={count:6d}: peak RSS {result['peak_rss_mb']:8.1f} MB, {result['seconds']:7.1f} s "
            f"({count / result['seconds']:.1f} img/s incl. start-up), model {result['model_bytes'] / 1e6:.1f} MB"
        )
    print(json.dumps({"backbone": args.backbone, "image_size": args.image_size, "rows": rows}))


if __name__ == "__main__":
    main()
