"""Recall beside false alarms under a material's own variation: option sets through the product, side by side.

For every category and option set it fits a detector with ``padim.fit`` (what ``padim train`` does: the
backbone, the cover of ``--expect``, the out-of-fold calibration for 1% false alarms) on the training crops and
scores with :class:`padim.models.api.Detector` (what ``padim predict`` and the service do):

* **exchangeable**: unseen normal pictures of the training region (false alarms at the calibrated threshold),
  and defects drawn on such pictures (recall, image AUROC);
* **another region**: normal pictures from a region the fit never saw (false alarms: the column that counts),
  defects drawn there (recall, image AUROC, PRO to 30% FPR on the maps);
* **the line's changes**: the exchangeable normal pictures under each of :data:`NUISANCES` (brightness and
  contrast +-10%, a shift of 1-3 px, a turn of 1 degree, defocus sigma 0.5-1 px, JPEG quality 80, drawn as
  ``benchmarks/quality.py`` draws them): false alarms per change, the worst one printed;
* **the edge of the cover**: the same pictures with each change exactly at the edge of ``rough``'s declared range
  (:data:`EDGES`), and another region's normal pictures 20% brighter and darker: false alarms, the worst printed;
* **the price of the promise**: beside each split's recall, the recall of an *oracle* threshold that flags exactly
  as many of the unseen normal pictures as the calibrated one did (set just above the next one): how much of what
  the features separate the honest threshold keeps.

A category written ``<category>+light`` is a line whose lamp wanders (:data:`LINE_LIGHT`: every picture under one
seeded draw of brightness +-20% and contrast +-10%), its edges read on the pictures before the draw: what
``--expect auto`` is measured on. ``--fit-rounds N`` times the fits alone, the option sets interleaved.

Categories: photographed materials (:mod:`photographed`: brick, grass, gravel, stained tissue, the moon) and
generated ones (:func:`padim.models.data.synthetic.generate`; another region is the generator's ``region=0.5``,
as ``benchmarks/quality.py --grid robust`` reads it). Results per category, never only the mean; JSON with
``--output``. Seeded random resnet18 weights unless ``--backbone`` and ``--weights`` name others (HED's VGG16:
``--backbone vgg16 --weights`` the state_dict benchmarks/hed_weights.py writes).

    python benchmarks/shift.py                                   # every option set, every category (~40 min, 2 cores)
    python benchmarks/shift.py --options "n1-s0.5-rough,n3-s0-rough" --categories tissue,brick
    python benchmarks/shift.py --quick                           # 2 categories, 2 option sets: a smoke run
    python benchmarks/shift.py --categories brick,brick+light --options n3-s0.5-rough,n3-s0.5-auto --fit-rounds 3

An option set is written ``n<neighbourhood>-s<shrinkage or auto>-<expect>[-nofit][-b<blur sigma>][-pbf16|-pfp16]
[-znone|-zgain|-zchannels|-zpicture]`` (``train --precision``, ``train --standardise``: without one, gain, the
default); ``<expect>`` is a preset, ``auto`` or ``geometry``, ``rough``'s cover without its light
(``shift=6,rotate=2,blur=1.5,jpeg=60``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from photographed import KINDS, MATERIALS, SMALL_KINDS, write_category, write_tiled_category
from PIL import Image
from quality import nuisance
from sklearn.metrics import roc_auc_score
from timing import machine_name, work_folder

import padim
from padim.models.data.changes import Draw, Expected, apply, seeded
from padim.models.data.synthetic import DEFECTS, MORE_DEFECTS, generate
from padim.models.evaluation.metrics import per_region_overlap

GENERATED = ("carpet", "leather")
OPTION_SETS = (
    "n3-s0-rough",  # the default before this benchmark
    "n1-s0-stable",  # the paper's Gaussian (configs/paper.yaml without its blur)
    "n1-s0.5-stable",
    "n1-s0.3-typical",
    "n1-s0.5-typical",
    "n1-s0.7-typical",
    "n1-s0.5-rough",
)
METRICS = ("recall", "auroc", "pro")
#: ``rough`` without its light (``-geometry``): what a standardised picture's cover still has to insure.
GEOMETRY = "shift=6,rotate=2,blur=1.5,jpeg=60"
#: The line's changes read on the exchangeable normal pictures (as ``benchmarks/quality.py --grid robust``).
NUISANCES = ("brightness", "contrast", "shift", "rotate", "blur", "jpeg")
#: The same changes at the edge of ``rough``'s declared range (``--expect rough``: +-20%, 6 px, 2 degrees, sigma
#: 1.5 px, JPEG quality 60), each exactly there: a uniform draw within the range rarely lands at its edge.
EDGES = {
    "brighter20": Draw(brightness=1.2),
    "darker20": Draw(brightness=0.8),
    "contrast+20": Draw(contrast=1.2),
    "contrast-20": Draw(contrast=0.8),
    "shift6": Draw(dx=6 / 2**0.5, dy=6 / 2**0.5),
    "rotate2": Draw(angle=2.0),
    "blur1.5": Draw(sigma=1.5),
    "jpeg60": Draw(quality=60),
}
#: The edges another region's normal pictures are read at too.
REGION_EDGES = ("brighter20", "darker20")


def parse_options(name: str) -> dict:
    """``n1-s0.5-rough-nofit-b4`` -> padim.fit options."""
    parts = name.split("-")
    options = {
        "neighbourhood": int(parts[0][1:]),
        "shrinkage": "auto" if parts[1] == "sauto" else float(parts[1][1:]),
        "expect": {"stable": "", "geometry": GEOMETRY}.get(parts[2], parts[2]),
    }
    for extra in parts[3:]:
        if extra == "nofit":
            options["fit_changes"] = False
        elif extra.startswith("b"):
            options["blur_sigma"] = float(extra[1:])
        elif extra in ("pbf16", "pfp16"):  # train --precision
            options["precision"] = extra[1:]
        elif extra in ("znone", "zgain", "zchannels", "zpicture"):  # train --standardise
            options["standardise"] = extra[1:]
        else:
            raise SystemExit(f"unknown part {extra!r} of option set {name!r}")
    return options


def generated_category(root: Path, category: str, train: int, seed: int = 0) -> Path:
    """The generator's category in the photographed layout: ``region/`` from its ``region=0.5`` pictures."""
    folder = root / category
    if (folder / ".complete").exists():
        return folder
    kinds = DEFECTS + MORE_DEFECTS
    generate(root, (category,), train=train, test_good=20, test_defect=5, size=224, seed=seed, defects=kinds)
    other = root / f".{category}-region"
    generate(
        other, (category,), train=2, test_good=25, test_defect=5, size=224, seed=seed + 1, defects=kinds, region=0.5
    )
    (other / category).rename(folder / "region")
    shutil.rmtree(other)
    (folder / ".complete").touch()
    return folder


#: ``<category>+light``: a line whose lamp wanders: every picture of the category (training, normal and defect)
#: under one seeded draw of these changes, so that ``--expect auto`` finds them in the training pictures; the edges
#: are then read on the pictures as the category had them (``plain/``), the line's own range's edge.
LINE_LIGHT = Expected(brightness=0.2, contrast=0.1)


def line_category(root: Path, base: Path, changes: Expected = LINE_LIGHT) -> Path:
    """``base``'s pictures each under one seeded draw of ``changes`` (masks untouched), in ``<base>+light``; the
    normal test pictures as they were under ``plain/`` for the edges."""
    folder = root / f"{base.name}+light"
    if (folder / ".complete").exists():
        return folder
    for path in sorted(base.rglob("*.png")):
        relative = path.relative_to(base)
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if "ground_truth" in relative.parts:
            shutil.copyfile(path, target)
            continue
        with Image.open(path) as opened:
            picture = opened.convert("RGB")
        apply(picture, changes.draw(seeded(relative.as_posix()))).save(target)
        if relative.parent.name == "good" and "test" in relative.parts:
            plain = folder / "plain" / relative
            plain.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, plain)
    (folder / ".complete").touch()
    return folder


def pictures(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.png")) if folder.is_dir() else []


def mask_of(truth: Path, picture: Path, shape: tuple[int, int]) -> np.ndarray:
    path = truth / picture.parent.name / f"{picture.stem}_mask.png"
    mask = Image.open(path).convert("L").resize((shape[1], shape[0]), Image.NEAREST)
    return np.asarray(mask) > 127


def measure(
    category: Path, option_set: str, weights: str, heat_maps: Path | None = None, backbone: str = "resnet18"
) -> dict:
    options = {**parse_options(option_set), "backbone": backbone}
    tiled = category.name.endswith("-448")
    if tiled:  # 448 px pictures in 2 x 2 tiles of 224 px, one set of statistics per tile position
        options["tiles"] = (2, 2)
    started = time.perf_counter()
    detector = padim.fit(category / "train" / "good", weights=weights, progress=False, **options)
    fit_seconds = time.perf_counter() - started
    described = detector.describe()
    row: dict = {
        "category": category.name,
        "options": option_set,
        "fit_s": round(fit_seconds, 2),
        "threshold": detector.calibration.threshold,
        "expect": detector.config.gaussian.expect,
        "precision_check": described.get("precision_check"),
    }
    for split, where in (("exchangeable", category), ("region", category / "region")):
        if not (where / "test").is_dir():  # the tiled set has one region
            row[split] = {"false_alarms": 0, "normal": 0, "flagged": 0, "defects": 0, **dict.fromkeys(METRICS, None)}
            continue
        good = pictures(where / "test" / "good")
        defects = [p for kind in (SMALL_KINDS if tiled else KINDS) for p in pictures(where / "test" / kind)]
        normal = detector.predict(good)
        flawed = detector.predict(defects)
        if heat_maps is not None:  # the heat maps an operator reads (padim predict's), one defect of each kind
            for kind in KINDS:
                first = next((i for i, p in enumerate(defects) if p.parent.name == kind), None)
                if first is not None:
                    target = heat_maps / category.name / split / f"{kind}-{option_set}.png"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    flawed[first].heatmap(max_side=224).save(target)
        s_good = np.array([p.score for p in normal])
        s_bad = np.array([p.score for p in flawed])
        maps = np.stack([p.anomaly_map for p in flawed + normal])
        masks = np.stack(
            [mask_of(where / "ground_truth", p, maps.shape[1:]) for p in defects]
            + [np.zeros(maps.shape[1:], bool) for _ in good]
        )
        false_alarms = int((s_good > 0.5).sum())
        row[split] = {
            "false_alarms": false_alarms,
            "normal": len(good),
            "flagged": int((s_bad > 0.5).sum()),
            "oracle_flagged": int((s_bad > oracle_threshold(s_good, false_alarms)).sum()),
            "defects": len(defects),
            "recall": round(float((s_bad > 0.5).mean()), 3),
            "auroc": round(float(roc_auc_score([0] * len(good) + [1] * len(defects), np.r_[s_good, s_bad])), 3),
            "pro": round(float(per_region_overlap(maps, masks)), 3),
        }
    rng = np.random.default_rng(7)
    good = [Image.open(p).convert("RGB") for p in pictures(category / "test" / "good")]
    plain = category / "plain"  # a line category: its edges are read on the pictures before the line's draw
    edge_good = [Image.open(p).convert("RGB") for p in pictures(plain / "test" / "good")] if plain.is_dir() else good
    row["nuisances"] = {
        kind: int((detector.scores([apply(picture, nuisance(kind, rng)) for picture in good]) > 0.5).sum())
        for kind in NUISANCES
    }
    row["nuisance_pictures"] = len(good)
    row["edges"] = {
        kind: int((detector.scores([apply(p, draw) for p in edge_good]) > 0.5).sum()) for kind, draw in EDGES.items()
    }
    region_folder = (plain if plain.is_dir() else category) / "region" / "test" / "good"
    region_good = [Image.open(p).convert("RGB") for p in pictures(region_folder)]
    row["region_edges"] = {
        kind: int((detector.scores([apply(p, EDGES[kind]) for p in region_good]) > 0.5).sum()) if region_good else 0
        for kind in REGION_EDGES
    }
    row["region_pictures"] = len(region_good)
    return row


def fit_times(
    categories: dict[str, Path], option_sets: list[str], weights: str, rounds: int, backbone: str = "resnet18"
) -> dict:
    """Seconds of ``padim.fit`` (what ``padim train`` runs) on each category's training pictures for each option set,
    the option sets interleaved round by round so that a slow moment of the machine hits each: medians, and each
    option set's median over the first's, per category and summed."""
    seconds: dict[str, dict[str, list[float]]] = {name: {o: [] for o in option_sets} for name in categories}
    measuring: dict[str, float] = {}
    for round_ in range(rounds):
        for name, category in categories.items():
            for option_set in option_sets if round_ % 2 == 0 else option_sets[::-1]:
                started = time.perf_counter()
                detector = padim.fit(
                    category / "train" / "good",
                    weights=weights,
                    progress=False,
                    backbone=backbone,
                    **parse_options(option_set),
                )
                seconds[name][option_set].append(time.perf_counter() - started)
                if detector.report is not None and "measure" in detector.report.seconds:
                    measuring[name] = round(detector.report.seconds["measure"], 3)
                print(f"fit time, round {round_ + 1}: {name} {option_set} {seconds[name][option_set][-1]:.2f} s")
    medians = {name: {o: statistics.median(v) for o, v in by.items()} for name, by in seconds.items()}
    first = option_sets[0]
    return {
        "rounds": rounds,
        "median_s": {name: {o: round(v, 2) for o, v in by.items()} for name, by in medians.items()},
        "ratio_to_first": {name: {o: round(v / by[first], 3) for o, v in by.items()} for name, by in medians.items()},
        "ratio_summed": {
            o: round(sum(m[o] for m in medians.values()) / sum(m[first] for m in medians.values()), 3)
            for o in option_sets
        },
        "measure_s": measuring,
    }


def oracle_threshold(normal: np.ndarray, false_alarms: int) -> float:
    """The threshold that flags exactly ``false_alarms`` of the ``normal`` scores (just above the next one): what an
    oracle that saw the unseen normal pictures would set for the false alarms the calibrated threshold gave."""
    ranked = np.sort(normal)[::-1]
    return float(ranked[false_alarms]) if false_alarms < len(ranked) else -np.inf


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for option_set in dict.fromkeys(r["options"] for r in rows):
        mine = [r for r in rows if r["options"] == option_set]
        entry = {"options": option_set}
        for split in ("exchangeable", "region"):
            read = [r for r in mine if r[split]["normal"]]
            entry[split] = {
                "false_alarms": sum(r[split]["false_alarms"] for r in read),
                "normal": sum(r[split]["normal"] for r in read),
                "recall": round(sum(r[split]["flagged"] for r in read) / sum(r[split]["defects"] for r in read), 3)
                if read
                else None,
                "oracle_recall": round(
                    sum(r[split]["oracle_flagged"] for r in read) / sum(r[split]["defects"] for r in read), 3
                )
                if read
                else None,
                "auroc": round(statistics.mean(r[split]["auroc"] for r in read), 3) if read else None,
                "pro": round(statistics.mean(r[split]["pro"] for r in read), 3) if read else None,
            }
        entry["nuisances"] = {k: sum(r["nuisances"][k] for r in mine) for k in NUISANCES}
        entry["nuisance_pictures"] = sum(r["nuisance_pictures"] for r in mine)
        entry["edges"] = {k: sum(r["edges"][k] for r in mine) for k in EDGES}
        entry["region_edges"] = {k: sum(r["region_edges"][k] for r in mine) for k in REGION_EDGES}
        entry["region_pictures"] = sum(r["region_pictures"] for r in mine)
        entry["fit_s"] = round(statistics.mean(r["fit_s"] for r in mine), 2)
        out.append(entry)
    return out


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(
        f"{'options':26s} | {'exch FA':>8s} {'recall':>6s} {'oracle':>6s} {'AUROC':>6s} | "
        f"{'region FA':>9s} {'recall':>6s} {'oracle':>6s} {'AUROC':>6s} {'PRO':>5s} | {'worst change FA':>18s} | "
        f"{'worst edge FA':>18s} | {'region +20%':>11s} | {'fit s':>5s}"
    )
    for r in rows:
        e, g = r["exchangeable"], r["region"]
        name = r["options"] if "category" not in r else f"{r['category']}:{r['options']}"
        worst = max(r["nuisances"], key=r["nuisances"].get)
        change = f"{worst} {r['nuisances'][worst]}/{r['nuisance_pictures']}"
        edge = max(r["edges"], key=r["edges"].get)
        edge_text = f"{edge} {r['edges'][edge]}/{r['nuisance_pictures']}"
        bright = f"{r['region_edges']['brighter20']}/{r['region_pictures']}"
        print(
            f"{name:26s} | {e['false_alarms']:>3d}/{e['normal']:<4d} {_f(e['recall'])} {_f(oracle(e))} "
            f"{_f(e['auroc'])} | {g['false_alarms']:>4d}/{g['normal']:<4d} {_f(g['recall'])} {_f(oracle(g))} "
            f"{_f(g['auroc'])} {_f(g['pro'], 5)} | {change:>18s} | {edge_text:>18s} | {bright:>11s} | {r['fit_s']:5.1f}"
        )


def oracle(split: dict) -> float | None:
    """The oracle's recall of a split: summed (``oracle_recall``) or of one category (``oracle_flagged``)."""
    if "oracle_recall" in split:
        return split["oracle_recall"]
    return round(split["oracle_flagged"] / split["defects"], 3) if split["defects"] else None


def _f(value: float | None, width: int = 6) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--categories",
        default=",".join(MATERIALS + GENERATED),
        help="photographed materials, generated categories, and <material>-448 (448 px crops, small defects, a model "
        "of 2 x 2 tiles)",
    )
    parser.add_argument("--options", default=",".join(OPTION_SETS), help="option sets (module docstring)")
    parser.add_argument("--train", type=int, default=60, help="training pictures a category")
    parser.add_argument("--weights", default="random", help="random (seeded) or a state_dict file of --backbone's")
    parser.add_argument("--backbone", default="resnet18", help="torchvision backbone (default resnet18)")
    parser.add_argument("--quick", action="store_true", help="tissue and carpet, two option sets")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--maps", type=Path, help="save the heat map of one defect of each kind per option set here")
    parser.add_argument(
        "--fit-rounds",
        type=int,
        default=0,
        help="also time the fits alone: this many interleaved rounds of every option set on each category (and on "
        "--fit-categories), medians",
    )
    parser.add_argument(
        "--fit-categories",
        default="",
        help="generated categories timed beside the others (e.g. pill: a placed part, which --expect auto registers)",
    )
    parser.add_argument("--skip-quality", action="store_true", help="time the fits only (--fit-rounds)")
    args = parser.parse_args()
    if args.quick:
        args.categories, args.options = "tissue,carpet", "n3-s0-rough,n1-s0.5-rough"
    root = work_folder(args.workdir, "padim-shift-")
    rows = []
    folders: dict[str, Path] = {}
    for name in args.categories.split(","):
        line, name = name.endswith("+light"), name.removesuffix("+light")
        if name.endswith("-448"):
            category = write_tiled_category(root, name.removesuffix("-448"), train=args.train)
        elif name in MATERIALS:
            category = write_category(root, name, train=args.train)
        else:
            category = generated_category(root, name, args.train)
        if line:
            category = line_category(root, category)
        folders[category.name] = category
        if args.skip_quality:
            continue
        for option_set in args.options.split(","):
            row = measure(category, option_set, args.weights, args.maps, args.backbone)
            rows.append(row)
            print_table([row], f"{name} / {option_set}")
            sys.stdout.flush()
    result = {
        "machine": machine_name(),
        "weights": args.weights,
        "backbone": args.backbone,
        "train": args.train,
        "rows": rows,
        "photographed": summarise([r for r in rows if r["category"] in MATERIALS]),
        "generated": summarise([r for r in rows if r["category"] in GENERATED]),
        "photographed_light": summarise(
            [r for r in rows if r["category"].removesuffix("+light") in MATERIALS and r["category"].endswith("+light")]
        ),
        "generated_light": summarise(
            [r for r in rows if r["category"].removesuffix("+light") in GENERATED and r["category"].endswith("+light")]
        ),
        "tiled": summarise([r for r in rows if r["category"].endswith("-448")]),
    }
    if args.fit_rounds:
        for name in filter(None, args.fit_categories.split(",")):
            generate(root / "timed", (name,), train=args.train, test_good=1, test_defect=1, size=224, seed=0)
            folders[name] = root / "timed" / name
        result["fit_time"] = fit_times(folders, args.options.split(","), args.weights, args.fit_rounds, args.backbone)
        print(json.dumps(result["fit_time"], indent=1))
    print_table(rows, "every category")
    for kind in ("photographed", "generated", "photographed_light", "generated_light", "tiled"):
        if result[kind]:
            print_table(result[kind], f"{kind}: sums of false alarms, pooled recall, mean AUROC / PRO")
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
