"""Can a fit choose its options from its own pictures? Drawn defects on held-out training cells against real ones.

A rule that lets ``padim train`` choose an option (``--standardise gain`` or ``none``, the neighbourhood, the
smoothing) from the training pictures alone must rank the candidates as real defects do. This benchmark tests the
most general such rule, self-validation with drawn defects (as CutPaste and DRAEM train on them): each cell type's
300 training cells of benchmarks/real.py's seeded split are halved (seeded); each option set is fitted with
``padim train`` on one half, and scores the other half as it is and with a defect drawn on each picture (five kinds,
each relative to the picture's own light, so that no colour of the generator is assumed: a dark area, a large dark
area, a thin dark line, a bright area, a patch of the picture pasted elsewhere, turned). The *self* AUROC separates
the held-out half from its drawn copies; the *real* AUROC separates ELPV's 150 unseen good cells from its defective
ones under the same model. A rule is worth building where the self AUROC orders the option sets as the real one does,
on both cell types and both backbones.

    python benchmarks/self_selection.py                                   # gain and none, both cells and backbones
    python benchmarks/self_selection.py --backbones resnet18-random --sets gain none 'n1=--neighbourhood 1'

Prints a row per cell type, backbone and option set (the self AUROC, each drawn kind's, the real AUROC of the same
model) and, per cell type and backbone, whether the self AUROC picks the option set the real one ranks first. Saved
to ``benchmarks/results/<date>-<machine>-self-selection.json`` (``--out``). The material is real.py's (downloaded at
run time, never committed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter
from real import BACKBONES, CELLS, elpv, option_sets, split
from sklearn.metrics import roc_auc_score
from timing import machine_name

HERE = Path(__file__).resolve().parent
#: the drawn kinds, each relative to the picture's own light
KINDS = ("dark", "large_dark", "line", "bright", "cut_paste")
#: the option sets offered by name: the default's light (gain) and the pictures as they are
SETS = {"gain": [], "none": ["--standardise", "none"]}


def drawn(picture: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """``picture`` (``(H, W)`` uint8) with one defect of ``kind`` drawn on it, relative to its own light."""
    x = picture.astype(np.float64) / 255
    size = x.shape[0]
    if kind == "cut_paste":
        h, w = (rng.uniform(0.08, 0.2, 2) * size).astype(int)
        sy, sx, ty, tx = (int(rng.integers(0, size - s)) for s in (h, w, h, w))
        patch = x[sy : sy + h, sx : sx + w]
        x[ty : ty + h, tx : tx + w] = patch[::-1, ::-1]  # turned half a circle: another place's content, upside down
        return (x * 255 + 0.5).astype(np.uint8)
    mask = Image.new("L", (size, size), 0)
    pen = ImageDraw.Draw(mask)
    cx, cy = rng.uniform(0.15, 0.85, 2) * size
    if kind == "line":  # a jagged thin line, as a crack
        points, angle = [(cx, cy)], rng.uniform(0, 2 * np.pi)
        for _ in range(int(rng.integers(4, 9))):
            angle += rng.uniform(-0.5, 0.5)
            step = rng.uniform(0.03, 0.07) * size
            points.append((points[-1][0] + np.cos(angle) * step, points[-1][1] + np.sin(angle) * step))
        pen.line(points, fill=255, width=max(1, size // 120))
    else:  # an irregular area with soft edges
        corners = int(rng.integers(5, 10))
        radius = rng.uniform(0.2, 0.35) * size if kind == "large_dark" else rng.uniform(0.06, 0.18) * size
        angles = np.sort(rng.uniform(0, 2 * np.pi, corners))
        radii = radius * rng.uniform(0.5, 1.2, corners)
        pen.polygon([(cx + r * np.cos(a), cy + r * np.sin(a)) for a, r in zip(angles, radii, strict=True)], fill=255)
        mask = mask.filter(ImageFilter.GaussianBlur(size / 150))
    alpha = np.asarray(mask, dtype=np.float64) / 255
    factor = rng.uniform(1.3, 1.7) if kind == "bright" else rng.uniform(0.2, 0.6)
    return (np.clip(x * (1 - alpha + alpha * factor), 0, 1) * 255 + 0.5).astype(np.uint8)


def auroc(good: np.ndarray, bad: np.ndarray) -> float:
    return float(roc_auc_score(np.r_[np.zeros(len(good)), np.ones(len(bad))], np.r_[good, bad]))


def raw_scores(cli: list[str], model: Path, folders: dict[str, Path], work: Path) -> dict[str, np.ndarray]:
    """``padim predict`` of every folder: its pictures' raw scores, by folder name."""
    out = work / "predicted"
    subprocess.run(
        [*cli, "-q", "predict", str(model), *map(str, folders.values()), "--output", str(out), "--no-heatmaps",
         "--no-maps"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {
        name: np.array([r["raw_score"] for r in results if Path(r["path"]).parent.name == folder.name])
        for name, folder in folders.items()
    }


def lay_out(root: Path, cells: dict[str, list[str]], seed: int, folder: Path) -> dict[str, Path]:
    """The halves of the training cells (``fit``, ``held``), the held half with each kind drawn (one folder a kind),
    and the real test folders, under ``folder``."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(cells["train"]))
    half = len(order) // 2
    parts = {
        "fit": [cells["train"][i] for i in order[:half]],
        "held": [cells["train"][i] for i in order[half:]],
        "good": cells["good"],
        "defective": cells["defective"],
    }
    folders = {}
    for name, paths in parts.items():
        target = folders[name] = folder / name
        target.mkdir(parents=True)
        for path in paths:
            (target / Path(path).name).symlink_to((root / path).resolve())
    for k, kind in enumerate(KINDS):
        target = folders[kind] = folder / kind
        target.mkdir()
        for i, path in enumerate(parts["held"]):
            picture = np.asarray(Image.open(root / path).convert("L"))
            Image.fromarray(drawn(picture, kind, np.random.default_rng([seed, k, i]))).save(target / f"{i:03d}.png")
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "padim-bench" / "real")
    parser.add_argument("--seed", type=int, default=0, help="the split's seed, and the halves' and the drawing's")
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS)
    parser.add_argument("--backbones", nargs="+", default=list(BACKBONES), choices=list(BACKBONES))
    parser.add_argument("--sets", nargs="+", default=list(SETS), help="option sets: gain, none or NAME=FLAGS")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/<date>-<machine>-...)")
    args = parser.parse_args()
    sets = {name: SETS[name] for name in args.sets if name in SETS}
    sets.update(option_sets([name for name in args.sets if name not in SETS]))
    cli = [sys.executable, "-m", "padim"]
    root = elpv(args.cache)
    hed = args.cache / "hed_vgg16.pth"
    if "vgg16-hed" in args.backbones and not hed.exists():
        raise SystemExit(f"{hed}: run benchmarks/real.py --backbones vgg16-hed once (it converts HED's weights)")
    cells = split(root, args.seed)
    rows, picks = [], []
    with tempfile.TemporaryDirectory(prefix="padim-self-") as folder:
        for kind in args.cells:
            folders = lay_out(root, cells[kind], args.seed, Path(folder) / kind)
            for name in args.backbones:
                backbone, source = BACKBONES[name]
                flags = ["--backbone", backbone, "--image-size", str(args.image_size), "--weights",
                         "random" if source == "random" else str(hed)]  # fmt: skip
                group = []
                for set_name, extra in sets.items():
                    work = Path(folder) / f"{kind}-{name}-{set_name}"
                    work.mkdir()
                    model = work / "model.padim"
                    started = time.perf_counter()
                    subprocess.run(
                        [*cli, "-q", "train", str(folders["fit"]), "--output", str(model), *flags, *extra],
                        check=True, capture_output=True, text=True,
                    )  # fmt: skip
                    scores = raw_scores(cli, model, {k: v for k, v in folders.items() if k != "fit"}, work)
                    row = {
                        "cells": kind, "backbone": name, "set": set_name, "flags": extra,
                        "self_auroc": auroc(scores["held"], np.concatenate([scores[k] for k in KINDS])),
                        **{f"{k}_auroc": auroc(scores["held"], scores[k]) for k in KINDS},
                        "real_auroc": auroc(scores["good"], scores["defective"]),
                        "seconds": round(time.perf_counter() - started, 1),
                    }  # fmt: skip
                    group.append(row)
                    print(
                        f"{kind:4} {name:15} {set_name:10} self {row['self_auroc']:.3f} ("
                        + ", ".join(f"{k} {row[f'{k}_auroc']:.3f}" for k in KINDS)
                        + f"), real {row['real_auroc']:.3f}, {row['seconds']:.0f} s",
                        flush=True,
                    )
                rows += group
                if len(group) > 1:
                    chosen = max(group, key=lambda r: r["self_auroc"])["set"]
                    best = max(group, key=lambda r: r["real_auroc"])["set"]
                    picks.append({"cells": kind, "backbone": name, "self_picks": chosen, "real_ranks_first": best})
                    print(f"{kind} {name}: the self AUROC picks {chosen}, real defects rank {best} first", flush=True)
    out = args.out or HERE / "results" / f"{datetime.date.today()}-{machine_name()}-self-selection.json"
    out.write_text(
        json.dumps(
            {"machine": machine_name(), "date": str(datetime.date.today()), "seed": args.seed,
             "image_size": args.image_size, "kinds": KINDS, "rows": rows, "picks": picks},
            indent=1,
        )
    )  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
