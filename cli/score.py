"""``padim predict`` and ``padim evaluate``: using a detector on images."""

from __future__ import annotations

import argparse
import json
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
        description="Score CATEGORY_DIR/test and report image AUROC, pixel AUROC, PRO (up to 30%% FPR) and F1 "
        "at the model's threshold, plus the F1-optimal threshold. The model file changes only with --calibrate.",
    )
    evaluate.add_argument("model", type=Path, metavar="MODEL", help="model file (padim train) or export directory (padim export)")
    evaluate.add_argument("category_dir", type=Path, metavar="CATEGORY_DIR",
                          help="folder with test/<good|defect>/ and ground_truth/<defect>/")
    evaluate.add_argument("--output", "-o", type=Path, default=Path("evaluation.json"),
                          help="JSON file to write (default evaluation.json)")
    evaluate.add_argument("--calibrate", action="store_true",
                          help="store the F1-optimal threshold in the model file (a .padim file, not an export)")
    evaluate.set_defaults(handler=cmd_evaluate)


def cmd_predict(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm.auto import tqdm

    from padim.core.scoring import resize_map
    from padim.models import NonFiniteScoreError, list_images, verdict
    from padim.models.images import decode_side, iter_batches
    from padim.models.visualize import overlay

    detector = _load(args)
    items: list[tuple[Path, Path]] = []  # (path, path relative to its input)
    for source in args.inputs:
        found = list_images(source)
        if not found and source.is_dir():
            raise UserError(f"{source}: no images found")
        items += [(p, p.relative_to(source) if source.is_dir() else Path(p.name)) for p in found]
    relatives = [r.as_posix() for _, r in items]
    duplicates = sorted({r for r in relatives if relatives.count(r) > 1})
    if duplicates:
        raise UserError(f"two inputs give the same output name {duplicates[0]!r}; predict them into separate --output folders")
    args.output.mkdir(parents=True, exist_ok=True)
    calibration = detector.calibration
    relative_of = dict(items)
    anomalous, failed, started = 0, [], time.perf_counter()
    with open(args.output / "results.jsonl", "w") as results, \
            tqdm(total=len(items), desc="predict", unit="img", disable=args.quiet, leave=False) as bar:
        for chunk, images in iter_batches([p for p, _ in items], args.batch_size or DEFAULT_BATCH_SIZE,
                                          DEFAULT_WORKERS if args.workers is None else args.workers,
                                          draft_to=decode_side(detector.config.image_size)):
            out = detector.score(detector.preprocess(images))
            raw_scores, maps = out.raw_scores.cpu(), out.maps.cpu()
            for path, image, raw, anomaly_map in zip(chunk, images, raw_scores.tolist(), maps):
                try:
                    record = {"path": str(path), **verdict(raw, anomaly_map, calibration).to_dict(),
                              "weights": detector.weights.label}
                except NonFiniteScoreError as error:  # fail closed: no score, no verdict, exit 1 below
                    failed.append(str(path))
                    results.write(json.dumps({"path": str(path), "error": {"code": "non_finite_score",
                                                                           "message": str(error)}}) + "\n")
                    continue
                rel = relative_of[path]
                if not (args.no_maps and args.no_heatmaps):
                    full = resize_map(anomaly_map, image.height, image.width)
                if not args.no_maps:
                    map_path = args.output / "maps" / rel.with_suffix(".npy")
                    map_path.parent.mkdir(parents=True, exist_ok=True)
                    np.save(map_path, full.numpy().astype(np.float32))
                    record["map"] = str(map_path)
                if not args.no_heatmaps:
                    heat_path = args.output / "heatmaps" / rel.with_suffix(".png")
                    heat_path.parent.mkdir(parents=True, exist_ok=True)
                    overlay(image, calibration.normalise(full.double()).numpy(), label=detector.weights.stamp).save(heat_path)
                    record["heatmap"] = str(heat_path)
                anomalous += record["is_anomaly"]
                results.write(json.dumps(record) + "\n")
            results.flush()
            bar.update(len(chunk))
    elapsed = time.perf_counter() - started
    print(json.dumps({"images": len(items), "anomalous": anomalous, "failed": len(failed),
                      "results": str(args.output / "results.jsonl"),
                      "images_per_second": round(len(items) / elapsed, 2), "runtime": detector.describe()["runtime"],
                      "weights": detector.weights.label}))
    if failed:
        shown = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
        raise UserError(f"{len(failed)} of {len(items)} image(s) got a NaN or infinite score and no verdict ({shown}); "
                        "the model file may be damaged: check it with `padim info --verify`")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from padim.models import PadimDetector
    from padim.models.evaluation import evaluate
    from padim.models.runtimes import is_export

    if args.calibrate and is_export(args.model):
        raise UserError(f"{args.model}: --calibrate writes the threshold into the .padim model file; "
                        "calibrate that file, then export it again")
    detector = _load(args, with_statistics=args.calibrate)
    try:
        result = evaluate(detector, args.category_dir, args.batch_size or DEFAULT_BATCH_SIZE,
                          DEFAULT_WORKERS if args.workers is None else args.workers, progress=not args.quiet)
    except ValueError as error:
        raise UserError(str(error)) from None
    result["model"] = str(args.model)
    result["runtime"] = detector.describe()["runtime"]
    result["weights"] = detector.weights.label
    if args.calibrate:
        if not isinstance(detector, PadimDetector):  # scored on another runtime: write through the file's own
            detector = PadimDetector.load(args.model, device="cpu", with_statistics=True)
        if "f1_optimal_raw_threshold" not in result:
            raise UserError("--calibrate needs both good and defective test images")
        detector.calibration = detector.calibration.with_threshold(result["f1_optimal_raw_threshold"])
        detector.save(args.model, with_statistics=detector.statistics is not None)
        result["calibrated"] = True
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def _load(args: argparse.Namespace, with_statistics: bool = False):
    """The detector of ``args.model`` on ``args.runtime`` (export errors become one-line errors)."""
    from padim.models.export import ExportError
    from padim.models.runtimes import load_scorer

    try:
        return load_scorer(args.model, args.runtime, args.device or "auto", with_statistics=with_statistics)
    except ExportError as error:
        raise UserError(str(error)) from None
