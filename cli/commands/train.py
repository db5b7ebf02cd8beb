"""``padim train``: fit a detector on a folder of normal images."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from padim.models import options
from padim.models.choices import EXPECT_PRESETS, presets
from padim.models.errors import UsageError

from ..options import add_quiet

DESCRIPTION = (
    "Fit a detector on the normal (defect-free) pictures under DATA_DIR and write it, with its threshold, to one "
    "model file. Every default below is what most lines need; every option in full: docs/training.md."
)
MORE = """\
how it works:
  Every picture (png/jpg/jpeg/bmp/tif, recursively) goes through the backbone
  once, is fitted, and is scored by the model of the pictures outside its
  calibration fold (derived from the fitted one, not fitted again); those
  out-of-fold scores set the threshold for --false-alarm-rate, and train says
  what it can promise. Unreadable pictures are left out and named. Before it
  starts, train says how much memory the fit needs and refuses a fit that
  would not fit, naming what would; memory does not grow with the number of
  pictures (their embeddings wait in --scratch-dir). Under torchrun
  (torchrun --nproc-per-node N -m padim train ...) each rank fits a shard and
  rank 0 writes the file (docs/training-at-scale.md).

examples:
  padim train line3/good -o line3.padim                  # ImageNet weights
  padim train line3/good -o line3.padim --config paper   # the paper's PaDiM
  padim train line3/good -o line3.padim --print-config > mine.yaml
"""


class Help(argparse.RawDescriptionHelpFormatter):
    """The description wrapped to the terminal, the epilog as written; flags and their help side by side."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text == DESCRIPTION:
            return argparse.HelpFormatter._fill_text(self, text, width, indent)
        return super()._fill_text(text, width, indent)


def register(commands) -> None:
    train = commands.add_parser(
        "train",
        add_help=False,  # -h goes last, under "options", after the sections below
        help="fit a detector on a folder of normal images",
        usage="%(prog)s DATA_DIR --output MODEL [options]",
        description=DESCRIPTION,
        epilog=MORE,
        formatter_class=Help,
    )
    essential = train.add_argument_group("the options most fits need")
    essential.add_argument("data_dir", type=Path, metavar="DATA_DIR", help="folder of normal (defect-free) pictures")
    essential.add_argument(
        "--output", "-o", type=Path, metavar="MODEL", required=True, help="model file to write (atomically)"
    )
    essential.add_argument(
        "--config",
        metavar="PRESET|YAML",
        help="a preset (" + ", ".join(presets()) + ") or a YAML file of options; flags override it (default: none)",
    )
    essential.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective options (defaults, --config, flags) as the YAML --config reads, and exit",
    )
    options.add_essential_flags(essential)
    computes, verdicts = options.SECTIONS
    options.add_section(train, computes)
    _file_options(options.add_section(train, verdicts))
    runs = train.add_argument_group("how it runs")
    options.add_flags(runs, "run", skip=options.ESSENTIAL)
    runs.add_argument(
        "--scratch-dir",
        type=Path,
        metavar="DIR",
        help="where the images' embeddings (float32, P x D per image) and the precision factors wait "
        "during the fit, in files removed when it ends however it ends (default: the output's folder); "
        "when they would not fit on its disk, the calibration embeds the images again instead",
    )
    last = train.add_argument_group("options")
    last.add_argument("-h", "--help", action="help", help="show this help message and exit")
    add_quiet(last)
    train.set_defaults(handler=run)


def _file_options(verdicts) -> None:
    verdicts.add_argument(
        "--resume",
        type=Path,
        metavar="MODEL",
        help="add DATA_DIR's images to this model's statistics (old images are not re-read; images it "
        "already fitted, by content, are left out); their out-of-fold scores join the model's (default: none, a "
        "new model)",
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
    verdicts.add_argument(
        "--max-score-error",
        type=float,
        metavar="SHARE",
        help="with --precision bf16, fp16 or int8: the largest relative difference of training pictures' image "
        "scores from fp32's that the model may have, or it is refused and nothing is written (default 0.02: 2%%; "
        "int8: 0.25); at fp32, its int8 scorer's (--int8-scorer), refused past it (the model is written, and "
        "--runtime auto scores at float32)",
    )
    verdicts.add_argument(
        "--force",
        action="store_true",
        help="with --precision bf16, fp16 or int8: write the model even past --max-score-error (the file says so); "
        "at fp32, keep its int8 scorer past it",
    )


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    from padim.core.artifact import read_header
    from padim.models.devices import resolve_device
    from padim.models.fit import distributed
    from padim.models.fit.model_file import save_fit
    from padim.models.fit.precision import PrecisionGate
    from padim.models.fit.training import fit_partial, train, training_images

    config, given = configuration(args)
    if args.print_config:
        from padim.models.config import to_yaml  # with the configuration (torch comes with the tiling)

        print(to_yaml(config), end="")
        return 0
    images = training_images(args.data_dir)
    _check(args, config, images)
    gate = PrecisionGate(args.max_score_error, args.force)
    # the group first: it pins this rank's GPU (cuda:LOCAL_RANK), where --resume's fit is then loaded
    shard = distributed.from_environment(resolve_device(config.run.device))
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
                gate=gate,
            )
    finally:
        distributed.leave(shard)
    if main:
        header = None if args.partial else read_header(args.output)
        _say(args, report, header)
        print(json.dumps(_summary(args, report, header, fit, shard, time.perf_counter() - started)))
    return 0


def _check(args: argparse.Namespace, config, images: list) -> None:
    """The flags against each other and the folder, before anything starts."""
    if not images:
        raise UsageError(f"{args.data_dir}: no images found (looked for png, jpg, jpeg, bmp, tif recursively)")
    if args.partial and (args.resume or args.slim):
        raise UsageError("--partial writes statistics only: it cannot be combined with --resume or --slim")
    gated = config.features.precision != "fp32" or config.storage.int8_scorer
    if (args.max_score_error is not None or args.force) and (args.partial or not gated):
        raise UsageError(
            "--max-score-error and --force gate a model fitted at --precision bf16, fp16, int8 or auto, or a float32 "
            "model's int8 scorer (--int8-scorer, the default), and not --partial, which writes no scores"
        )


def _say(args: argparse.Namespace, report, header: dict | None) -> None:
    """What the threshold promises and the precision's check (unless -q), and every warning, on stderr."""
    if header is not None and not args.quiet:
        print(f"padim train: {verdict_line(header)}", file=sys.stderr)
        shrinkage = _shrinkage(header)
        if shrinkage["chosen"] == "estimated":
            print(f"padim train: shrinkage {shrinkage['weight']:.3f}, {shrinkage['why']}", file=sys.stderr)
        if report.precision_check is not None:
            print(f"padim train: {report.precision_check.sentence()}", file=sys.stderr)
        if report.int8_scorer is not None:
            print(f"padim train: {report.int8_scorer.sentence()}", file=sys.stderr)
        elif report.no_int8_scorer is not None and header["config"].get("precision", "fp32") == "fp32":
            print(f"padim train: no int8 scorer: {report.no_int8_scorer}", file=sys.stderr)
    for warning in report.warnings:
        print(f"padim train: warning: {warning}", file=sys.stderr)


def configuration(args: argparse.Namespace):
    """The configuration from defaults, ``--config`` YAML and flags, and which fields were given explicitly."""
    from padim.models.config import PadimConfig, read_config_file  # torch comes with the tiling

    config, given = PadimConfig(), set[str]()
    if args.config is not None:
        config, given = read_config_file(args.config)
    flags = options.given_flags(args)
    given |= set(flags)
    config = config.replace(**flags)
    if args.fit_changes and not config.gaussian.expect:
        raise UsageError(
            "--fit-changes fits each picture's changed copy: say which changes with --expect "
            f"({', '.join(k for k in EXPECT_PRESETS if EXPECT_PRESETS[k])} or change=bound,...)"
        )
    return config, given


def _resumed(args: argparse.Namespace, config, given: set[str]):
    """The fit of ``--resume``, refused when a flag or ``--config`` asks for other statistics than it has."""
    # imported here: `padim --help` and `padim health` load no torch
    from padim.models.choices import EXPECT_AUTO, PRECISION_AUTO
    from padim.models.config import CALIBRATION
    from padim.models.fit.model_file import load_fit

    resume = load_fit(args.resume, run_options=config)
    # the earlier out-of-fold scores were read from their maps one way: the new ones must be too
    clash = [k for k in config.differences(resume.config, CALIBRATION) if k in given]
    measured = resume.provenance.expect_measured or {}
    if measured and (config.gaussian.expect == EXPECT_AUTO or _declared(config.gaussian.expect, measured)):
        clash = [k for k in clash if k != "expect"]  # the cover it measured (or trimmed) stays
    if config.features.precision == PRECISION_AUTO:  # the precision it was fitted at stays
        clash = [k for k in clash if k != "precision"]
    if clash:
        k = clash[0]
        source = "the flag" if getattr(args, k, None) is not None else "--config"
        raise UsageError(
            f"--resume {args.resume}: the model was fitted with {k}={resume.config.to_dict()[k]!r}, "
            f"not {config.to_dict()[k]!r} (from {source}); drop it or train a new model"
        )
    if "false_alarm_rate" in given:
        resume.config = resume.config.replace(false_alarm_rate=config.verdict.false_alarm_rate)
    return resume


def _declared(expect: str, measured: dict) -> bool:
    """Whether ``expect`` is what a trimmed cover (``--trim-cover``) declared before it left changes out."""
    from padim.models.data.changes import Expected  # numpy and Pillow: not for --help

    return "declared" in measured and Expected.parse(expect) == Expected.parse(measured["declared"])


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
        else {
            "planned_bytes": report.plan.total,
            "free_bytes": report.free_memory,
            "device": report.plan.device,
            "embeddings_in_device_memory": report.plan.spool_held,
        },
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
            precision=header["config"].get("precision", "fp32"),
            precision_check=header.get("precision_check"),
            int8_scorer=header.get("int8_scorer")
            if header.get("int8_scorer") is not None
            else {"made": False, "why": report.no_int8_scorer},
            weights=WeightsInfo(**header["weights"]).label,
            backbone=header["config"]["backbone"],
            backbone_family=header["backbone"]["family"],
            stages=[stage["name"] for stage in header["backbone"]["stages"]],
            image_size=header["config"]["image_size"],
            embedding_dim=header["embedding_dim"],
            shrinkage=_shrinkage(header),
        )
    return summary


def _shrinkage(header: dict) -> dict:
    from padim.models.scoring.detector import shrinkage_chosen  # torch: not for --help

    return shrinkage_chosen(header["config"].get("shrinkage", 0.0), header.get("shrinkage_estimated"))


def verdict_line(header: dict) -> str:
    """What the threshold of a model file means, in one line."""
    from padim.models.scoring.detector import promise_covers  # torch: not for --help

    cal, config = header["calibration"], header["config"]
    return (
        f"fitted {header['fit_image_count']} images; threshold {cal['threshold']:.4g} (raw) from "
        f"{cal['scores']} out-of-fold scores, aiming at {cal['false_alarm_rate']:.2%} false alarms; promised "
        f"{cal['promised_false_alarm_rate']:.2%} on average and at most {cal['false_alarm_bound']:.2%} with "
        f"{cal['confidence']:.0%} confidence, whatever the score distribution, on "
        + promise_covers(
            config.get("expect", ""),
            bool(config.get("expect")) and config.get("fit_changes", False),
            measured=header.get("expect_measured"),
        )
    )
