"""The ``padim`` command line: train, predict, evaluate, info, synth."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from padim import __version__

EXAMPLES = """\
examples:
  padim synth demo-data --categories weave               # a small generated data set
  padim train demo-data/weave/train/good --output weave.padim --weights random
  padim predict weave.padim demo-data/weave/test --output predictions
  padim evaluate weave.padim demo-data/weave
"""

ERROR_EXIT = 1


class UserError(Exception):
    """An error the user can fix; printed as one line without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="padim",
        description="PaDiM visual anomaly detection: fit on normal images, score new ones.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"padim {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info logs")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train = commands.add_parser(
        "train", help="fit a detector on a folder of normal images",
        description="Fit a detector on every image under DATA_DIR (png/jpg/jpeg/bmp/tif, recursively). "
        "Every image is fitted, and also scored by a model of the images outside its calibration fold "
        "(folds come from file names); those out-of-fold scores set the threshold for the false-alarm rate "
        "you ask for (--false-alarm-rate), and train says what that threshold can promise. Unreadable images "
        "are left out and named. Memory does not grow with the number of images. Under torchrun "
        "(torchrun --nproc-per-node N -m padim train ...) each rank fits a disjoint shard, the statistics "
        "are combined with torch.distributed (NCCL on GPUs, Gloo on CPUs) and rank 0 writes the file.",
    )
    train.add_argument("data_dir", type=Path, metavar="DATA_DIR", help="folder of normal (defect-free) images")
    train.add_argument("--output", "-o", type=Path, required=True, help="model file to write (atomically)")
    train.add_argument("--config", type=Path, help="YAML file of options (see configs/); flags override it")
    train.add_argument("--backbone", help="torchvision ResNet-family name (default resnet18)")
    train.add_argument("--weights", help="imagenet (default; torchvision cache), random (demo/tests only, seeded) or a state_dict path")
    train.add_argument("--image-size", type=int, help="side of the square model input, multiple of 16 (default 224)")
    train.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default auto: cuda when available")
    train.add_argument("--batch-size", type=int, help="images per forward pass (default 16)")
    train.add_argument("--features", type=int, help="embedding size after reduction (default 100 resnet18, 550 wide_resnet50_2)")
    train.add_argument("--reduction", choices=["random", "semi_orthogonal"], help="channel subset (paper) or semi-orthogonal projection")
    train.add_argument("--layers", help="comma-separated stages (default layer1,layer2,layer3)")
    train.add_argument("--epsilon", type=float, help="covariance regularisation (default 0.01)")
    train.add_argument("--seed", type=int, help="seed of the channel subset / projection and random weights (default 0)")
    train.add_argument("--false-alarm-rate", type=float, metavar="RATE",
                       help="share of normal images the threshold may flag (default 0.01); may change on --resume")
    train.add_argument("--calibration-folds", type=int, metavar="K",
                       help="folds of the cross-fitted calibration (default 20; more: less bias, one more finalisation each)")
    train.add_argument("--precision-dtype", choices=["auto", "float16", "float32"], help="storage of precision factors (default auto)")
    train.add_argument("--workers", type=int, help="image-decoding threads (default 2)")
    train.add_argument("--resume", type=Path, metavar="MODEL",
                       help="add DATA_DIR's images to this model's statistics (old images are not re-read; images it "
                       "already fitted, by content, are left out); their out-of-fold scores join the model's")
    train.add_argument("--slim", action="store_true", help="leave the accumulators out of the file (about 4x smaller for resnet18; cannot be resumed)")
    train.add_argument("--partial", action="store_true",
                       help="fit every image and write only the accumulators, to be combined later by `padim merge` "
                       "(for shards fitted on separate machines or at separate times)")

    predict = commands.add_parser(
        "predict", help="score images and write results, maps and heat maps",
        description="Score images. Writes OUT_DIR/results.jsonl (one line per image), "
        "OUT_DIR/maps/<relative path>.npy (float32 anomaly map, raw units, at the image's own size) and "
        "OUT_DIR/heatmaps/<relative path>.png (heat map over the image; threshold = middle of the colour ramp).",
    )
    predict.add_argument("model", type=Path, metavar="MODEL")
    predict.add_argument("inputs", type=Path, nargs="+", metavar="IMAGE_OR_DIR")
    predict.add_argument("--output", "-o", type=Path, required=True, metavar="OUT_DIR")
    predict.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    predict.add_argument("--batch-size", type=int, default=16)
    predict.add_argument("--workers", type=int, default=2)
    predict.add_argument("--no-heatmaps", action="store_true", help="skip the heat-map PNGs")
    predict.add_argument("--no-maps", action="store_true", help="skip the .npy maps")

    evaluate = commands.add_parser(
        "evaluate", help="metrics on an MVTec AD-layout category",
        description="Score CATEGORY_DIR/test and report image AUROC, pixel AUROC, PRO (up to 30%% FPR) and F1 "
        "at the model's threshold, plus the F1-optimal threshold. The model file changes only with --calibrate.",
    )
    evaluate.add_argument("model", type=Path, metavar="MODEL")
    evaluate.add_argument("category_dir", type=Path, metavar="CATEGORY_DIR")
    evaluate.add_argument("--output", "-o", type=Path, default=Path("evaluation.json"), help="JSON file to write (default evaluation.json)")
    evaluate.add_argument("--calibrate", action="store_true", help="store the F1-optimal threshold in the model file")
    evaluate.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    evaluate.add_argument("--batch-size", type=int, default=16)
    evaluate.add_argument("--workers", type=int, default=2)

    serve = commands.add_parser(
        "serve", help="serve models over HTTP (FastAPI): POST /score",
        description="Serve one or more model files. Each is named by its file stem; the first is the default. "
        "Flags override PADIM_* environment variables (PADIM_MODEL_DIR, PADIM_API_KEY, PADIM_MAX_BATCH_SIZE, "
        "PADIM_MAX_DELAY_MS, PADIM_MAX_QUEUE, PADIM_REQUEST_TIMEOUT_S, PADIM_MAX_UPLOAD_BYTES, "
        "PADIM_MAX_IMAGE_PIXELS, PADIM_DECODE_WORKERS, PADIM_DRAIN_TIMEOUT_S, PADIM_LOG_LEVEL). "
        "The API key is read from PADIM_API_KEY only, never from a flag.",
    )
    serve.add_argument("--model", type=Path, action="append", dest="models", metavar="FILE", help="model file (repeatable)")
    serve.add_argument("--model-dir", type=Path, help="serve every *.padim in this directory")
    serve.add_argument("--default-model", help="name of the default model (default: the first)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 in Docker)")
    serve.add_argument("--port", type=int, help="default 8000")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"])
    serve.add_argument("--max-batch-size", type=int, help="largest device batch (default 32)")
    serve.add_argument("--max-delay-ms", type=float, help="longest wait for a batch to fill (default 5)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])

    merge = commands.add_parser(
        "merge", help="combine partial fits (train --partial) into one model",
        description="Add up the accumulators of PARTS (refused unless every setting that shapes the statistics and "
        "the backbone weights match), derive the precision factors, and set the threshold from the scores of the "
        "normal images of --calibration-dir, which no part may have fitted (checked by content).",
    )
    merge.add_argument("parts", type=Path, nargs="+", metavar="PART")
    merge.add_argument("--output", "-o", type=Path, required=True)
    merge.add_argument("--calibration-dir", type=Path, required=True, metavar="DIR",
                       help="normal images kept out of every part, to set the threshold")
    merge.add_argument("--false-alarm-rate", type=float, metavar="RATE", help="default: the parts' setting (0.01)")
    merge.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    merge.add_argument("--batch-size", type=int, default=16)
    merge.add_argument("--workers", type=int, default=2)
    merge.add_argument("--slim", action="store_true", help="leave the accumulators out of the merged file")

    fetch = commands.add_parser(
        "fetch-weights", help="download ImageNet backbone weights into torch's cache (for offline nodes and images)",
        description="Download torchvision's IMAGENET1K_V1 weights of each BACKBONE into $TORCH_HOME/hub/checkpoints "
        "(default ~/.cache/torch). Run it where there is internet, then copy that directory, or bake it into "
        "the Docker image (build argument BAKE_WEIGHTS).",
    )
    fetch.add_argument("backbones", nargs="+", metavar="BACKBONE")

    health = commands.add_parser(
        "health", help="exit 0 when a local `padim serve` is ready (Docker HEALTHCHECK)",
        description="GET http://127.0.0.1:$PADIM_PORT/health/ready; exit 0 on 200, 1 otherwise.",
    )
    health.add_argument("--url", help="default http://127.0.0.1:${PADIM_PORT:-8000}/health/ready")
    health.add_argument("--timeout", type=float, default=5.0)

    info = commands.add_parser("info", help="print a model file's metadata as JSON",
                               description="What a model file holds: images fitted, calibration (scores used, threshold, "
                               "requested and promised false-alarm rates), backbone, and its full header.")
    info.add_argument("model", type=Path, metavar="MODEL")
    info.add_argument("--verify", action="store_true", help="also check every tensor against its digest (reads the whole file)")

    synth = commands.add_parser(
        "synth", help="generate an MVTec-layout data set of textures with synthetic defects",
        description="Write OUT_DIR/<category>/{train/good,test/<good|defect>,ground_truth/<defect>}. For demos and tests; works offline.",
    )
    synth.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    synth.add_argument("--categories", default="weave,carpet,tiles", help="comma-separated (default weave,carpet,tiles)")
    synth.add_argument("--train", type=int, default=40, help="normal training images per category (default 40)")
    synth.add_argument("--test-good", type=int, default=8, help="normal test images per category (default 8)")
    synth.add_argument("--test-defect", type=int, default=4, help="test images per defect type (default 4)")
    synth.add_argument("--size", type=int, default=256, help="image side in pixels (default 256)")
    synth.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from padim.core import ArtifactError, NotPositiveDefiniteError
    from padim.models import ConfigError, FitError, ImageError, WeightsError

    handler = {"train": cmd_train, "predict": cmd_predict, "evaluate": cmd_evaluate, "serve": cmd_serve,
               "merge": cmd_merge, "info": cmd_info,
               "fetch-weights": cmd_fetch_weights, "health": cmd_health, "synth": cmd_synth}[args.command]
    try:
        return handler(args)
    except (UserError, ArtifactError, ConfigError, FitError, WeightsError, ImageError, NotPositiveDefiniteError) as error:
        print(f"padim {args.command}: error: {error}", file=sys.stderr)
        return ERROR_EXIT
    except KeyboardInterrupt:
        print(f"padim {args.command}: interrupted; no partial model file was written", file=sys.stderr)
        return 130


# ---------------------------------------------------------------------- commands
def load_config(args: argparse.Namespace):
    """The configuration from defaults, ``--config`` YAML and flags, and which fields were given explicitly."""
    from padim.models import PadimConfig

    config, given = PadimConfig(), set()
    if args.config is not None:
        import yaml

        try:
            values = yaml.safe_load(args.config.read_text()) or {}
        except OSError as error:
            raise UserError(f"--config {args.config}: {error.strerror}") from None
        except yaml.YAMLError as error:
            raise UserError(f"--config {args.config}: not valid YAML ({str(error).splitlines()[0]})") from None
        config = PadimConfig.from_mapping(values, source=str(args.config))
        given |= set(values)
    layers = tuple(x.strip() for x in args.layers.split(",")) if args.layers else None
    flags = dict(
        backbone=args.backbone, weights=args.weights, image_size=args.image_size, device=args.device,
        batch_size=args.batch_size, features=args.features, reduction=args.reduction, layers=layers,
        epsilon=args.epsilon, seed=args.seed, false_alarm_rate=args.false_alarm_rate,
        calibration_folds=args.calibration_folds, precision_dtype=args.precision_dtype, workers=args.workers,
    )
    given |= {k for k, v in flags.items() if v is not None}
    return config.replace(**flags), given


def cmd_train(args: argparse.Namespace) -> int:
    from padim.models import Fit, fit_detector, fit_partial, training_images
    from padim.models.fitting import STATISTICS_FIELDS

    config, given = load_config(args)
    images = training_images(args.data_dir)
    if not images:
        raise UserError(f"{args.data_dir}: no images found (looked for png, jpg, jpeg, bmp, tif recursively)")
    if args.partial and (args.resume or args.slim):
        raise UserError("--partial writes accumulators only: it cannot be combined with --resume or --slim")
    resume = None
    if args.resume is not None:
        resume = Fit.load(args.resume, runtime=config)
        clash = [k for k in STATISTICS_FIELDS if k in given and getattr(config, k) != getattr(resume.config, k)]
        if clash:
            k = clash[0]
            raise UserError(f"--resume {args.resume}: the model was fitted with {k}={getattr(resume.config, k)!r}, "
                            f"not {getattr(config, k)!r} (from {'--config' if _from_yaml(args, k) else 'the flag'}); "
                            "drop it or train a new model")
        if "false_alarm_rate" in given:
            resume.config = resume.config.replace(false_alarm_rate=config.false_alarm_rate)
    shard = _init_distributed(config)
    rank = shard[0] if shard else 0
    progress = not args.quiet and rank == 0
    started = time.perf_counter()
    try:
        if args.partial:  # every image is fitted: `merge` calibrates on images kept out of all parts
            fit, report = fit_partial(config, images, progress, shard)
            if rank == 0:
                fit.save_partial(args.output, fit.history)
        else:
            detector, report = fit_detector(config, images, resume, progress, shard)
            if rank == 0:
                detector.save(args.output, include_state=not args.slim)
    finally:
        if shard:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank != 0:
        return 0
    if not args.partial and not args.quiet:
        print(f"padim train: {_verdict_line(detector)}", file=sys.stderr)
    for warning in report.warnings:
        print(f"padim train: warning: {warning}", file=sys.stderr)
    summary = {
        "model": str(args.output),
        "kind": "partial" if args.partial else "detector",
        "size_bytes": args.output.stat().st_size,
        "images": report.listed,
        "fitted": report.fitted,
        "unreadable": len(report.unreadable),
        "already_fitted": len(report.already_fitted),
        "seconds": round(time.perf_counter() - started, 2),
        "phase_seconds": report.seconds,
        "world_size": shard[1] if shard else 1,
    }
    if args.partial:
        summary.update(fit_image_count=fit.count, weights=fit.weights.label)
    else:
        described = detector.describe()
        summary.update(fit_image_count=detector.info["fit_image_count"], calibration=described["calibration"],
                       precision_dtype=str(detector.storage_dtype).removeprefix("torch."), weights=detector.weights.label,
                       **{k: described[k] for k in ("backbone", "image_size", "embedding_dim")})
    print(json.dumps(summary))
    return 0


def _verdict_line(detector) -> str:
    """What the threshold means, in one line."""
    cal = detector.calibration
    return (f"fitted {detector.info['fit_image_count']} images; threshold {cal.threshold:.4g} (raw) from "
            f"{cal.count} out-of-fold scores, aiming at {cal.false_alarm_rate:.2%} false alarms; promised "
            f"{cal.promised_false_alarm_rate:.2%} on average and at most {cal.false_alarm_bound:.2%} with "
            f"{cal.summary()['confidence']:.0%} confidence, whatever the score distribution")


def _from_yaml(args: argparse.Namespace, key: str) -> bool:
    return getattr(args, key, None) is None  # every statistics field has a flag of the same name


def _init_distributed(config) -> tuple[int, int] | None:
    """``(rank, world_size)`` when started by torchrun with several processes, else ``None``."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    import torch
    import torch.distributed as dist

    from padim.models import resolve_device

    if resolve_device(config.device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def cmd_merge(args: argparse.Namespace) -> int:
    from padim.models import Fit, PadimConfig, list_images, merge_fits

    runtime = PadimConfig(batch_size=args.batch_size, workers=args.workers, device=args.device)
    parts = [Fit.load(p, runtime=runtime) for p in args.parts]
    calibration = list_images(args.calibration_dir)
    if not calibration:
        raise UserError(f"--calibration-dir {args.calibration_dir}: no images found")
    detector = merge_fits(parts, [str(p) for p in args.parts], calibration, runtime, args.false_alarm_rate,
                          progress=not args.quiet)
    detector.save(args.output, include_state=not args.slim)
    cal = detector.calibration
    print(json.dumps({"model": str(args.output), "parts": len(parts), "fit_image_count": detector.info["fit_image_count"],
                      "calibration": detector.describe()["calibration"], "size_bytes": args.output.stat().st_size,
                      "weights": detector.weights.label}))
    if cal.shortfall():
        print(f"padim merge: warning: {cal.shortfall()}", file=sys.stderr)
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm.auto import tqdm

    from padim.core.scoring import resize_map
    from padim.models import PadimDetector, list_images
    from padim.models.images import iter_batches
    from padim.models.visualize import overlay

    detector = PadimDetector.load(args.model, device=args.device)
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
        for chunk, images in iter_batches([p for p, _ in items], args.batch_size, args.workers):
            out = detector.score(detector.preprocess(images))
            normalised = calibration.normalise(out.raw_scores.double()).cpu()
            broken = set(out.non_finite())
            for i, (path, image) in enumerate(zip(chunk, images)):
                rel = relative_of[path]
                if i in broken:  # fail closed: no score, no verdict, and a non-zero exit below
                    failed.append(str(path))
                    results.write(json.dumps({"path": str(path), "error": {
                        "code": "non_finite_score", "message": "the model gave a NaN or infinite score; no verdict"}}) + "\n")
                    continue
                raw = float(out.raw_scores[i])
                record = {
                    "path": str(path), "score": float(normalised[i]), "raw_score": raw,
                    "is_anomaly": bool(raw >= calibration.threshold), "threshold": 0.5,
                    "raw_threshold": calibration.threshold, "weights": detector.weights.label,
                }
                if not (args.no_maps and args.no_heatmaps):
                    full = resize_map(out.maps[i], image.height, image.width).cpu()
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
                      "images_per_second": round(len(items) / elapsed, 2), "weights": detector.weights.label}))
    if failed:
        shown = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
        raise UserError(f"{len(failed)} of {len(items)} image(s) got a NaN or infinite score and no verdict ({shown}); "
                        "the model file may be damaged: check it with `padim info --verify`")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from padim.models import PadimDetector

    from .evaluation import evaluate

    detector = PadimDetector.load(args.model, device=args.device, with_state=args.calibrate)
    try:
        result = evaluate(detector, args.category_dir, args.batch_size, args.workers, progress=not args.quiet)
    except ValueError as error:
        raise UserError(str(error)) from None
    result["model"] = str(args.model)
    result["weights"] = detector.weights.label
    if args.calibrate:
        if "f1_optimal_threshold_raw" not in result:
            raise UserError("--calibrate needs both good and defective test images")
        detector.calibration = detector.calibration.with_threshold(result["f1_optimal_threshold_raw"])
        detector.save(args.model, include_state=detector.state is not None)
        result["calibrated"] = True
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from padim.service.server import serve
    from padim.service.settings import ServiceSettings

    flags = {k: getattr(args, k) for k in ("models", "model_dir", "default_model", "host", "port", "device",
                                           "max_batch_size", "max_delay_ms", "log_level")}
    try:
        settings = ServiceSettings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as error:
        first = error.errors()[0]
        raise UserError(f"{'.'.join(map(str, first['loc'])) or 'settings'}: {first['msg']} "
                        f"(given {first.get('input')!r})") from None
    try:
        return serve(settings)
    except ValueError as error:
        raise UserError(str(error)) from None


def cmd_fetch_weights(args: argparse.Namespace) -> int:
    from padim.models import BACKBONES, WeightsError, build_backbone

    unknown = [b for b in args.backbones if b not in BACKBONES]
    if unknown:
        raise UserError(f"unknown backbone(s) {', '.join(unknown)}; choose from: {', '.join(BACKBONES)}")
    import torch

    for name in args.backbones:
        try:
            _, info = build_backbone(name, "imagenet")
        except WeightsError as error:
            raise UserError(str(error)) from None
        print(json.dumps({"backbone": name, "weights": info.detail, "cache": str(Path(torch.hub.get_dir()) / "checkpoints")}))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    import os
    import urllib.error
    import urllib.request

    url = args.url or f"http://127.0.0.1:{os.environ.get('PADIM_PORT', '8000')}/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            ready = response.status == 200
    except (urllib.error.URLError, OSError) as error:
        print(f"padim health: {url}: {getattr(error, 'reason', error)}", file=sys.stderr)
        return 1
    return 0 if ready else 1


def cmd_info(args: argparse.Namespace) -> int:
    from padim.core import load_artifact, read_header
    from padim.models import WeightsInfo

    header = load_artifact(args.model)[1] if args.verify else read_header(args.model)
    config = header.get("config", {})
    calibration = header.get("calibration") or {}
    summary = {
        "file": str(args.model),
        "size_bytes": args.model.stat().st_size,
        "kind": header.get("kind"),
        "verified": "every tensor" if args.verify and header["verified"] else ("header" if header["verified"] else False),
        "backbone": config.get("backbone"),
        "image_size": config.get("image_size"),
        "weights": WeightsInfo(**header["weights"]).label if "weights" in header else None,
        "fit_image_count": header.get("fit_image_count"),
        "unreadable_image_count": header.get("unreadable_image_count"),
        "calibration": {**calibration, "source": header.get("calibration_source"),
                        "folds": config.get("calibration_folds")} if calibration else None,
        "header": header,
    }
    print(json.dumps(summary, indent=2))
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from .synthetic import CATEGORIES, generate

    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown or not categories:
        raise UserError(f"--categories: unknown {unknown}; choose from {', '.join(CATEGORIES)}")
    if args.size < 32:
        raise UserError("--size: use at least 32 pixels")
    written = generate(args.out_dir, categories, args.train, args.test_good, args.test_defect, args.size, args.seed)
    print(json.dumps({"categories": [str(p) for p in written]}))
    return 0
