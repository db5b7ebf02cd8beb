"""What a fit costs: ``padim train`` against anomalib's PaDiM fit, same images, weights, channels and size.

Each fit runs in its own process (``benchmarks/peak_rss.py`` reads that process's own peak RSS,
``VmHWM``: every page it touched, memory-mapped files included), padim and anomalib interleaved
round by round (the order alternates), so that a slow moment of the machine hits both. For each
case it prints:

- padim: the phases ``padim train`` reports (fit + finish + calibrate: pass 1, the statistics and
  factors, the out-of-fold distances and the threshold; file writing and interpreter start-up
  left out), its calibration share, the write, the whole process's wall time and peak RSS;
- anomalib 2.7: its embedding pass and ``fit()`` (``benchmarks/anomalib_padim.py fit-only``),
  wall time and peak RSS; a crash is a result, recorded with its last line;
- on a GPU: ``torch.cuda.max_memory_allocated`` of each.

Cases (default): resnet18 at 224 px with 60 and 200 images, wide_resnet50_2 at 128 and 224 px
with 40 images; default folds (padim's default calibration). Seeded random weights: the cost
does not depend on the weights.

    python -m venv /tmp/anomalib && /tmp/anomalib/bin/pip install torch==2.14.1 torchvision==0.29.1 anomalib==2.7.0
    python benchmarks/fit_cost.py --anomalib-python /tmp/anomalib/bin/python [--rounds 2] [--cases resnet18:224:60]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from timing import machine_name, seeded_backbone, work_folder

HERE = Path(__file__).resolve().parent
DEFAULT_CASES = ("resnet18:224:60", "resnet18:224:200", "wide_resnet50_2:128:40", "wide_resnet50_2:224:40")


def measured(command: list[str], cwd: Path | None = None) -> dict:
    """Run ``command`` (an interpreter, then its arguments) through peak_rss.py: peak RSS, wall time, output."""
    peak_file = Path(tempfile.mkstemp(suffix=".kb")[1])
    started = time.perf_counter()
    result = subprocess.run(
        [command[0], str(HERE / "peak_rss.py"), str(peak_file), *command[1:]], capture_output=True, text=True, cwd=cwd
    )
    seconds = time.perf_counter() - started
    text = peak_file.read_text().strip()
    peak_file.unlink()
    run = {
        "wall_seconds": round(seconds, 2),
        "peak_rss_mb": round(int(text) / 1024) if text else None,
        "returncode": result.returncode,
    }
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        run["crashed"] = lines[-1][:300] if lines else f"exit {result.returncode}"
    else:
        run["output"] = json.loads(result.stdout.strip().splitlines()[-1])
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anomalib-python", help="interpreter with anomalib 2.7 (default: none, padim alone)")
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), metavar="BACKBONE:SIZE:IMAGES")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of each side per case (default 2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workdir", type=Path, help="keep generated images and weights here")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument(
        "--padim-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="more `padim train` flags, e.g. --calibration-folds loo (last)",
    )
    args = parser.parse_args()
    from padim.core.artifact import load_artifact
    from padim.models.data.synthetic import generate

    work = work_folder(args.workdir, "padim-fit-cost-")
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_name(),
        "torch": torch.__version__,
        "device": args.device,
        "rounds": args.rounds,
        "padim_args": args.padim_args,
        "cases": [],
    }
    for case in args.cases:
        backbone, size, count = case.split(":")
        size, count = int(size), int(count)
        data = work / f"carpet-{size}-{count}"
        if not (data / "carpet" / "train" / "good").exists():
            generate(data, ("carpet",), train=count, test_good=0, test_defect=0, size=size, seed=11)
        images = data / "carpet" / "train" / "good"
        weights = seeded_backbone(backbone, work / f"{backbone}-seed0.pth")
        model = work / f"{backbone}-{size}-{count}.padim"
        padim = [
            sys.executable,
            "-m",
            "padim",
            "-q",
            "train",
            str(images),
            "--output",
            str(model),
            "--backbone",
            backbone,
            "--weights",
            str(weights),
            "--image-size",
            str(size),
            "--device",
            args.device,
            *args.padim_args,
        ]
        runs: dict[str, list] = {"padim": [], "anomalib": []}
        for round_number in range(args.rounds):
            order = ("padim", "anomalib") if round_number % 2 == 0 else ("anomalib", "padim")
            for side in order:
                if side == "padim":
                    run = measured(padim)
                    if "crashed" not in run:
                        phases = run["output"]["phase_seconds"]
                        run["phases"] = phases
                        run["own_seconds"] = round(sum(phases.get(k, 0.0) for k in ("fit", "finish", "calibrate")), 2)
                        run["calibration_share"] = round(
                            phases.get("calibrate", 0.0) / max(run["own_seconds"], 1e-9), 3
                        )
                        run["cuda_max_memory_allocated"] = run["output"].get("cuda_max_memory_allocated")
                        run["planned_mb"] = round(run["output"]["memory"]["planned_bytes"] / 2**20)
                        run.pop("output")
                elif args.anomalib_python:
                    channels = work / f"{backbone}-channels.json"
                    if not channels.exists():  # padim's seeded subset, read from its file
                        if not model.exists():
                            measured(padim)
                        tensors, _ = load_artifact(model)
                        channels.write_text(json.dumps(tensors["embedding.channel_index"].tolist()))
                    listing = work / f"{backbone}-{size}-{count}.json"
                    listing.write_text(json.dumps([str(p) for p in sorted(images.glob("*.png"))]))
                    run = measured(
                        [
                            args.anomalib_python,
                            str(HERE / "anomalib_padim.py"),
                            "fit-only",
                            "--train-list",
                            str(listing),
                            "--weights",
                            str(weights),
                            "--channel-index",
                            str(channels),
                            "--backbone",
                            backbone,
                            "--image-size",
                            str(size),
                            "--device",
                            args.device,
                        ],
                        cwd=HERE,
                    )
                    if "crashed" not in run:
                        run["own_seconds"] = round(run["output"]["fit_seconds"], 2)
                        run["cuda_max_memory_allocated"] = run["output"].get("cuda_max_memory_allocated")
                        run.pop("output")
                else:
                    continue
                runs[side].append(run)
                print(f"{case} {side}: {json.dumps(run)}", flush=True)
        report["cases"].append({"case": case, "backbone": backbone, "image_size": size, "images": count, **runs})
    write(report, args.results)


def summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if "crashed" not in r]
    if not ok:
        return {"crashed": runs[0]["crashed"] if runs else "not run"}
    return {
        "own_seconds": statistics.median(r["own_seconds"] for r in ok),
        "wall_seconds": statistics.median(r["wall_seconds"] for r in ok),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ok),
        "calibration_share": statistics.median(r["calibration_share"] for r in ok)
        if "calibration_share" in ok[0]
        else None,
        "planned_mb": ok[0].get("planned_mb"),
        "cuda": max((r.get("cuda_max_memory_allocated") or 0) for r in ok) or None,
    }


def write(report: dict, results: Path) -> None:
    lines = [
        f"padim train vs anomalib 2.7 PaDiM fit: {report['machine']}, torch {report['torch']}, {report['device']}, "
        f"median of {report['rounds']} interleaved runs, {report['date']}"
        + (f", padim {' '.join(report['padim_args'])}" if report["padim_args"] else ""),
        "",
        "| case | padim fit+finish+calibrate (s) | calibrate share | padim wall (s) | padim peak RSS (MiB) | "
        "padim planned (MiB) | anomalib embed+fit (s) | anomalib wall (s) | anomalib peak RSS (MiB) | "
        "time padim / anomalib |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        ours, theirs = summary(case["padim"]), summary(case["anomalib"])
        case["summary"] = {"padim": ours, "anomalib": theirs}
        if "crashed" in theirs:
            their_cells = f"crashed: {theirs['crashed'][:80]} | | |"
            ratio = ""
        else:
            their_cells = f"{theirs['own_seconds']:.1f} | {theirs['wall_seconds']:.1f} | {theirs['peak_rss_mb']} |"
            ratio = f"{ours['own_seconds'] / theirs['own_seconds']:.2f}" if "crashed" not in ours else ""
        our_cells = (
            f"crashed: {ours['crashed'][:80]} | | | | |"
            if "crashed" in ours
            else f"{ours['own_seconds']:.1f} | {ours['calibration_share']:.0%} | {ours['wall_seconds']:.1f} | "
            f"{ours['peak_rss_mb']} | {ours['planned_mb']} |"
        )
        lines.append(
            f"| {case['backbone']}, {case['image_size']} px, {case['images']} images | {our_cells} "
            f"{their_cells} {ratio} |"
        )
    results.mkdir(parents=True, exist_ok=True)
    stem = results / f"{report['date']}-{report['machine']}-fit-cost"
    Path(f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
