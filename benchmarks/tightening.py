"""A threshold tightened by the line, against the cover's and an oracle's, after 100, 500 and 2,000 line pictures.

For every category it fits a detector with the defaults (``padim.fit``: what ``padim train`` does, the cover of
``--expect rough`` and the out-of-fold calibration for 1% false alarms), then plays a steady line twice, once on
the training region (*exchangeable*) and once on a region the fit never saw (*another region*):

* **the line**: ``--line`` (2,000) normal pictures of that region, scored as the service scores them; the
  threshold the line sets after its first ``n`` pictures is
  :meth:`padim.core.calibration.Calibration.tightened` of their raw scores (what ``POST /models/{name}/threshold``
  writes), for each ``n`` of ``--after``; where the line has more than ``n``, each disjoint block of ``n`` pictures
  sets one, and the figures are their mean (the spread of a single proposal is printed beside);
* **held out**: ``--held-out`` (400) further normal pictures of the region, never in the line's blocks: the false
  alarms each threshold gives;
* **defects** drawn on pictures of the region (the 8 kinds of ``benchmarks/shift.py``): the recall each threshold
  gives, and an **oracle**'s: the threshold that flags exactly as many held-out normal pictures as the one compared
  (just above the next one), so that the share of the oracle's recall kept compares like with like.

Categories: photographed materials (:mod:`photographed`: brick, grass, gravel, stained tissue, the moon; crops of
the left half are the training region, of the right half another) and generated ones (the generator's
``region=0.5`` is another region). Seeded random resnet18 weights unless ``--weights`` names a state_dict.

    python benchmarks/tightening.py                              # 7 categories (~25 min on 2 cores)
    python benchmarks/tightening.py --categories brick,carpet --line 600 --held-out 200   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from photographed import CROP, KINDS, MATERIALS, crops, photograph
from PIL import Image
from timing import machine_name

import padim
from padim.models.data.synthetic import add_defect, texture

GENERATED = ("carpet", "leather")
AFTER = (100, 500, 2000)
SPLITS = ("exchangeable", "region")
RATE = 0.01


def category_pictures(name: str, train: int, line: int, held_out: int, defects: int) -> dict:
    """The training pictures, and per split the line's, the held-out normal and the defect pictures (PIL, RGB)."""
    to_image = lambda array: Image.fromarray(np.asarray(array, dtype=np.uint8))  # noqa: E731
    out: dict = {}
    if name in MATERIALS:
        rng = np.random.default_rng([11, MATERIALS.index(name)])
        photo = photograph(name)
        out["train"] = [to_image(c) for c in crops(photo, 0, train, rng)]
        for split, half in zip(SPLITS, (0, 1), strict=True):
            flawed = []
            for kind in KINDS:
                for crop in crops(photo, half, defects, rng):
                    image, _ = add_defect(crop.astype(np.float32) / 255.0, kind, rng)
                    flawed.append(to_image((np.clip(image, 0, 1) * 255).round()))
            out[split] = {
                "line": [to_image(c) for c in crops(photo, half, line, rng)],
                "held_out": [to_image(c) for c in crops(photo, half, held_out, rng)],
                "defects": flawed,
            }
        return out
    rng = np.random.default_rng([11, GENERATED.index(name)])
    as_image = lambda array: to_image(array * 255 + 0.5)  # noqa: E731
    out["train"] = [as_image(texture(name, 224, rng)) for _ in range(train)]
    for split, region in zip(SPLITS, (0.0, 0.5), strict=True):
        flawed = []
        for kind in KINDS:
            for _ in range(defects):
                image, _ = add_defect(texture(name, 224, rng, region), kind, rng)
                flawed.append(as_image(np.clip(image, 0, 1)))
        out[split] = {
            "line": [as_image(texture(name, 224, rng, region)) for _ in range(line)],
            "held_out": [as_image(texture(name, 224, rng, region)) for _ in range(held_out)],
            "defects": flawed,
        }
    return out


def raw_scores(detector, images) -> np.ndarray:
    return np.array([p.raw_score for p in detector.predict(images)], dtype=np.float64)


def judged(threshold: float, held_out: np.ndarray, defects: np.ndarray) -> dict:
    """False alarms and recall at ``threshold``, and the oracle's recall at as many false alarms."""
    false_alarms = int((held_out >= threshold).sum())
    ranked = np.sort(held_out)[::-1]
    oracle = float(ranked[false_alarms]) if false_alarms < len(ranked) else -np.inf
    recall = float((defects >= threshold).mean())
    oracle_recall = float((defects > oracle).mean())
    return {
        "threshold": threshold,
        "false_alarms": false_alarms,
        "recall": recall,
        "oracle_recall": oracle_recall,
        "kept": recall / oracle_recall if oracle_recall else None,
    }


def measure(name: str, args: argparse.Namespace) -> dict:
    made = category_pictures(name, args.train, args.line, args.held_out, args.defects)
    started = time.perf_counter()
    detector = padim.fit(made["train"], weights=args.weights, progress=False)
    row: dict = {"category": name, "fit_s": round(time.perf_counter() - started, 2)}
    calibration = detector.calibration
    for split in SPLITS:
        pictures = made[split]
        line, held_out, defects = (raw_scores(detector, pictures[k]) for k in ("line", "held_out", "defects"))
        results = {"cover": judged(calibration.threshold, held_out, defects)}
        for n in args.after:
            if n > len(line):
                continue
            blocks = [line[i : i + n] for i in range(0, len(line) - n + 1, n)]
            each = [
                judged(calibration.tightened(torch.from_numpy(b), RATE).threshold, held_out, defects) for b in blocks
            ]
            results[str(n)] = {
                "proposals": len(each),
                **{k: statistics.fmean(e[k] for e in each) for k in ("threshold", "false_alarms", "recall")},
                "oracle_recall": statistics.fmean(e["oracle_recall"] for e in each),
                "false_alarms_max": max(e["false_alarms"] for e in each),
                "recall_min": min(e["recall"] for e in each),
            }
            kept = results[str(n)]["recall"] / results[str(n)]["oracle_recall"]
            results[str(n)]["kept"] = kept if results[str(n)]["oracle_recall"] else None
        row[split] = {"held_out": len(held_out), "defects": len(defects), **results}
    return row


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'category':10s} {'split':12s} {'threshold set by':>16s} {'false alarms':>13s} {'recall':>7s} "
        f"{'oracle':>7s} {'kept':>6s} {'worst FA':>9s}"
    )
    for row in rows:
        for split in SPLITS:
            result = row[split]
            for key in ["cover", *[k for k in result if k.isdigit()]]:
                r = result[key]
                who = "the cover" if key == "cover" else f"{key} line pictures"
                kept = "-" if r["kept"] is None else f"{r['kept']:.0%}"
                worst = "" if key == "cover" else f"{r['false_alarms_max']}/{result['held_out']}"
                print(
                    f"{row['category']:10s} {split:12s} {who:>16s} {r['false_alarms']:>7.1f}/{result['held_out']:<5d} "
                    f"{r['recall']:7.3f} {r['oracle_recall']:7.3f} {kept:>6s} {worst:>9s}"
                )


def pooled(rows: list[dict]) -> dict:
    """Per split and threshold: false alarms summed (mean per proposal), recall and the oracle's averaged."""
    out: dict = {}
    for split in SPLITS:
        keys = ["cover", *[str(n) for n in AFTER]]
        for key in keys:
            present = [r[split][key] for r in rows if key in r[split]]
            if not present:
                continue
            recall = statistics.fmean(p["recall"] for p in present)
            oracle = statistics.fmean(p["oracle_recall"] for p in present)
            out[f"{split}/{key}"] = {
                "false_alarms": round(sum(p["false_alarms"] for p in present), 2),
                "held_out": sum(r[split]["held_out"] for r in rows if key in r[split]),
                "recall": round(recall, 3),
                "oracle_recall": round(oracle, 3),
                "kept": round(recall / oracle, 3) if oracle else None,
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--categories", default=",".join(MATERIALS + GENERATED))
    parser.add_argument("--train", type=int, default=60, help="training pictures a category")
    parser.add_argument("--line", type=int, default=2000, help="line pictures a split")
    parser.add_argument("--held-out", type=int, default=400, help="held-out normal pictures a split")
    parser.add_argument("--defects", type=int, default=5, help="defect pictures of each kind a split")
    parser.add_argument("--after", default=",".join(map(str, AFTER)), help="line pictures before a proposal")
    parser.add_argument("--weights", default="random")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    args.after = tuple(int(n) for n in args.after.split(","))
    torch.manual_seed(0)
    rows = []
    for name in args.categories.split(","):
        started = time.perf_counter()
        rows.append(measure(name, args))
        print_rows(rows[-1:])
        print(f"  ({time.perf_counter() - started:.0f} s)")
        sys.stdout.flush()
    kinds = {
        "photographed": [r for r in rows if r["category"] in MATERIALS],
        "generated": [r for r in rows if r["category"] not in MATERIALS],
    }
    result = {
        "machine": machine_name(),
        "weights": args.weights,
        "train": args.train,
        "crop": CROP,
        "rate": RATE,
        "rows": rows,
        **{kind: pooled(found) for kind, found in kinds.items() if found},
    }
    for kind, found in kinds.items():
        if found:
            print(f"\n{kind}: false alarms summed over categories, recall and the oracle's averaged")
            for key, value in result[kind].items():
                print(f"  {key:20s} {json.dumps(value)}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
