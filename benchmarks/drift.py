"""The line monitor, measured: how often each test fires on a stable line and on lines that changed, and
what monitoring costs beside scoring.

A detector is fitted (``padim.fit``, the defaults, seeded random resnet18 weights unless ``--weights``)
on generated normal pictures of one texture; then disjoint windows of new pictures are read by
:func:`padim.core.drift.assess`, as the service's monitor and ``padim drift`` read them, for each
scenario:

- ``normal``: new normal pictures (the rate of each alarm is its false-alarm rate; at most the level);
- ``defect wave``: a tenth of the pictures carry a defect, the rest normal;
- ``dimmer 5%``, ``lighting``: every picture 5% or 15% darker;
- ``focus``: every picture blurred (Gaussian, radius 1 px at 128 px);
- ``material``: another texture (``carpet``) than the one fitted.

Beside padim's input drift (the mean squared distance over every feature pixel), a model-free
alternative is measured on the same windows: a one-sided KS test of each picture's mean pixel
brightness against the training pictures'. Then the cost: the scorer at batch 16 against the
monitor's part of a request (recording 16 images, the verdict counter and score histogram) and
against one reading of a full window (``GET /models/{name}/monitor``, a Prometheus scrape).

    python benchmarks/drift.py                  # 200 training pictures, 10 windows of 100 a scenario
    python benchmarks/drift.py --quick          # fewer
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFilter
from timing import machine_name, seeded_resnet18, work_folder

import padim
from padim.core.drift import LEVEL, assess, ks_greater
from padim.models.data.synthetic import add_defect, texture

SCENARIOS = ("normal", "defect wave", "dimmer 5%", "lighting", "focus", "material")


def picture(scenario: str, rng: np.random.Generator, size: int, category: str) -> Image.Image:
    if scenario == "material":
        array = texture("carpet", size, rng)
    else:
        array = texture(category, size, rng)
    if scenario == "defect wave" and rng.random() < 0.1:
        array, _ = add_defect(array, str(rng.choice(["scratch", "stain", "hole"])), rng)
    image = Image.fromarray((array * 255 + 0.5).astype(np.uint8))
    if scenario in ("lighting", "dimmer 5%"):
        factor = 0.85 if scenario == "lighting" else 0.95
        image = Image.fromarray((np.asarray(image, dtype=np.float64) * factor).astype(np.uint8))
    if scenario == "focus":
        image = image.filter(ImageFilter.GaussianBlur(1.0))
    return image


def brightness(images: list[Image.Image]) -> torch.Tensor:
    return torch.tensor(
        [float(np.asarray(i.convert("L"), dtype=np.float64).mean()) for i in images], dtype=torch.float64
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=200, help="training pictures (default 200)")
    parser.add_argument("--windows", type=int, default=10, help="disjoint windows a scenario (default 10)")
    parser.add_argument("--window", type=int, default=100, help="pictures a window (default 100)")
    parser.add_argument(
        "--normal-windows",
        type=int,
        default=30,
        help="disjoint windows of normal pictures (default 30: the false-alarm rate of each test)",
    )
    parser.add_argument("--size", type=int, default=128, help="picture side and model input (default 128)")
    parser.add_argument("--category", default="weave")
    parser.add_argument("--weights", type=Path, help="a resnet18 state_dict file (default: seeded random weights)")
    parser.add_argument("--quick", action="store_true", help="60 training pictures, 4 windows of 50")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.train, args.windows, args.window, args.normal_windows = 60, 4, 50, 4
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = work_folder(args.workdir, "padim-drift-")
    weights = args.weights or seeded_resnet18(work / "resnet18-seed0.pth")
    rng = np.random.default_rng(0)
    training = [
        Image.fromarray((texture(args.category, args.size, rng) * 255 + 0.5).astype(np.uint8))
        for _ in range(args.train)
    ]
    started = time.perf_counter()
    detector = padim.fit(training, weights=str(weights), image_size=args.size, progress=False)
    fit_seconds = time.perf_counter() - started
    calibration = detector.calibration
    reference_brightness = brightness(training)
    print(
        f"{machine_name()}; {args.category} {args.size} px, {args.train} training pictures, fit {fit_seconds:.0f} s; "
        f"threshold promises {calibration.promised_false_alarm_rate:.2%} (bound {calibration.false_alarm_bound:.2%}); "
        f"{args.windows} windows of {args.window} a scenario ({args.normal_windows} of normal pictures), level {LEVEL}"
    )
    scorer = detector.scorer
    rows = []
    header = (
        f"{'scenario':<12} {'flag rate':>10} {'alarms: flag':>13} {'score KS':>9} {'input KS':>9} "
        f"{'brightness KS':>14} "
        f"{'score median':>13} {'input median':>13}"
    )
    print(header)
    for s, scenario in enumerate(SCENARIOS):
        alarms = {"flag_rate": 0, "score_drift": 0, "input_drift": 0, "brightness": 0}
        rates, score_ratio, input_ratio = [], [], []
        local = np.random.default_rng(100 + s)
        windows = args.normal_windows if scenario == "normal" else args.windows
        for _ in range(windows):
            images = [picture(scenario, local, args.size, args.category) for _ in range(args.window)]
            out = scorer.score(scorer.preprocess(images))
            reading = assess(out.raw_scores, calibration, out.input_distances)
            for name in reading.alarms:
                alarms[name] += 1
            # brightness may go either way: both one-sided tests, each at half the level
            shown = brightness(images)
            alarms["brightness"] += (
                min(ks_greater(shown, reference_brightness)[1], ks_greater(-shown, -reference_brightness)[1])
                < LEVEL / 2
            )
            rates.append(reading.flag_rate.rate)
            score_ratio.append(reading.score_drift.median_ratio)
            input_ratio.append(reading.input_drift.median_ratio)
        row = {
            "scenario": scenario,
            "windows": windows,
            "window": args.window,
            "mean_flag_rate": float(np.mean(rates)),
            **{f"alarm_rate_{k}": v / windows for k, v in alarms.items()},
            "score_median_ratio": float(np.median(score_ratio)),
            "input_median_ratio": float(np.median(input_ratio)),
        }
        rows.append(row)
        print(
            f"{scenario:<12} {row['mean_flag_rate']:>10.1%} {row['alarm_rate_flag_rate']:>13.0%} "
            f"{row['alarm_rate_score_drift']:>9.0%} {row['alarm_rate_input_drift']:>9.0%} "
            f"{row['alarm_rate_brightness']:>14.0%} "
            f"{row['score_median_ratio']:>13.3f} {row['input_median_ratio']:>13.3f}"
        )
    cost = overhead(detector, args.size, rng)
    print(
        f"cost at batch 16 ({detector.runtime}): scoring {cost['score_ms']:.1f} ms; monitoring a request of 16 "
        f"{cost['record_ms']:.3f} ms ({cost['record_share']:.2%}); input distances in the graph "
        f"{cost['input_distance_ms']:.3f} ms ({cost['input_distance_share']:.2%}); one reading of a full window of "
        f"{cost['window']} {cost['reading_ms']:.2f} ms; the window holds {cost['window_bytes']:,} bytes"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine_name(),
                    "category": args.category,
                    "size": args.size,
                    "train": args.train,
                    "fit_seconds": fit_seconds,
                    "level": LEVEL,
                    "calibration": calibration.summary(),
                    "scenarios": rows,
                    "cost": cost,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


def overhead(detector, size: int, rng: np.random.Generator, window: int = 2000, repeats: int = 20) -> dict:
    """Milliseconds: the scorer at batch 16, the monitor's work for a request of 16, one reading of a full window."""
    from padim.service.metrics import Metrics
    from padim.service.monitor import Monitor

    scorer = detector.scorer
    batch = scorer.preprocess(
        [Image.fromarray((texture("weave", size, rng) * 255).astype(np.uint8)) for _ in range(16)]
    )
    scorer.score(batch)
    score_ms = _median_ms(lambda: scorer.score(batch), repeats)
    calibration = scorer.calibration
    monitor, metrics = Monitor(calibration, window, LEVEL, 30), Metrics()
    out = scorer.score(batch)
    raws, inputs = out.raw_scores.tolist(), out.input_distances.tolist()
    results = [{"is_anomaly": r >= calibration.threshold, "score": calibration.score(r)} for r in raws]

    def record():
        monitor.record(raws, inputs, False)
        for result in results:
            metrics.verdicts.labels("m", "anomalous" if result["is_anomaly"] else "normal").inc()
            metrics.scores.labels("m").observe(result["score"])

    for _ in range(window // 16 + 1):
        record()
    record_ms = _median_ms(record, 200)
    reading_ms = _median_ms(monitor.to_dict, repeats)
    # the graph's share: the mean of the (B, T * P) squared distances it has anyway
    height, width = detector.describe()["grid"]
    squared = torch.rand(16, detector.config.tile_count * height * width)
    input_ms = _median_ms(lambda: squared.mean(1), 200)
    return {
        "score_ms": score_ms,
        "record_ms": record_ms,
        "record_share": record_ms / score_ms,
        "input_distance_ms": input_ms,
        "input_distance_share": input_ms / score_ms,
        "reading_ms": reading_ms,
        "window": window,
        "window_bytes": monitor.nbytes,
    }


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * float(np.median(times))


if __name__ == "__main__":
    sys.exit(main())
