"""Every int8 scorer against float32, as a user gets them: recall beside false alarms, per category.

For each category two models are fitted on the same training pictures (seeded random resnet18 weights unless
``--weights`` names a state_dict; ImageNet weights cannot be fetched here): ``padim train`` with no flag (a float32
model and its int8 scorer, model format 20) and ``train --precision int8`` (a model fitted at int8). Every test
picture is scored by three scorers, each read at its own threshold: ``fp32`` (the default model's float32 scorer on
ONNX Runtime), ``int8 scorer`` (the default model's int8 scorer: what ``--runtime auto`` runs on a CPU that computes
int8 faster) and ``int8-trained`` (the int8 model's own graph):

- image AUROC (normal test pictures against defects);
- recall: defects at or above the threshold;
- false alarms on unseen normal pictures of the same kind (``test/good``) and, for the photographed materials, of
  another region of the photograph (``region/test/good``), with that region's AUROC and recall;
- each int8 gate's reading (largest and median relative score difference, verdicts changed) and each fit's time;
  a category whose gate refuses an int8 scorer (where ``--runtime auto`` scores at float32, and ``--precision
  auto`` fits fp32) is marked so, and read from the model written with ``--force``.

Photographed materials come from ``benchmarks/photographed.py`` (scikit-image's photographs), generated ones from
``padim synth``'s generator::

    python benchmarks/int8_quality.py --workdir /tmp/int8q --output results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

GENERATED = ("carpet", "leather", "tiles", "board", "pill")
#: The scorers read: the default model's float32 and int8 ones, and a model fitted at int8.
SCORERS = ("fp32", "int8 scorer", "int8-trained")
#: Normal and defect pictures of a generated category's test set (per defect kind).
GENERATED_TEST = (50, 10)


def scores(scorer, paths: list[Path], batch: int = 16) -> np.ndarray:
    from PIL import Image

    out = []
    for first in range(0, len(paths), batch):
        images = [Image.open(p).convert("RGB") for p in paths[first : first + batch]]
        out.append(scorer.score(scorer.preprocess(images)).raw_scores.numpy())
    return np.concatenate(out) if out else np.zeros(0)


def read_set(scorer, test: Path) -> dict:
    """AUROC, recall and false alarms of ``scorer`` at its own threshold on an MVTec-layout ``test`` folder."""
    from sklearn.metrics import roc_auc_score

    good = sorted((test / "good").glob("*.png"))
    defects = sorted(p for p in test.rglob("*.png") if p.parent.name != "good")
    normal, bad = scores(scorer, good), scores(scorer, defects)
    threshold = scorer.calibration.threshold
    labels = np.r_[np.zeros(len(normal)), np.ones(len(bad))]
    return {
        "normal": len(normal),
        "defects": len(bad),
        "auroc": round(float(roc_auc_score(labels, np.r_[normal, bad])), 4),
        "recall": round(float((bad >= threshold).mean()), 4),
        "false_alarms": int((normal >= threshold).sum()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--photographed", default="brick,grass,gravel,tissue,moon")
    parser.add_argument("--generated", default=",".join(GENERATED))
    parser.add_argument("--weights", default="random")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from photographed import write_category

    from padim.core import load_artifact
    from padim.models import PadimConfig, training_images
    from padim.models.data.synthetic import generate
    from padim.models.deploy.runtimes import load_scorer
    from padim.models.errors import PrecisionGateFailed
    from padim.models.fit.precision import PrecisionGate
    from padim.models.fit.training import train

    work = args.workdir
    categories: list[tuple[str, Path, str]] = []
    for material in filter(None, args.photographed.split(",")):
        categories.append((material, write_category(work / "photographed", material), "photographed"))
    generated = [c for c in args.generated.split(",") if c]
    if generated:
        root = work / "generated"
        missing = [c for c in generated if not (root / c / "train").exists()]
        if missing:
            good, defect = GENERATED_TEST
            generate(root, tuple(missing), train=60, test_good=good, test_defect=defect, size=224, seed=1)
        categories += [(c, root / c, "generated") for c in generated]

    from padim.models import devices

    if devices.int8_flag() is None:
        raise SystemExit("this CPU has no int8 arithmetic that ONNX Runtime runs faster: --runtime auto never runs the "
                         "int8 scorer here")  # fmt: skip
    report: dict = {
        "machine": platform.processor() or platform.machine(),
        "cpu_features": list(devices.cpu_features()),
        "weights": args.weights,
        "categories": {},
    }
    for name, folder, kind in categories:
        row: dict = {"kind": kind}
        pictures = training_images(folder / "train" / "good")
        for precision in ("fp32", "int8"):
            model = work / "models" / f"{name}-{precision}.padim"
            model.parent.mkdir(parents=True, exist_ok=True)
            config = PadimConfig(weights=args.weights, device="cpu", precision=precision)
            started = time.perf_counter()
            refused = None
            try:
                report_ = train(config, pictures, model, progress=False)
                if precision == "fp32" and report_.int8_scorer is not None and not report_.int8_scorer.usable:
                    refused = report_.int8_scorer.check  # --runtime auto scores at float32; read it anyway
                    train(config, pictures, model, progress=False, gate=PrecisionGate(force=True))
            except PrecisionGateFailed as error:  # what --precision auto would fit at fp32 instead; read anyway
                refused = error.check.to_dict()
                train(config, pictures, model, progress=False, gate=PrecisionGate(force=True))
            seconds = time.perf_counter() - started
            header = load_artifact(model)[1]
            scorers = (
                {"fp32": load_scorer(model, "onnxruntime", "cpu"), "int8 scorer": load_scorer(model, "auto", "cpu")}
                if precision == "fp32"
                else {"int8-trained": load_scorer(model, "auto", "cpu")}
            )
            for key, scorer in scorers.items():
                part = {"fit_seconds": round(seconds, 2), "runtime": scorer.describe()["runtime"]}
                if key != "fp32":
                    assert scorer.describe()["precision"] == "int8", (key, scorer.describe().get("runtime_reason"))
                    check = header["int8_scorer"]["check"] if key == "int8 scorer" else header["precision_check"]
                    part["gate"] = {k: check[k] for k in ("max_score_error", "median_score_error", "verdict_changes")}
                    if refused is not None:
                        part["refused_by_gate"] = True
                part["same"] = read_set(scorer, folder / "test")
                if (folder / "region" / "test").exists():
                    part["region"] = read_set(scorer, folder / "region" / "test")
                row[key] = part
                print(name, key, json.dumps(part), flush=True)
        report["categories"][name] = row

    print(f"\n{'category':<10} {'':12} {'AUROC':>6} {'recall':>6} {'alarms':>6} | {'region AUROC':>12} {'recall':>6} "
          f"{'alarms':>6} | gate")  # fmt: skip
    for name, row in report["categories"].items():
        for precision in SCORERS:
            part = row[precision]
            same, region = part["same"], part.get("region")
            gate = part.get("gate")
            print(
                f"{name:<10} {precision:12} {same['auroc']:6.3f} {same['recall']:6.3f} "
                f"{same['false_alarms']:>3}/{same['normal']:<3}| "
                + (
                    f"{region['auroc']:12.3f} {region['recall']:6.3f} {region['false_alarms']:>3}/{region['normal']:<3}"
                    if region
                    else f"{'-':>12} {'-':>6} {'-':>7}"
                )  # fmt: skip
                + (f"| {gate['max_score_error']:.1%} (median {gate['median_score_error']:.1%})" if gate else "|")
                + (" REFUSED by the gate (written with --force to read it)" if part.get("refused_by_gate") else "")
            )
    for kind in ("photographed", "generated"):
        rows = [r for r in report["categories"].values() if r["kind"] == kind]
        if not rows:
            continue
        summary = {}
        for precision in SCORERS:
            for part in ("same", "region"):
                found = [r[precision][part] for r in rows if part in r[precision]]
                if found:
                    summary[f"{precision} {part}"] = {
                        "auroc": round(float(np.mean([f["auroc"] for f in found])), 4),
                        "recall": round(float(np.mean([f["recall"] for f in found])), 4),
                        "false_alarms": f"{sum(f['false_alarms'] for f in found)}/{sum(f['normal'] for f in found)}",
                    }
        report[f"{kind}_mean"] = summary
        print(kind, json.dumps(summary))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
