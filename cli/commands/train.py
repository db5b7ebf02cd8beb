"""``padim train``: fit a detector on a folder of normal images."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from padim.models.choices import (
    EXPECT_PRESETS,
    IMAGE_SCORES,
    NEIGHBOURHOODS,
    PRECISION_DTYPES,
    REDUCTIONS,
    RESIZES,
    TILE_STATISTICS,
    parse_tiles,
)
from padim.models.errors import UsageError

from ..options import quiet_option, run_options

DESCRIPTION = (
    "Fit a detector on every image under DATA_DIR (png/jpg/jpeg/bmp/tif, recursively). "
    "Every image is read through the backbone once, fitted, and also scored by the model of the images "
    "outside its calibration fold (folds come from file names; that model is derived from the fitted one, "
    "not fitted again); those out-of-fold scores set the threshold for the false-alarm rate you ask for "
    "(--false-alarm-rate), and train says what that threshold can promise. Unreadable images are left out "
    "and named. Before it starts, train says how much memory the fit needs, and refuses one that would not "
    "fit, naming what would. Memory does not grow with the number of images: their embeddings wait on disk "
    "(--scratch-dir) until the calibration. Under torchrun "
    "(torchrun --nproc-per-node N -m padim train ...) each rank fits a disjoint shard, the statistics "
    "are combined with torch.distributed (NCCL on GPUs, Gloo on CPUs) and rank 0 writes the file."
)


def register(commands) -> None:
    train = commands.add_parser(
        "train",
        parents=[run_options(), quiet_option()],
        help="fit a detector on a folder of normal images",
        description=DESCRIPTION,
    )
    train.add_argument("data_dir", type=Path, metavar="DATA_DIR", help="folder of normal (defect-free) images")
    train.add_argument("--output", "-o", type=Path, required=True, help="model file to write (atomically)")
    train.add_argument("--config", type=Path, help="YAML file of options (see configs/); flags override it")
    _model_options(
        train.add_argument_group("what the detector computes (fixed once fitted: --resume and merge keep them)")
    )
    _file_options(train.add_argument_group("the verdict and the file"))
    train.add_argument(
        "--scratch-dir",
        type=Path,
        metavar="DIR",
        help="where the images' embeddings (float32, P x D per image) and the precision factors wait "
        "during the fit, in files removed when it ends however it ends (default: the output's folder); "
        "when they would not fit on its disk, the calibration embeds the images again instead",
    )
    train.set_defaults(handler=run)


def _model_options(model) -> None:
    model.add_argument("--backbone", help="torchvision ResNet-family name (default resnet18)")
    model.add_argument(
        "--weights", help="imagenet (default; torchvision cache), random (demo/tests only, seeded) or a state_dict path"
    )
    model.add_argument(
        "--image-size",
        type=int,
        metavar="PX",
        help="side of the square model input, a multiple of 16 (of 32 with layer4) (default 224)",
    )
    model.add_argument("--layers", help="comma-separated stages, shallowest first (default layer1,layer2,layer3)")
    model.add_argument(
        "--embedding-dim",
        "--features",
        dest="embedding_dim",
        type=int,
        metavar="D",
        help="embedding size after reduction (default 100 for resnet18, 550 for wide_resnet50_2)",
    )
    model.add_argument(
        "--reduction", choices=REDUCTIONS, help="channel subset (paper, default) or semi-orthogonal projection"
    )
    model.add_argument("--epsilon", type=float, help="covariance regularisation (default 0.01)")
    model.add_argument(
        "--seed", type=int, help="seed of the channel subset / projection and random weights (default 0)"
    )
    model.add_argument(
        "--neighbourhood",
        type=int,
        choices=NEIGHBOURHOODS,
        metavar="K",
        help="average each layer's features over K x K neighbours before the Gaussian: 3 (default, as "
        "PatchCore: more defects found on most generated categories, docs/quality.md), 1 (none, the "
        "paper; configs/paper.yaml) or 5",
    )
    model.add_argument(
        "--image-score",
        choices=IMAGE_SCORES,
        help="how an image's score is read from its map: map_max (default, the map's maximum), "
        "patch_max (the largest feature-grid distance, unsmoothed) or top_mean (mean of the "
        "--top-fraction highest map pixels); the calibration reads its scores the same way",
    )
    model.add_argument(
        "--top-fraction", type=float, metavar="SHARE", help="share of the map's pixels top_mean averages (default 0.01)"
    )
    model.add_argument(
        "--blur-sigma",
        type=float,
        metavar="PX",
        help="Gaussian smoothing of the map, in input pixels (default 0: none, the neighbourhood "
        "average smooths already; the paper: 4)",
    )
    model.add_argument(
        "--roi",
        type=roi_value,
        metavar="X,Y,W,H",
        help="region of interest in pixels of the picture (as seen: EXIF orientation applied): only it "
        "is fitted and scored, every picture must hold it, and maps come back at the picture's size, 0 "
        "outside it (default: the whole picture)",
    )
    model.add_argument(
        "--resize",
        choices=RESIZES,
        help="how the picture (or --roi) becomes the square model input: squash (default: resized, the "
        "aspect ratio lost), crop (its largest centred square) or pad (centred on a square of its longer "
        "side, filled with the ImageNet mean colour); with --tiles, a box of the tiles' shape",
    )
    model.add_argument(
        "--tiles",
        type=tiles_value,
        metavar="RxC",
        help="cut the picture (or --roi), resized to R x C tiles of --image-size pixels, into tiles that "
        "each go through the backbone, for small defects on big pictures: the tiles' maps are stitched "
        "into one map of the picture, whose maximum is the image score and the calibration's (default "
        "1x1: no tiling). Costs the tiles' count in fit and scoring time",
    )
    model.add_argument(
        "--tile-overlap",
        type=float,
        metavar="SHARE",
        help="share of a tile its neighbours overlap, 0 to 0.5 (default 0); the stitched map averages "
        "the tiles where they overlap",
    )
    model.add_argument(
        "--tile-statistics",
        choices=TILE_STATISTICS,
        help="position (default): each tile position its own statistics, for placed parts (a board, a "
        "pill in a fixture), memory x the tiles' count; shared: one set every tile shares, for uniform "
        "surfaces (textures, webs, sheets), the memory of an untiled model and T times the samples",
    )
    model.add_argument(
        "--expect",
        metavar="CHANGES",
        help="the small changes the line makes to its pictures, for the threshold to cover: a preset, "
        + ", ".join(f"{k} ({v or 'none'})" for k, v in EXPECT_PRESETS.items())
        + ", or your own "
        "list of change=bound from brightness, contrast (shares), shift (pixels of the picture), rotate "
        "(degrees), blur (sigma, pixels), jpeg (lowest quality). Each picture's calibration score is then "
        "that of a copy of it under one seeded draw of those changes, scored without it, so that the "
        "false-alarm promise holds on pictures within them (docs/calibration.md); costs a second "
        "backbone pass a picture and twice the spool",
    )
    model.add_argument(
        "--fit-changes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --expect, fit each picture's changed copy too: the Gaussians learn the changes "
        "(fewer defects missed than a threshold widened alone; docs/quality.md); --no-fit-changes "
        "widens the threshold alone",
    )
    model.add_argument(
        "--calibration-folds",
        type=folds_value,
        metavar="K",
        help="folds of the cross-fitted calibration: loo (leave-one-out: every image its own fold; "
        "default) or an integer from 2 to 1000 (folds from a hash of each file name: fold models of "
        "fewer images, so a more cautious threshold; one more factorisation per distinct fold size)",
    )


def _file_options(verdicts) -> None:
    verdicts.add_argument(
        "--false-alarm-rate",
        type=float,
        metavar="RATE",
        help="share of normal images the threshold may flag (default 0.01); may change on --resume",
    )
    verdicts.add_argument(
        "--precision-dtype",
        choices=PRECISION_DTYPES,
        help="storage of the precision factors (default auto: float16 when scores stay within 1e-3)",
    )
    verdicts.add_argument(
        "--resume",
        type=Path,
        metavar="MODEL",
        help="add DATA_DIR's images to this model's statistics (old images are not re-read; images it "
        "already fitted, by content, are left out); their out-of-fold scores join the model's",
    )
    verdicts.add_argument(
        "--slim",
        action="store_true",
        help="leave the statistics out of the file (about 4x smaller for resnet18; cannot be resumed)",
    )
    verdicts.add_argument(
        "--partial",
        action="store_true",
        help="fit every image and write only the statistics, to be combined later by `padim merge` "
        "(for shards fitted on separate machines or at separate times)",
    )


def roi_value(text: str) -> tuple[int, int, int, int]:
    """``--roi``: ``x,y,width,height`` in pixels."""
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(","))
    except ValueError:
        values = ()
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"{text!r} is not x,y,width,height (four integers, e.g. 120,80,640,480)")
    return values


def tiles_value(text: str) -> tuple[int, int]:
    """``--tiles``: ``ROWSxCOLS``."""
    tiles = parse_tiles(text)
    if not isinstance(tiles, tuple):
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxCOLS (e.g. 2x2 or 3x4)")
    return tiles


def folds_value(text: str) -> int | str:
    """``--calibration-folds``: an integer, or ``loo``."""
    if text.strip().lower() == "loo":
        return "loo"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or loo") from None


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    from padim.core.artifact import read_header
    from padim.models.devices import resolve_device
    from padim.models.fit import distributed
    from padim.models.model_file import save_fit
    from padim.models.training import fit_partial, train, training_images

    config, given = configuration(args)
    images = training_images(args.data_dir)
    if not images:
        raise UsageError(f"{args.data_dir}: no images found (looked for png, jpg, jpeg, bmp, tif recursively)")
    if args.partial and (args.resume or args.slim):
        raise UsageError("--partial writes statistics only: it cannot be combined with --resume or --slim")
    # the group first: it pins this rank's GPU (cuda:LOCAL_RANK), where --resume's fit is then loaded
    shard = distributed.from_environment(resolve_device(config.device))
    main = shard is None or shard.main
    try:
        resume = None if args.resume is None else _resumed(args, config, given)
    except BaseException:
        distributed.leave(shard)
        raise
    started = time.perf_counter()
    scratch = args.scratch_dir or args.output.parent
    announce = None if args.quiet else (lambda line: print(f"padim train: {line}", file=sys.stderr, flush=True))
    fit = None
    try:
        if args.partial:  # every image is fitted: `merge` calibrates on images kept out of all parts
            fit, report = fit_partial(config, images, not args.quiet and main, shard, scratch, announce)
            if main:
                save_fit(fit, args.output)
        else:
            report = train(
                config,
                images,
                args.output,
                resume,
                not args.quiet and main,
                shard,
                with_statistics=not args.slim,
                scratch_dir=scratch,
                announce=announce,
            )
    finally:
        distributed.leave(shard)
    if not main:
        return 0
    header = None if args.partial else read_header(args.output)
    if header is not None and not args.quiet:
        print(f"padim train: {verdict_line(header)}", file=sys.stderr)
    for warning in report.warnings:
        print(f"padim train: warning: {warning}", file=sys.stderr)
    print(json.dumps(_summary(args, report, header, fit, shard, time.perf_counter() - started)))
    return 0


def configuration(args: argparse.Namespace):
    """The configuration from defaults, ``--config`` YAML and flags, and which fields were given explicitly."""
    from padim.models.config import PadimConfig, read_config_file  # torch comes with the backbones table

    config, given = PadimConfig(), set()
    if args.config is not None:
        config, given = read_config_file(args.config)
    layers = tuple(x.strip() for x in args.layers.split(",")) if args.layers else None
    flags = dict(
        backbone=args.backbone,
        weights=args.weights,
        image_size=args.image_size,
        device=args.device,
        batch_size=args.batch_size,
        embedding_dim=args.embedding_dim,
        reduction=args.reduction,
        layers=layers,
        epsilon=args.epsilon,
        seed=args.seed,
        false_alarm_rate=args.false_alarm_rate,
        calibration_folds=args.calibration_folds,
        precision_dtype=args.precision_dtype,
        workers=args.workers,
        neighbourhood=args.neighbourhood,
        image_score=args.image_score,
        top_fraction=args.top_fraction,
        blur_sigma=args.blur_sigma,
        roi=args.roi,
        resize=args.resize,
        tiles=args.tiles,
        tile_overlap=args.tile_overlap,
        tile_statistics=args.tile_statistics,
        expect=args.expect,
        fit_changes=args.fit_changes,
    )
    given |= {k for k, v in flags.items() if v is not None}
    config = config.replace(**flags)
    if args.fit_changes and not config.expect:
        raise UsageError(
            "--fit-changes fits each picture's changed copy: say which changes with --expect "
            f"({', '.join(k for k in EXPECT_PRESETS if EXPECT_PRESETS[k])} or change=bound,...)"
        )
    return config, given


def _resumed(args: argparse.Namespace, config, given: set[str]):
    """The fit of ``--resume``, refused when a flag or ``--config`` asks for other statistics than it has."""
    # imported here: `padim --help` and `padim health` load no torch
    from padim.models.config import SCORE_FIELDS, STATISTICS_FIELDS
    from padim.models.model_file import load_fit

    resume = load_fit(args.resume, run_options=config)
    # the earlier out-of-fold scores were read from their maps one way: the new ones must be too
    clash = [k for k in config.differences(resume.config, STATISTICS_FIELDS + SCORE_FIELDS) if k in given]
    if clash:
        k = clash[0]
        source = "the flag" if getattr(args, k, None) is not None else "--config"
        raise UsageError(
            f"--resume {args.resume}: the model was fitted with {k}={getattr(resume.config, k)!r}, "
            f"not {getattr(config, k)!r} (from {source}); drop it or train a new model"
        )
    if "false_alarm_rate" in given:
        resume.config = resume.config.replace(false_alarm_rate=config.false_alarm_rate)
    return resume


def _summary(args: argparse.Namespace, report, header: dict | None, fit, shard, seconds: float) -> dict:
    """The JSON line ``padim train`` prints on stdout."""
    from padim.models.features.backbones import WeightsInfo  # torch: not for --help

    summary = {
        "model": str(args.output),
        "kind": "partial" if args.partial else "detector",
        "size_bytes": args.output.stat().st_size,
        "images": report.listed,
        "fitted": report.fitted,
        "unreadable": len(report.unreadable),
        "already_fitted": len(report.already_fitted),
        "seconds": round(seconds, 2),
        "phase_seconds": report.seconds,
        "world_size": shard.world if shard else 1,
        "memory": None
        if report.plan is None
        else {"planned_bytes": report.plan.total, "free_bytes": report.free_memory, "device": report.plan.device},
        "spooled_bytes": report.spool,
        "cuda_max_memory_allocated": report.cuda_peak,
    }
    if header is None:
        summary.update(fit_image_count=fit.count, weights=fit.weights.label)
    else:
        summary.update(
            fit_image_count=header["fit_image_count"],
            calibration={
                **header["calibration"],
                "source": header["calibration_source"],
                "folds": header["config"]["calibration_folds"],
                "expect": header["config"].get("expect", ""),
                "fit_changes": bool(header["config"].get("expect")) and header["config"].get("fit_changes", False),
            },
            precision_dtype=header["precision_dtype"],
            weights=WeightsInfo(**header["weights"]).label,
            backbone=header["config"]["backbone"],
            image_size=header["config"]["image_size"],
            embedding_dim=header["embedding_dim"],
        )
    return summary


def verdict_line(header: dict) -> str:
    """What the threshold of a model file means, in one line."""
    from padim.models.detector import promise_covers  # torch: not for --help

    cal, config = header["calibration"], header["config"]
    return (
        f"fitted {header['fit_image_count']} images; threshold {cal['threshold']:.4g} (raw) from "
        f"{cal['scores']} out-of-fold scores, aiming at {cal['false_alarm_rate']:.2%} false alarms; promised "
        f"{cal['promised_false_alarm_rate']:.2%} on average and at most {cal['false_alarm_bound']:.2%} with "
        f"{cal['confidence']:.0%} confidence, whatever the score distribution, on "
        f"{promise_covers(config.get('expect', ''), bool(config.get('expect')) and config.get('fit_changes', False))}"
    )
