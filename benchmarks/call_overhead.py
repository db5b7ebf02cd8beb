"""The call around the scorer at batch 1: what ``padim.load(...).predict(path)`` spends besides the scorer itself.

For each test picture, in interleaved rounds with a pause before every call (a line's trigger gives such pauses),
it times:

- ``score``: the scorer alone on the picture's model input (``scorer.score(scorer.preprocess([image]))`` with the
  input made beforehand);
- ``decode``: ``open_image`` of the path (the PNG or JPEG decode, EXIF orientation, the region of interest);
- ``framing``: ``scorer.preprocess`` of the decoded picture (its resize to the model's side and the 8-bit copy);
- ``predict(path)`` and ``predict(image)``: the whole call, by path and by a decoded PIL image.

and prints the medians, and ``predict(path)`` minus ``score`` split into decode, framing and the rest (result
objects, verdicts, the map at the picture's size, and whatever the call costs beyond its work). Default: a seeded
resnet18 (benchmarks/timing.py) fitted with the default flags on generated 256 px ``tiles`` pictures.

    python benchmarks/call_overhead.py [--model M.padim --pictures DIR] [--rounds 8] [--output F]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from timing import machine_name, seeded_resnet18, work_folder

import padim
from padim.models.data.images import list_images, open_image
from padim.models.devices import cpu_features


def prepared(work: Path) -> tuple[Path, Path]:
    """A default-flag model of generated ``tiles`` pictures (seeded resnet18), and its test pictures' folder."""
    data = work / "data"
    subprocess.run(
        [sys.executable, "-m", "padim", "-q", "synth", str(data), "--categories", "tiles", "--train", "60"],
        stdout=subprocess.DEVNULL,
        check=True,
    )
    model = work / "tiles.padim"
    weights = seeded_resnet18(work / "resnet18-seed0.pt")
    subprocess.run(
        [sys.executable, "-m", "padim", "-q", "train", str(data / "tiles/train/good"), "-o", str(model)]
        + ["--weights", str(weights)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return model, data / "tiles/test"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model file (default: fitted on generated pictures)")
    parser.add_argument("--pictures", type=Path, help="a folder of test pictures (with --model)")
    parser.add_argument("--runtime", default="auto")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--count", type=int, default=30, help="pictures a round")
    parser.add_argument("--pause", type=float, default=0.03, help="seconds before each call")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path, help="write the JSON report here too")
    args = parser.parse_args()
    if (args.model is None) != (args.pictures is None):
        parser.error("--model and --pictures go together")
    model, pictures = (args.model, args.pictures) if args.model else prepared(work_folder(args.workdir, "padim-call-"))
    detector = padim.load(model, runtime=args.runtime)
    scorer = detector.scorer
    paths = list_images(pictures)[: args.count]
    if not paths:
        parser.error(f"{pictures}: no pictures")
    inputs = {path: scorer.preprocess([open_image(path)]) for path in paths}
    decoded = {path: open_image(path) for path in paths}
    steps = {
        "score": lambda path: scorer.score(inputs[path]),
        "decode": lambda path: open_image(path).load(),
        "framing": lambda path: scorer.preprocess([decoded[path]]),
        "predict(path)": lambda path: detector.predict(path),
        "predict(image)": lambda path: detector.predict(decoded[path]),
    }
    for path in paths[:3]:  # warm-up: the runtime's first calls
        for step in steps.values():
            step(path)
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for path in paths:
            for name, step in steps.items():
                time.sleep(args.pause)
                started = time.perf_counter()
                step(path)
                seconds[name].append(time.perf_counter() - started)
    ms = {name: round(statistics.median(values) * 1000, 3) for name, values in seconds.items()}
    around = ms["predict(path)"] - ms["score"]
    report = {
        "machine": machine_name(),
        "cpu_features": list(cpu_features()),
        "date": datetime.date.today().isoformat(),
        "runtime": detector.runtime,
        "model": str(model),
        "pictures": len(paths),
        "rounds": args.rounds,
        "median_ms": ms,
        "around_the_scorer_ms": {
            "in_all": round(around, 3),
            "decode": ms["decode"],
            "framing": ms["framing"],
            "the_rest": round(around - ms["decode"] - ms["framing"], 3),
        },
    }
    features = ", ".join(cpu_features()) or "no AVX2"
    print(f"{report['machine']} ({features}), runtime {detector.runtime}, {len(paths)} pictures x {args.rounds} rounds")
    for name, value in ms.items():
        print(f"  {name:15s} {value:8.2f} ms")
    print(
        f"  around the scorer (predict(path) - score): {around:.2f} ms = decode {ms['decode']:.2f} + framing "
        f"{ms['framing']:.2f} + the rest {report['around_the_scorer_ms']['the_rest']:.2f}"
    )
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
