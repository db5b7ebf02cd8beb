"""``padim evaluate``: metrics on an MVTec AD-layout category, and an HTML report."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from padim.models.errors import UsageError

from ..options import batch_size, quiet_option, run_options, runtime_option, workers
from .predict import load


def register(commands) -> None:
    evaluate = commands.add_parser(
        "evaluate",
        parents=[run_options(), runtime_option(), quiet_option()],
        help="metrics on an MVTec AD-layout category",
        description="Score CATEGORY_DIR/test and report image AUROC, pixel AUROC, PRO (up to 30% FPR) and F1 "
        "at the model's threshold, plus the F1-optimal threshold, as JSON on stdout. --output also writes it to a "
        "file; --report DIR writes an HTML report (curves, histograms, the worst false alarms and misses with their "
        "heat maps; images embedded, opens offline) and evaluation.json into DIR. "
        "The model file changes only with --calibrate.",
    )
    evaluate.add_argument(
        "model", type=Path, metavar="MODEL", help="model file (padim train) or export directory (padim export)"
    )
    evaluate.add_argument(
        "category_dir",
        type=Path,
        metavar="CATEGORY_DIR",
        help="folder with test/good/ and test/<defect>/ (pictures), and optionally ground_truth/<defect>/ "
        "(NAME_mask.png for test/<defect>/NAME.png): a defect picture without a mask counts by image (image AUROC, "
        "F1) and is left out of pixel AUROC and PRO, said once",
    )
    evaluate.add_argument(
        "--require-masks",
        action="store_true",
        help="refuse a category where a defect picture has no mask, instead of leaving it out of the pixel metrics",
    )
    evaluate.add_argument(
        "--output", "-o", type=Path, metavar="FILE", help="also write the JSON to this file (default: stdout only)"
    )
    evaluate.add_argument("--report", type=Path, metavar="DIR", help="write DIR/report.html and DIR/evaluation.json")
    evaluate.add_argument(
        "--gallery",
        type=int,
        default=6,
        metavar="N",
        help="worst false alarms and worst misses shown in the report, each (default 6)",
    )
    evaluate.add_argument(
        "--calibrate",
        action="store_true",
        help="store the F1-optimal threshold in the model file (a .padim file, not an export)",
    )
    evaluate.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    from padim.models.deploy.runtimes import is_export
    from padim.models.evaluation.metrics import compute_metrics, read_mvtec_category, score_category, unmasked
    from padim.models.evaluation.report import write_report

    if args.calibrate and is_export(args.model):
        raise UsageError(
            f"{args.model}: --calibrate writes the threshold into the .padim model file; "
            "calibrate that file, then export it again"
        )
    missing = unmasked(read_mvtec_category(args.category_dir))
    if missing:
        counts = ", ".join(f"{n} in test/{defect}" for defect, n in missing.items())
        where = args.category_dir / "ground_truth"
        if args.require_masks:
            raise UsageError(
                f"{sum(missing.values())} defect picture(s) have no mask in {where}/<defect>/ ({counts}); "
                "add NAME_mask.png for each, or leave out --require-masks to count them by image only"
            )
        print(
            f"padim evaluate: {sum(missing.values())} defect picture(s) have no mask in {where}/<defect>/ ({counts}): "
            "counted by image (image AUROC, F1), left out of pixel AUROC and PRO",
            file=sys.stderr,
        )
    detector = load(args)
    scored = score_category(detector, args.category_dir, batch_size(args), workers(args), progress=not args.quiet)
    result = {
        "category": str(args.category_dir),
        **compute_metrics(scored.samples, scored.raw_scores, scored.maps, scored.raw_threshold, scored.masks),
        "model": str(args.model),
        "runtime": detector.runtime,
        "scorer": detector.file_scorer,
        "device": detector.device.type,
        "weights": detector.weights.label,
    }
    if args.calibrate:
        _calibrate(args.model, detector, scored, result)
    if args.report is not None:
        result["report"] = str(write_report(args.report, scored, result, detector, str(args.model), args.gallery))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def _calibrate(model: Path, detector, scored, result: dict) -> None:
    """Store the F1-optimal threshold in ``model``; what it gives on the same images goes into ``result``."""
    from padim.models.evaluation.metrics import threshold_metrics  # torch: not for --help
    from padim.models.fit.model_file import store_calibration

    if "f1_optimal_raw_threshold" not in result:
        raise UsageError("--calibrate needs both good and defective test images")
    calibration = detector.calibration.with_threshold(result["f1_optimal_raw_threshold"])
    store_calibration(model, calibration, scorer=detector.file_scorer)  # the threshold of the scorer that scored them
    detector.calibration = calibration  # the report shows the threshold now stored
    scored.raw_threshold = calibration.threshold  # F1, confusion counts, the report's marks at the new threshold
    result.update(threshold_metrics(scored.samples, scored.raw_scores, scored.raw_threshold))
    result["calibrated"] = True
