"""Quantised scorers, measured side by side: float32 against int8 (and bf16) on ONNX Runtime and OpenVINO.

A detector is fitted (``padim.fit``, the defaults, seeded random resnet18 weights unless
``--weights``) on generated normal pictures of one texture, then exported four times with
:func:`padim.models.deploy.export.export_detector`: float32 and ``--precision int8`` for
``onnx`` (ONNX Runtime) and ``openvino``; a fifth time, ``--precision bf16`` for ``openvino``, where
OpenVINO runs bfloat16 on this CPU (:func:`padim.models.deploy.runtimes.openvino_runs`). The int8 and
bf16 exports are calibrated on a folder of new normal pictures (32 for the quantiser, int8 only; the rest
for the threshold and the gate) and gated with a folder of defect pictures. Then, on test pictures none
of them saw (normal and with a defect):

- throughput of the whole scorer (the graph: backbone, statistics, map, score) at batch 1 and 16,
  the scorers interleaved round by round so that a slower moment of the machine hits each alike;
- image AUROC of each scorer, and the gate's reading of each int8 export (score error, verdicts
  changed on the calibration pictures at the float32 threshold).

    python benchmarks/quantised.py            # 224 px, 200 training pictures
    python benchmarks/quantised.py --quick    # 128 px, fewer pictures
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/quantised.py --quick   # OpenVINO's kernels as on a CPU without VNNI
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.metrics import roc_auc_score
from timing import machine_name, seeded_resnet18, work_folder

import padim
from padim.models.data.synthetic import add_defect, texture
from padim.models.deploy.export import export_detector
from padim.models.deploy.quantise import QuantiseOptions, export_quantised_detector
from padim.models.deploy.runtimes import load_scorer, openvino_runs
from padim.models.devices import cpu_features
from padim.models.fit.model_file import load_detector

DEFECTS = ("scratch", "stain", "hole")


def cpu_flags() -> str:
    """The CPU features the runtimes' fast paths use (VNNI, BF16, AMX, ...), from /proc/cpuinfo."""
    return ", ".join(cpu_features()) or "none of avx2/avx512/vnni"


def pictures(folder: Path, count: int, size: int, rng: np.random.Generator, category: str, defect: bool) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        array = texture(category, size, rng)
        if defect:
            array, _ = add_defect(array, DEFECTS[i % len(DEFECTS)], rng)
        path = folder / f"{i:04d}.png"
        Image.fromarray((array * 255 + 0.5).astype(np.uint8)).save(path)
        paths.append(path)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=224, help="picture side and model input (default 224)")
    parser.add_argument("--train", type=int, default=200, help="training pictures (default 200)")
    parser.add_argument("--calibration", type=int, default=132, help="calibration pictures (default 132: 32 + 100)")
    parser.add_argument(
        "--test", type=int, default=100, help="test pictures of each kind, normal and defect (default 100)"
    )
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7; the median is reported)")
    parser.add_argument("--category", default="weave")
    parser.add_argument("--weights", type=Path, help="a resnet18 state_dict file (default: seeded random weights)")
    parser.add_argument("--quick", action="store_true", help="128 px, 60 training, 72 calibration, 40 test pictures")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.size, args.train, args.calibration, args.test, args.rounds = 128, 60, 72, 40, 3
    work = work_folder(args.workdir, "padim-quantised-")
    weights = args.weights or seeded_resnet18(work / "resnet18-seed0.pth")
    rng = np.random.default_rng(0)
    train = pictures(work / "train", args.train, args.size, rng, args.category, False)
    calibration = pictures(work / "calibration", args.calibration, args.size, rng, args.category, False)
    pictures(work / "check", 30, args.size, rng, args.category, True)
    good = pictures(work / "test-good", args.test, args.size, rng, args.category, False)
    bad = pictures(work / "test-defect", args.test, args.size, rng, args.category, True)
    model = work / "model.padim"
    padim.fit(train, output=model, weights=str(weights), image_size=args.size, progress=False)
    detector = load_detector(model, device="cpu")
    del calibration
    exports, gates = {}, {}
    made = [(fmt, precision) for fmt in ("onnx", "openvino") for precision in ("float32", "int8")]
    if openvino_runs("bf16") == "bf16":
        made.append(("openvino", "bf16"))
    for fmt, precision in made:
        options = None if precision == "float32" else QuantiseOptions(precision, work / "calibration", work / "check")
        started = time.perf_counter()
        directory = (
            export_detector(detector, work / f"{fmt}-{precision}", fmt, model)
            if options is None
            else export_quantised_detector(detector, work / f"{fmt}-{precision}", fmt, model, options)
        )
        seconds = time.perf_counter() - started
        name = f"{'onnxruntime' if fmt == 'onnx' else 'openvino'} {precision}"
        exports[name] = directory
        metadata = json.loads((directory / "padim.json").read_text())
        gates[name] = {
            "export_seconds": round(seconds, 1),
            **(
                {"agreement": metadata["quantisation"]["agreement"], "calibration": metadata["calibration"]}
                if precision != "float32"
                else {}
            ),
        }
    scorers = {name: load_scorer(directory) for name, directory in exports.items()}
    inputs = detector.preprocess([Image.open(p).convert("RGB") for p in good + bad])
    labels = np.r_[np.zeros(len(good)), np.ones(len(bad))]
    rows = {name: {} for name in scorers}
    for name, scorer in scorers.items():
        raw = torch.cat([scorer.score(inputs[i : i + 16]).raw_scores for i in range(0, len(inputs), 16)]).numpy()
        rows[name]["auroc"] = float(roc_auc_score(labels, raw))
    for batch in (1, 16):
        chunk = inputs[:batch]
        for scorer in scorers.values():
            scorer.score(chunk)  # warm
        times = {name: [] for name in scorers}
        for _ in range(args.rounds):
            for name, scorer in scorers.items():
                repeats = 8 if batch == 1 else 2
                started = time.perf_counter()
                for _ in range(repeats):
                    scorer.score(chunk)
                times[name].append((time.perf_counter() - started) / repeats)
        for name in scorers:
            seconds = float(np.median(times[name]))
            rows[name][f"batch{batch}_ms"] = seconds * 1e3
            rows[name][f"batch{batch}_images_per_s"] = batch / seconds
    print(
        f"{machine_name()} ({platform.machine()}; {cpu_flags()}); {args.category} {args.size} px, resnet18 "
        f"{'seeded random' if args.weights is None else args.weights.name} weights, {args.train} training pictures; "
        f"test {len(good)} normal + {len(bad)} defect; median of {args.rounds} interleaved rounds"
    )
    print(
        f"{'scorer':<22} {'batch 1 ms':>10} {'img/s':>7} {'batch 16 ms':>12} {'img/s':>7} {'speed-up b16':>13} "
        f"{'AUROC':>7}"
    )
    for name, row in rows.items():
        base = rows[name.replace("int8", "float32").replace("bf16", "float32")]
        row["speedup_batch16"] = base["batch16_ms"] / row["batch16_ms"]
        row["speedup_batch1"] = base["batch1_ms"] / row["batch1_ms"]
        print(
            f"{name:<22} {row['batch1_ms']:>10.1f} {row['batch1_images_per_s']:>7.1f} {row['batch16_ms']:>12.1f} "
            f"{row['batch16_images_per_s']:>7.1f} {row['speedup_batch16']:>12.2f}x {row['auroc']:>7.4f}"
        )
    for name, gate in gates.items():
        if "agreement" in gate:
            a = gate["agreement"]
            print(
                f"{name} gate: score error max {a['max_score_error']:.2%} median {a['median_score_error']:.2%}, maps "
                f"{a['max_map_error']:.2%}, rank correlation {a['rank_correlation']:.4f}, verdicts changed on the "
                f"{a['images']} calibration pictures {a['verdict_changes_normal']}, on the {a['check_images']} check "
                f"pictures {a['verdict_changes_check']}; its threshold {gate['calibration']['threshold']:.3f} "
                f"({gate['calibration']['method']}); export {gate['export_seconds']} s"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine_name(),
                    "cpu_flags": cpu_flags(),
                    "size": args.size,
                    "train": args.train,
                    "calibration": args.calibration,
                    "test": args.test,
                    "rounds": args.rounds,
                    "scorers": rows,
                    "gates": gates,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
