"""``padim merge``: combine partial fits (``train --partial``) into one model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from padim.models.errors import UsageError

from ..options import quiet_option, run_options


def register(commands) -> None:
    merge = commands.add_parser(
        "merge",
        parents=[run_options(), quiet_option()],
        help="combine partial fits (train --partial) into one model",
        description="Add up the statistics of PARTS (refused unless every setting that shapes the statistics and "
        "the backbone weights match), derive the precision factors, and set the threshold from the scores of the "
        "normal images of --calibration-dir, which no part may have fitted (checked by content).",
    )
    merge.add_argument("parts", type=Path, nargs="+", metavar="PART", help="files written by `padim train --partial`")
    merge.add_argument("--output", "-o", type=Path, required=True, help="model file to write (atomically)")
    merge.add_argument(
        "--calibration-dir",
        type=Path,
        required=True,
        metavar="DIR",
        help="normal images kept out of every part, to set the threshold",
    )
    merge.add_argument("--false-alarm-rate", type=float, metavar="RATE", help="default: the parts' setting (0.01)")
    merge.add_argument("--slim", action="store_true", help="leave the statistics out of the merged file")
    merge.add_argument(
        "--scratch-dir",
        type=Path,
        metavar="DIR",
        help="where the calibration images' embeddings and the factors wait (default: the output's folder)",
    )
    merge.add_argument(
        "--max-score-error",
        type=float,
        metavar="SHARE",
        help="parts fitted at --precision bf16 or fp16: the largest relative difference of the calibration "
        "pictures' image scores from fp32's that the model may have, or nothing is written (default 0.02: 2%%)",
    )
    merge.add_argument(
        "--force",
        action="store_true",
        help="parts fitted at bf16 or fp16: write the model even past --max-score-error (the file says so)",
    )
    merge.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    from padim.core.artifact import read_header
    from padim.models.config import PadimConfig
    from padim.models.data.images import list_images
    from padim.models.features.backbones import WeightsInfo
    from padim.models.fit.precision import PrecisionGate
    from padim.models.fit.training import merge_fits

    gate = PrecisionGate(args.max_score_error, args.force)

    options = PadimConfig().replace(device=args.device, batch_size=args.batch_size, decode_workers=args.decode_workers)
    calibration = list_images(args.calibration_dir)
    if not calibration:
        raise UsageError(f"--calibration-dir {args.calibration_dir}: no images found")
    report = merge_fits(
        args.parts,
        calibration,
        options,
        args.output,
        args.false_alarm_rate,
        progress=not args.quiet,
        with_statistics=not args.slim,
        scratch_dir=args.scratch_dir,
        gate=gate,
    )
    header = read_header(args.output)
    print(
        json.dumps(
            {
                "model": str(args.output),
                "parts": len(args.parts),
                "fit_image_count": header["fit_image_count"],
                "calibration": {**header["calibration"], "source": header["calibration_source"]},
                "size_bytes": args.output.stat().st_size,
                "weights": WeightsInfo(**header["weights"]).label,
                **({"precision_check": header["precision_check"]} if header.get("precision_check") else {}),
            }
        )
    )
    if report.precision_check is not None:
        print(f"padim merge: {report.precision_check.sentence()}", file=sys.stderr)
    for warning in report.warnings:
        print(f"padim merge: warning: {warning}", file=sys.stderr)
    return 0
