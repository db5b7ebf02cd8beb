"""padim against anomalib's PaDiM, measured in one run on one machine.

Same backbone weights for both (a seeded resnet18 state_dict file, since ImageNet weights
cannot be downloaded here), same input size (224), layers 1-3 and the same 100 channels
(padim's seeded subset is handed to anomalib), same preprocessing, same training images (the
images: padim fits every one and calibrates out-of-fold). Then:

- image AUROC and pixel AUROC (both at 224 px, with the same metric code), per generated category;
- fit wall time; fit peak RSS at N = 100, 500 and 2000 training images, each fit in its own
  process (padim: the real `padim train`; anomalib: benchmarks/anomalib_padim.py);
- scoring throughput at batch 1 and 16 on model-input tensors;
- the artifact on disk (padim: the model file, also --slim; anomalib: its state_dict).

Writes benchmarks/results/<date>-<machine>.json, a Markdown table beside it and a PNG plot of
fit peak memory against N, and prints the ratios (padim / anomalib) as the last lines.

    pip install -c constraints.txt '.[bench]'        # anomalib + matplotlib, benchmarks only
    python benchmarks/compare_anomalib.py            # or --anomalib-python /other/venv/bin/python
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from timing import machine_name, median_seconds, seeded_resnet18, work_folder

from padim.models import PadimConfig, fit_detector, training_images
from padim.models.data.synthetic import generate
from padim.models.evaluation.metrics import compute_metrics, read_mvtec_category
from padim.models.fit.model_file import save_detector

HERE = Path(__file__).resolve().parent
CATEGORIES = ("weave", "carpet", "tiles")


def run_measured(command: list[str]) -> tuple[float, float, str]:
    """Run a Python ``command`` (interpreter first) in a child process, through peak_rss.py.

    Returns (peak RSS of that child in MB, seconds, stdout).
    """
    peak_file = Path(tempfile.mkstemp(suffix=".kb")[1])
    start = time.perf_counter()
    result = subprocess.run(
        [command[0], str(HERE / "peak_rss.py"), str(peak_file), *command[1:]], capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{result.stderr[-2000:]}")
    peak_mb = int(peak_file.read_text()) / 1024
    peak_file.unlink()
    return peak_mb, seconds, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--anomalib-python", default=sys.executable, help="interpreter with anomalib (default: this one)"
    )
    parser.add_argument("--memory-counts", type=int, nargs="+", default=[100, 500, 2000])
    parser.add_argument("--train-images", type=int, default=60, help="training images per category for the AUROCs")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, help="keep generated data here (default: a temporary folder)")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    args = parser.parse_args()
    check = subprocess.run(
        [args.anomalib_python, "-c", "import anomalib; print(anomalib.__version__)"], capture_output=True, text=True
    )
    if check.returncode != 0:
        raise SystemExit(
            "anomalib is not importable by --anomalib-python; install it with "
            "pip install -c constraints.txt '.[bench]' or point --anomalib-python to a venv that has it"
        )
    anomalib_version = check.stdout.strip()

    work = work_folder(args.workdir, "padim-vs-anomalib-")
    size = args.image_size
    data = work / "data"
    if not (data / CATEGORIES[-1]).exists():
        print("generating categories ...", flush=True)
        generate(data, CATEGORIES, train=args.train_images, test_good=10, test_defect=5, size=size, seed=7)
    pool = work / "pool" / "carpet" / "train" / "good"
    if len(list(pool.glob("*.png"))) < max(args.memory_counts):
        print(f"generating {max(args.memory_counts)} images for the memory runs ...", flush=True)
        generate(
            work / "pool", ("carpet",), train=max(args.memory_counts), test_good=0, test_defect=0, size=size, seed=8
        )
    weights = seeded_resnet18(work / "resnet18-seed0.pth")

    # PaDiM as published on both sides (anomalib's PaDiM: no neighbourhood average, the map smoothed with sigma 4)
    config = PadimConfig(
        weights=str(weights), image_size=size, batch_size=16, device="cpu", neighbourhood=1, blur_sigma=4.0
    )
    report: dict = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "anomalib": anomalib_version,
        "image_size": size,
        "backbone": "resnet18",
        "features": 100,
        "categories": {},
    }

    # --- detection quality, fit time, throughput, artifact size ----------------------------
    for category in CATEGORIES:
        root = data / category
        train = training_images(root / "train" / "good")
        samples = read_mvtec_category(root)
        start = time.perf_counter()
        detector, _ = fit_detector(config, train, progress=False)
        ours_fit = time.perf_counter() - start
        raw, maps = [], []
        for i in range(0, len(samples), 16):
            out = detector.score(detector.preprocess([Image.open(s.path).convert("RGB") for s in samples[i : i + 16]]))
            raw.append(out.raw_scores)
            maps.append(out.maps)
        ours = compute_metrics(samples, torch.cat(raw).numpy(), torch.cat(maps).numpy())
        ours["fit_seconds"] = ours_fit

        lists = work / "lists" / category
        lists.mkdir(parents=True, exist_ok=True)
        (lists / "train.json").write_text(json.dumps([str(i.path) for i in train]))
        (lists / "test.json").write_text(json.dumps([str(s.path) for s in samples]))
        (lists / "channels.json").write_text(json.dumps(detector.embedding.channel_index.tolist()))
        out_dir = work / "anomalib" / category
        subprocess.run(
            [
                args.anomalib_python,
                str(HERE / "anomalib_padim.py"),
                "fit-score",
                "--train-list",
                str(lists / "train.json"),
                "--test-list",
                str(lists / "test.json"),
                "--weights",
                str(weights),
                "--channel-index",
                str(lists / "channels.json"),
                "--out",
                str(out_dir),
                "--image-size",
                str(size),
                "--repeats",
                str(args.repeats),
            ],
            check=True,
        )
        theirs_run = json.loads((out_dir / "result.json").read_text())
        theirs = compute_metrics(samples, np.load(out_dir / "scores.npy"), np.load(out_dir / "maps.npy"))
        theirs["fit_seconds"] = theirs_run["fit_seconds"]
        keep = ("image_auroc", "pixel_auroc", "pro_0.3", "fit_seconds")
        report["categories"][category] = {
            "padim": {k: ours[k] for k in keep},
            "anomalib": {k: theirs[k] for k in keep},
            "fit_images": len(train),
        }
        print(
            f"{category}: image AUROC padim {ours['image_auroc']:.3f} / anomalib {theirs['image_auroc']:.3f}, "
            f"pixel AUROC {ours['pixel_auroc']:.3f} / {theirs['pixel_auroc']:.3f}",
            flush=True,
        )

        if category == CATEGORIES[0]:  # throughput and artifact, once
            batch = detector.preprocess([Image.open(s.path).convert("RGB") for s in (samples * 16)[:16]])
            report["throughput"] = {
                "padim": {
                    "batch16": 16
                    / median_seconds(lambda detector=detector, batch=batch: detector.score(batch), args.repeats),
                    "batch1": 1
                    / median_seconds(lambda detector=detector, batch=batch: detector.score(batch[:1]), args.repeats),
                },
                "anomalib": {
                    "batch16": theirs_run["images_per_second_batch"],
                    "batch1": theirs_run["images_per_second_batch1"],
                },
            }
            save_detector(detector, work / "padim.padim")
            save_detector(detector, work / "padim-slim.padim", with_statistics=False)
            report["artifact_bytes"] = {
                "padim": (work / "padim.padim").stat().st_size,
                "padim_slim": (work / "padim-slim.padim").stat().st_size,
                "anomalib": theirs_run["artifact_bytes"],
            }

    # --- fit peak memory against N, each fit in its own process -----------------------------
    images = sorted(pool.glob("*.png"))
    report["fit_memory"] = []
    for count in args.memory_counts:
        subset = work / f"subset-{count}"
        subset.mkdir(exist_ok=True)
        for image in images[:count]:
            if not (subset / image.name).exists():
                (subset / image.name).symlink_to(image)
        ours_rss, ours_s, _ = run_measured(
            [
                sys.executable,
                "-m",
                "padim",
                "-q",
                "train",
                str(subset),
                "--output",
                str(work / "mem.padim"),
                "--weights",
                str(weights),
                "--image-size",
                str(size),
                "--device",
                "cpu",
                "--neighbourhood",
                "1",
                "--blur-sigma",
                "4",
            ]
        )
        listing = work / f"subset-{count}.json"
        listing.write_text(json.dumps([str(p) for p in sorted(subset.glob("*.png"))]))
        channels = work / "lists" / CATEGORIES[0] / "channels.json"
        theirs_rss, theirs_s, _ = run_measured(
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
                "--image-size",
                str(size),
            ]
        )
        report["fit_memory"].append(
            {
                "images": count,
                "padim_peak_rss_mb": ours_rss,
                "anomalib_peak_rss_mb": theirs_rss,
                "padim_seconds": ours_s,
                "anomalib_seconds": theirs_s,
            }
        )
        print(
            f"N={count}: peak RSS padim {ours_rss:.0f} MB ({ours_s:.0f} s), anomalib {theirs_rss:.0f} MB "
            f"({theirs_s:.0f} s)",
            flush=True,
        )

    write_outputs(report, args.results)


def write_outputs(report: dict, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    stem = results / f"{report['date']}-{report['machine']}"
    mem = report["fit_memory"]
    if len(mem) >= 2:
        slope = lambda key: (mem[-1][key] - mem[0][key]) / (mem[-1]["images"] - mem[0]["images"])  # noqa: E731
        report["fit_memory_slope_mb_per_image"] = {
            "padim": slope("padim_peak_rss_mb"),
            "anomalib": slope("anomalib_peak_rss_mb"),
        }
    big = mem[-1]
    ratios = {
        "image_auroc_mean": np.mean([c["padim"]["image_auroc"] for c in report["categories"].values()])
        / np.mean([c["anomalib"]["image_auroc"] for c in report["categories"].values()]),
        "pixel_auroc_mean": np.mean([c["padim"]["pixel_auroc"] for c in report["categories"].values()])
        / np.mean([c["anomalib"]["pixel_auroc"] for c in report["categories"].values()]),
        "throughput_batch16": report["throughput"]["padim"]["batch16"] / report["throughput"]["anomalib"]["batch16"],
        "throughput_batch1": report["throughput"]["padim"]["batch1"] / report["throughput"]["anomalib"]["batch1"],
        f"fit_peak_rss_at_{big['images']}": big["padim_peak_rss_mb"] / big["anomalib_peak_rss_mb"],
        "artifact_size": report["artifact_bytes"]["padim"] / report["artifact_bytes"]["anomalib"],
        "artifact_size_slim": report["artifact_bytes"]["padim_slim"] / report["artifact_bytes"]["anomalib"],
    }
    report["ratios_padim_over_anomalib"] = ratios
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")

    lines = [
        f"padim vs anomalib {report['anomalib']} PaDiM: {report['machine']}, torch {report['torch']}, "
        f"resnet18, {report['image_size']} px, 100 channels, {report['date']}",
        "",
        "| category | image AUROC padim | image AUROC anomalib | pixel AUROC padim | pixel AUROC anomalib | fit s "
        "padim | fit s anomalib |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in report["categories"].items():
        p, a = c["padim"], c["anomalib"]
        lines.append(
            f"| {name} ({c['fit_images']} fit images) | {p['image_auroc']:.3f} | {a['image_auroc']:.3f} | "
            f"{p['pixel_auroc']:.3f} | "
            f"{a['pixel_auroc']:.3f} | {p['fit_seconds']:.1f} | {a['fit_seconds']:.1f} |"
        )
    t, b = report["throughput"], report["artifact_bytes"]
    lines += [
        "",
        "| measure | padim | anomalib | padim / anomalib |",
        "|---|---|---|---|",
        f"| scoring, batch 16 (img/s) | {t['padim']['batch16']:.1f} | {t['anomalib']['batch16']:.1f} | "
        f"{ratios['throughput_batch16']:.2f} |",
        f"| scoring, batch 1 (img/s) | {t['padim']['batch1']:.1f} | {t['anomalib']['batch1']:.1f} | "
        f"{ratios['throughput_batch1']:.2f} |",
    ]
    for row in mem:
        lines.append(
            f"| fit peak RSS, N={row['images']} (MB) | {row['padim_peak_rss_mb']:.0f} | "
            f"{row['anomalib_peak_rss_mb']:.0f} | "
            f"{row['padim_peak_rss_mb'] / row['anomalib_peak_rss_mb']:.2f} |"
        )
    if "fit_memory_slope_mb_per_image" in report:
        s = report["fit_memory_slope_mb_per_image"]
        lines.append(f"| fit RSS growth per image (MB) | {s['padim']:.3f} | {s['anomalib']:.3f} | |")
    lines += [
        f"| artifact on disk (MB) | {b['padim'] / 1e6:.1f} (slim {b['padim_slim'] / 1e6:.1f}) | "
        f"{b['anomalib'] / 1e6:.1f} | "
        f"{ratios['artifact_size']:.2f} (slim {ratios['artifact_size_slim']:.2f}) |"
    ]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    counts = [r["images"] for r in mem]
    axis.plot(counts, [r["padim_peak_rss_mb"] for r in mem], "o-", label="padim (streaming)")
    axis.plot(counts, [r["anomalib_peak_rss_mb"] for r in mem], "s-", label=f"anomalib {report['anomalib']}")
    axis.set_xlabel("training images")
    axis.set_ylabel("fit peak RSS (MB)")
    axis.set_title(f"PaDiM fit memory, resnet18 {report['image_size']} px, {report['machine'][:30]}", fontsize=9)
    axis.set_ylim(bottom=0)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(f"{stem}-fit-memory.png", dpi=120)

    print("\n".join(lines))
    print(f"\nwrote {stem}.json, {stem}.md, {stem}-fit-memory.png")
    for key, value in ratios.items():
        print(f"ratio padim/anomalib {key}: {value:.2f}")


if __name__ == "__main__":
    main()
