"""Verdicts on unseen images: the old hold-out rule against cross-fitted calibration, fold by fold setting.

For each generated category and each training-set size M, fit on M normal images and count,
on images no model has seen:

- false alarms: fresh normal images flagged (the requested rate is ``--false-alarm-rate``);
- defects flagged: images with a scratch, stain or hole that are flagged.

Rules, same backbone weights, same channels, same images:

- **holdout** (model format 1): hold out ~10% of the images (at least 3) by a hash of their
  name, fit the rest, threshold = the 0.99 quantile of the held-out scores;
- **folds=K** for each ``--folds`` entry (an integer, or ``loo``): ``padim.models.fit_detector``
  as ``padim train`` runs it with ``--calibration-folds K``: fit every image, threshold from the
  out-of-fold scores of all of them (:mod:`padim.core.calibration`, :mod:`padim.core.out_of_fold`).

The fit costs are :mod:`benchmarks.fit_cost`'s. Writes
``benchmarks/results/<date>-<machine>-calibration.{json,md}``.

    python benchmarks/calibration.py                       # 5 categories, M = 10..160, folds 20 and loo
    python benchmarks/calibration.py --quick               # 2 categories, M = 10, 40; a few minutes
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
from pathlib import Path

import torch
from PIL import Image
from timing import machine_name, work_folder

from padim.core.scoring import anomaly_maps, image_scores, squared_mahalanobis
from padim.core.statistics import GaussianAccumulator, finalise
from padim.models import Fit, PadimConfig, fit_detector, training_images
from padim.models.data.synthetic import CATEGORIES, DEFECTS, generate

HERE = Path(__file__).resolve().parent


def old_rule_threshold(
    fit: Fit, names: list[str], embedded: torch.Tensor, quantile: float = 0.99, fraction: float = 0.1, minimum: int = 3
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Model format 1: mean, precision factor and threshold from a per-name hold-out.

    An image is held out when the first 8 bytes of the sha256 of its name, over 2^64, are below
    ``fraction``; the smallest keys are added until ``minimum`` are held out; at least two are fitted.
    """
    keys = [int.from_bytes(hashlib.sha256(n.encode()).digest()[:8], "big") / 2.0**64 for n in names]
    held = {i for i, k in enumerate(keys) if k < fraction}
    for i in sorted(range(len(names)), key=keys.__getitem__):
        if len(held) >= minimum:
            break
        held.add(i)
    while len(names) - len(held) < 2 and held:
        held.remove(max(held, key=keys.__getitem__))
    fitted = [i for i in range(len(names)) if i not in held]
    accumulator = GaussianAccumulator().partial_fit(embedded[fitted])
    mean, factor = finalise(accumulator.state, fit.config.gaussian.epsilon, fit.embedder.grid_shape)
    held_scores = scores_of(fit, embedded[sorted(held)], mean, factor)
    return mean, factor, float(torch.quantile(held_scores, quantile))


def scores_of(fit: Fit, embedded: torch.Tensor, mean: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Raw image scores ``(N,)`` of ``(N, P, D)`` embeddings, a batch at a time."""
    out = []
    for start in range(0, embedded.shape[0], 32):
        squared = squared_mahalanobis(embedded[start : start + 32], mean, factor)
        maps = anomaly_maps(
            squared, fit.embedder.grid_shape, fit.config.features.image_size, fit.config.scoring.blur_sigma
        )
        out.append(image_scores(maps).double())
    return torch.cat(out)


def embed_all(fit: Fit, paths: list[Path], batch: int = 16) -> torch.Tensor:
    return torch.cat(
        [
            fit.embedder(fit.embedder.preprocess([Image.open(p).convert("RGB") for p in paths[i : i + batch]]))
            for i in range(0, len(paths), batch)
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--sizes", default="10,20,40,80,160", help="training-set sizes M")
    parser.add_argument("--fresh", type=int, default=200, help="unseen normal images per category")
    parser.add_argument("--defects", type=int, default=12, help="unseen images per defect type and category")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--false-alarm-rate", type=float, default=0.01)
    parser.add_argument("--weights", default="random", help="random (seeded) or a resnet18 state_dict file")
    parser.add_argument("--folds", default="20,loo", help="calibration folds to compare (integers or loo)")
    parser.add_argument("--quick", action="store_true", help="2 categories, M = 10 and 40, 60 fresh images")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.categories, args.sizes, args.fresh, args.defects = "weave,leather", "10,40", 60, 6
    categories = [c for c in args.categories.split(",") if c]
    sizes = sorted(int(m) for m in args.sizes.split(","))
    folds = [f if f == "loo" else int(f) for f in args.folds.split(",") if f]
    rules = ["holdout", *(f"folds={k}" for k in folds)]
    torch.set_num_threads(os.cpu_count() or 1)
    work = work_folder(args.workdir, "padim-calibration-")
    data = work / "data"
    if not all((data / c).exists() for c in categories):
        generate(
            data, tuple(categories), train=max(sizes), test_good=args.fresh, test_defect=args.defects, size=256, seed=11
        )
    config = PadimConfig(
        weights=args.weights,
        image_size=args.image_size,
        false_alarm_rate=args.false_alarm_rate,
        decode_workers=2,
        device="cpu",
    )
    rows: dict = {}
    for category in categories:
        root = data / category
        train = training_images(root / "train" / "good")
        fresh = sorted((root / "test" / "good").glob("*.png"))
        defects = sorted(p for d in DEFECTS for p in (root / "test" / d).glob("*.png"))
        fit = Fit.start(config)
        train_embedded, fresh_embedded, defect_embedded = (
            embed_all(fit, paths) for paths in ([i.path for i in train], fresh, defects)
        )
        for m in sizes:
            mean, factor, threshold = old_rule_threshold(fit, [i.name for i in train[:m]], train_embedded[:m])
            found = {
                "holdout": (
                    scores_of(fit, fresh_embedded, mean, factor),
                    scores_of(fit, defect_embedded, mean, factor),
                    threshold,
                    None,
                    None,
                )
            }
            for k in folds:
                detector, report = fit_detector(config.replace(calibration_folds=k), train[:m], progress=False)
                cal = detector.calibration
                found[f"folds={k}"] = (
                    scores_of(fit, fresh_embedded, detector.model.mean, detector.model.precision_factor),
                    scores_of(fit, defect_embedded, detector.model.mean, detector.model.precision_factor),
                    cal.threshold,
                    cal,
                    report,
                )
            row = {}
            for rule, (good, bad, t, cal, report) in found.items():
                row[rule] = {
                    "false_alarms": int((good >= t).sum()),
                    "fresh": len(good),
                    "flagged": int((bad >= t).sum()),
                    "defects": len(bad),
                    "threshold": t,
                }
                if cal is not None:
                    row[rule].update(
                        method=cal.method,
                        promised=cal.promised_false_alarm_rate,
                        bound=cal.false_alarm_bound,
                        seconds=report.seconds,
                    )
            rows.setdefault(m, {})[category] = row
            print(
                f"{category:8s} M={m:4d}  "
                + " | ".join(
                    f"{rule}: {r['false_alarms']:3d}/{r['fresh']} false alarms, {r['flagged']:3d}/{r['defects']} "
                    "defects"
                    for rule, r in row.items()
                ),
                flush=True,
            )

    report = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_name(),
        "torch": torch.__version__,
        "image_size": args.image_size,
        "weights": args.weights,
        "false_alarm_rate": args.false_alarm_rate,
        "rules": rules,
        "categories": categories,
        "sizes": rows,
    }
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    stem = results / f"{report['date']}-{report['machine']}-calibration"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {stem}.json and .md")


def markdown(report: dict) -> str:
    rate = report["false_alarm_rate"]
    rules = report["rules"]
    lines = [
        f"Calibration on unseen images: {len(report['categories'])} generated categories "
        f"({', '.join(report['categories'])}), resnet18 {report['image_size']} px, {report['weights']} weights, "
        f"requested false-alarm rate {rate:.0%}; {report['machine']}, {report['date']}",
        "",
        "| M | "
        + " | ".join(f"{r}: false alarms | {r}: defects flagged" for r in rules)
        + " | "
        + " | ".join(f"{r}: worst category | {r}: promised (mean)" for r in rules if r != "holdout")
        + " |",
        "|---|" + "---|---|" * len(rules) + "---|---|" * (len(rules) - 1),
    ]
    for m, by_category in sorted(report["sizes"].items(), key=lambda kv: int(kv[0])):
        cells = [str(m)]
        for rule in rules:
            fa = sum(r[rule]["false_alarms"] for r in by_category.values())
            fresh = sum(r[rule]["fresh"] for r in by_category.values())
            flagged = sum(r[rule]["flagged"] for r in by_category.values())
            defects = sum(r[rule]["defects"] for r in by_category.values())
            cells += [f"{fa}/{fresh} ({fa / fresh:.1%})", f"{flagged}/{defects} ({flagged / defects:.0%})"]
        for rule in rules:
            if rule == "holdout":
                continue
            worst = max(by_category.items(), key=lambda kv: kv[1][rule]["false_alarms"] / kv[1][rule]["fresh"])
            cells.append(f"{worst[1][rule]['false_alarms']}/{worst[1][rule]['fresh']} ({worst[0]})")
            cells.append(f"{sum(r[rule]['promised'] for r in by_category.values()) / len(by_category):.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
