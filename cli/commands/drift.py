"""``padim drift``: is a folder of recent images still what the model was fitted on? Exit 3 when not."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from padim.models.errors import UsageError

from ..options import batch_size, quiet_option, run_options, runtime_option, workers
from .predict import load

#: Exit status when a test fires (1 is an error, 2 a usage error of the command line).
DRIFT_EXIT_STATUS = 3


def register(commands) -> None:
    drift = commands.add_parser(
        "drift",
        parents=[run_options(), runtime_option(), quiet_option()],
        help="read a folder of recent images against the model's calibration (flag rate, score and input drift)",
        description="Score the images of FOLDER (recent images from the line, normal-looking or not: no labels) and "
        "read them against the model's calibration, as the service's monitor does: the flag rate against what "
        "normal images alone would give (one-sided binomial test against the calibration's false-alarm bound), "
        "score drift and input drift (one-sided Kolmogorov-Smirnov tests: only higher scores or input distances than "
        "the calibration's normal images count; PSI beside). Prints the reading as JSON. "
        f"Exit status: 0 normal, {DRIFT_EXIT_STATUS} when a test fires (for a nightly job's alert), 1 on an error. "
        "Models older than format 7 (exports older than version 4) have no input-drift reference: that test is "
        "left out. See docs/monitoring.md.",
    )
    drift.add_argument(
        "model", type=Path, metavar="MODEL", help="model file (padim train) or export directory (padim export)"
    )
    drift.add_argument("folder", type=Path, metavar="FOLDER", help="folder of recent images (searched recursively)")
    drift.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="write DIR/drift.html (plots, tests, highest-scoring images; opens offline) and DIR/drift.json",
    )
    drift.add_argument(
        "--level",
        type=float,
        default=None,
        metavar="P",
        help="level of each test: an alarm when its p-value is below P (default 0.01)",
    )
    drift.add_argument(
        "--min-images",
        type=int,
        default=None,
        metavar="N",
        help="fewest readable images to read a folder (default 30); fewer is an error",
    )
    drift.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    from padim.core.drift import LEVEL, MIN_IMAGES
    from padim.models.data.images import list_images
    from padim.models.evaluation.drift import read_drift, score_folder, write_drift_report

    level = LEVEL if args.level is None else args.level
    if not 0.0 < level < 1.0:
        raise UsageError(f"--level must be between 0 and 1 (exclusive), got {level:g}")
    min_images = MIN_IMAGES if args.min_images is None else args.min_images
    if min_images < 1:
        raise UsageError(f"--min-images must be at least 1, got {min_images}")
    if not args.folder.is_dir():
        raise UsageError(f"{args.folder}: not a folder")
    paths = list_images(args.folder)
    if not paths:
        raise UsageError(f"{args.folder}: no images found (looked for png, jpg, jpeg, bmp, tif recursively)")
    scorer = load(args)
    recent = score_folder(scorer, paths, batch_size(args), workers(args), progress=not args.quiet)
    if len(recent.raw_scores) < min_images:
        raise UsageError(
            f"{args.folder}: {len(recent.raw_scores)} readable image(s); the tests need at least "
            f"{min_images} (--min-images)"
            + (f"; {len(recent.unreadable)} could not be read" if recent.unreadable else "")
        )
    drift = read_drift(recent, scorer.calibration, level, min_images)
    summary = {
        "model": str(args.model),
        "folder": str(args.folder),
        **drift.to_dict(),
        "unreadable": len(recent.unreadable),
    }
    if args.report:
        summary["report"] = str(
            write_drift_report(args.report, recent, drift, scorer, str(args.model), str(args.folder))
        )
    print(json.dumps(summary))
    return DRIFT_EXIT_STATUS if drift.alarms else 0
