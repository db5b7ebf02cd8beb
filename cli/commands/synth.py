"""``padim synth``: a generated MVTec-layout data set of textures and placed parts with synthetic defects (offline
demos, tests, benchmarks)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from padim.models.errors import UsageError

from ..options import quiet_option


def register(commands) -> None:
    synth = commands.add_parser(
        "synth",
        parents=[quiet_option()],
        help="generate an MVTec-layout data set of textures and parts with synthetic defects",
        description="Write OUT_DIR/<category>/{train/good,test/<good|defect>,ground_truth/<defect>}. "
        "For demos and tests; works offline.",
    )
    synth.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder to write the categories into")
    synth.add_argument(
        "--categories",
        default="weave,carpet,tiles",
        help="comma-separated, of the textures weave, carpet, tiles, leather, wood and the placed parts "
        "pill, nut, board (default weave,carpet,tiles)",
    )
    synth.add_argument(
        "--defects",
        default="scratch,stain,hole",
        help="comma-separated, of scratch, stain, hole, crack (thin, branching) and speck (0.03-0.15%% of "
        "the picture) (default scratch,stain,hole)",
    )
    synth.add_argument("--train", type=int, default=40, help="normal training images per category (default 40)")
    synth.add_argument("--test-good", type=int, default=8, help="normal test images per category (default 8)")
    synth.add_argument("--test-defect", type=int, default=4, help="test images per defect type (default 4)")
    synth.add_argument("--size", type=int, default=256, help="image side in pixels (default 256)")
    synth.add_argument("--seed", type=int, default=0, help="default 0")
    synth.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # imported here: numpy and Pillow are not for `padim --help`
    from padim.models.data.synthetic import CATEGORIES, DEFECTS, MORE_DEFECTS, generate

    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown or not categories:
        raise UsageError(f"--categories: unknown {unknown}; choose from {', '.join(CATEGORIES)}")
    defects = tuple(d.strip() for d in args.defects.split(",") if d.strip())
    unknown = [d for d in defects if d not in DEFECTS + MORE_DEFECTS]
    if unknown or not defects:
        raise UsageError(f"--defects: unknown {unknown}; choose from {', '.join(DEFECTS + MORE_DEFECTS)}")
    if args.size < 32:
        raise UsageError("--size: use at least 32 pixels")
    written = generate(
        args.out_dir, categories, args.train, args.test_good, args.test_defect, args.size, args.seed, defects
    )
    print(json.dumps({"categories": [str(p) for p in written]}))
    return 0
