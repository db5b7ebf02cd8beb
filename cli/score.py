"""``padim predict`` and ``padim evaluate``: using a detector on images."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .common import DEFAULT_BATCH_SIZE, DEFAULT_WORKERS, UserError, scorer_option


def register(commands, runtime: argparse.ArgumentParser, quiet: argparse.ArgumentParser) -> None:
    scorer = scorer_option()
    predict = commands.add_parser(
        "predict", parents=[runtime, scorer, quiet], help="score images and write results, maps and heat maps",
        description="Score images. Writes OUT_DIR/results.jsonl (one line per image: the verdict), "
        "OUT_DIR/maps/<relative path>.npy (float32 anomaly map, raw units, at the image's own size) and "
        "OUT_DIR/heatmaps/<relative path>.png (heat map over the image; threshold = middle of the colour ramp). "
        "An image whose score is not finite gets an error line and no verdict, and predict exits 1.",
    )
    predict.add_argument("model", type=Path, metavar="MODEL", help="model file (padim train) or export directory (padim export)")
    predict.add_argument("inputs", type=Path, nargs="+", metavar="IMAGE_OR_DIR", help="images, or folders of images")
    predict.add_argument("--output", "-o", type=Path, required=True, metavar="OUT_DIR", help="folder for the results")
    predict.add_argument("--no-heatmaps", action="store_true", help="skip the heat-map PNGs")
    predict.add_argument("--no-maps", action="store_true", help="skip the .npy maps")
    predict.set_defaults(handler=cmd_predict)

    evaluate = commands.add_parser(
        "evaluate", parents=[runtime, scorer, quiet], help="metrics on an MVTec AD-layout category",
        description="Score CATEGORY_DIR/test and report image AUROC, pixel AUROC, PRO (up to 30% FPR) and F1 "
        "at the model's threshold, plus the F1-optimal threshold, as JSON on stdout. --output also writes it to a "
        "file; --report DIR writes an HTML report (curves, histograms, the worst false alarms and misses with their "
        "heat maps; images embedded, opens offline) and evaluation.json into DIR. "
        "The model file changes only with --calibrate.",
    )
    evaluate.add_argument("model", type=Path, metavar="MODEL", help="model file (padim train) or export directory (padim export)")
    evaluate.add_argument("category_dir", type=Path, metavar="CATEGORY_DIR",
                          help="folder with test/<good|defect>/ and ground_truth/<defect>/")
    evaluate.add_argument("--output", "-o", type=Path, metavar="FILE",
                          help="also write the JSON to this file (default: stdout only)")
    evaluate.add_argument("--report", type=Path, metavar="DIR",
                          help="write DIR/report.html and DIR/evaluation.json")
    evaluate.add_argument("--gallery", type=int, default=6, metavar="N",
                          help="worst false alarms and worst misses shown in the report, each (default 6)")
    evaluate.add_argument("--calibrate", action="store_true",
                          help="store the F1-optimal threshold in the model file (a .padim file, not an export)")
    evaluate.set_defaults(handler=cmd_evaluate)


def output_names(inputs: list[Path]) -> list[tuple[Path, Path]]:
    """``(image, name under --output)`` for every image of ``inputs``, each image once, in order.

    Names mirror the inputs below the folder they have in common: ``test/hole test/scratch`` give
    ``hole/000.png`` and ``scratch/000.png``; ``a/000.png b/000.png`` give ``a/000.png`` and
    ``b/000.png``; one folder gives paths relative to it.
    """
    from padim.models import list_images

    found: dict[str, Path] = {}
    for source in inputs:
        images = list_images(source)
        if not images and source.is_dir():
            raise UserError(f"{source}: no images found (looked for png, jpg, jpeg, bmp, tif recursively)")
        for image in images:
            found.setdefault(os.path.abspath(image), image)
    anchors = [os.path.abspath(s if s.is_dir() else s.parent) for s in inputs]
    base = os.path.commonpath(anchors)
    return [(image, Path(os.path.relpath(absolute, base))) for absolute, image in found.items()]


def cmd_predict(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm.auto import tqdm

    from padim.models import NonFiniteScoreError
    from padim.models.api import Detector

    detector = Detector(_load(args), batch_size=args.batch_size or DEFAULT_BATCH_SIZE,
                        workers=DEFAULT_WORKERS if args.workers is None else args.workers)
    items = output_names(args.inputs)
    name_of = {str(path): name for path, name in items}
    out = args.output
    counts = {"anomalous": 0, "non_finite": [], "unreadable": []}
    results, results_path, started = None, out / "results.jsonl", time.perf_counter()

    def write(record: dict) -> None:
        nonlocal results
        if results is None:  # nothing is created until there is a first line to write
            out.mkdir(parents=True, exist_ok=True)
            results = open(results_path, "w")
        results.write(json.dumps(record) + "\n")

    unreadable: list[tuple[Path, str]] = []

    def report_unreadable(bar) -> None:
        """Error lines for the images found unreadable so far (decoding runs ahead of scoring)."""
        for path, reason in unreadable:
            counts["unreadable"].append(str(path))
            write({"path": str(path), "error": {"code": "unreadable_image", "message": reason}})
            bar.update(1)
        unreadable.clear()

    try:
        with tqdm(total=len(items), desc="predict", unit="img", disable=args.quiet, leave=False) as bar:
            for result in detector.iter_predict([path for path, _ in items], unreadable=unreadable):
                report_unreadable(bar)
                if isinstance(result, NonFiniteScoreError):  # fail closed: no score, no verdict, exit 1 below
                    counts["non_finite"].append(result.source)
                    write({"path": result.source, "error": {"code": "non_finite_score", "message": str(result)}})
                    bar.update(1)
                    continue
                name = name_of[result.source]
                record = result.to_dict()
                if not args.no_maps:
                    map_path = out / "maps" / name.with_suffix(".npy")
                    map_path.parent.mkdir(parents=True, exist_ok=True)
                    np.save(map_path, result.anomaly_map)
                    record["map"] = str(map_path)
                if not args.no_heatmaps:
                    heat_path = out / "heatmaps" / name.with_suffix(".png")
                    heat_path.parent.mkdir(parents=True, exist_ok=True)
                    result.heatmap().save(heat_path)
                    record["heatmap"] = str(heat_path)
                counts["anomalous"] += result.is_anomaly
                write(record)
                bar.update(1)
            report_unreadable(bar)
    finally:
        if results is not None:
            results.close()
    elapsed = time.perf_counter() - started
    failed = counts["non_finite"] + counts["unreadable"]
    print(json.dumps({"images": len(items), "anomalous": counts["anomalous"], "failed": len(failed),
                      "unreadable": len(counts["unreadable"]),
                      "results": str(results_path) if results is not None else None,
                      "images_per_second": round(len(items) / elapsed, 2), "runtime": detector.runtime,
                      "weights": detector.scorer.weights.label}))
    if counts["non_finite"]:
        raise UserError(f"{len(counts['non_finite'])} of {len(items)} image(s) got a NaN or infinite score and no verdict "
                        f"({_some(counts['non_finite'])}); the model file may be damaged: check it with `padim info --verify`")
    if counts["unreadable"]:
        raise UserError(f"{len(counts['unreadable'])} of {len(items)} image(s) could not be read "
                        f"({_some(counts['unreadable'])}); see their error lines in {results_path}")
    return 0


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def cmd_evaluate(args: argparse.Namespace) -> int:
    from padim.models.evaluation import compute_metrics, score_category, threshold_metrics
    from padim.models.runtimes import is_export

    if args.calibrate and is_export(args.model):
        raise UserError(f"{args.model}: --calibrate writes the threshold into the .padim model file; "
                        "calibrate that file, then export it again")
    detector = _load(args)
    try:
        scored = score_category(detector, args.category_dir, args.batch_size or DEFAULT_BATCH_SIZE,
                                DEFAULT_WORKERS if args.workers is None else args.workers, progress=not args.quiet)
        result = {"category": str(args.category_dir),
                  **compute_metrics(scored.samples, scored.raw_scores, scored.maps, scored.raw_threshold, scored.masks)}
    except ValueError as error:
        raise UserError(str(error)) from None
    result["model"] = str(args.model)
    result["runtime"] = detector.describe()["runtime"]
    result["weights"] = detector.weights.label
    if args.calibrate:
        from padim.models.serialization import store_calibration

        if "f1_optimal_raw_threshold" not in result:
            raise UserError("--calibrate needs both good and defective test images")
        calibration = detector.calibration.with_threshold(result["f1_optimal_raw_threshold"])
        store_calibration(args.model, calibration)  # the file's tensors are copied as they are
        detector.calibration = calibration  # the report shows the threshold now stored
        # what the new threshold gives on the same images (F1, confusion counts, the report's marks)
        scored.raw_threshold = calibration.threshold
        result.update(threshold_metrics(scored.samples, scored.raw_scores, scored.raw_threshold))
        result["calibrated"] = True
    if args.report is not None:
        from padim.models.report import write_report

        result["report"] = str(write_report(args.report, scored, result, detector, str(args.model), args.gallery))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def _load(args: argparse.Namespace):
    """The detector of ``args.model`` on ``args.runtime`` (export errors become one-line errors)."""
    from padim.models.export import ExportError
    from padim.models.runtimes import load_scorer

    try:
        return load_scorer(args.model, args.runtime, args.device or "auto")
    except ExportError as error:
        raise UserError(str(error)) from None
