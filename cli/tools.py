"""``padim info``, ``padim fetch-weights`` and ``padim synth``: files, weights, data."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import UserError


def register(commands, runtime: argparse.ArgumentParser, quiet: argparse.ArgumentParser) -> None:
    info = commands.add_parser(
        "info", parents=[quiet], help="print a model file's metadata as JSON",
        description="What a model file holds: images fitted, calibration (scores used, threshold, requested and "
        "promised false-alarm rates), backbone, and its full header. The header's digest is always checked.")
    info.add_argument("model", type=Path, metavar="MODEL", help="model file")
    info.add_argument("--verify", action="store_true", help="also check every tensor against its digest (reads the whole file)")
    info.set_defaults(handler=cmd_info)

    fetch = commands.add_parser(
        "fetch-weights", parents=[quiet], help="download ImageNet backbone weights into torch's cache (for offline nodes and images)",
        description="Download torchvision's IMAGENET1K_V1 weights of each BACKBONE into $TORCH_HOME/hub/checkpoints "
        "(default ~/.cache/torch). Run it where there is internet, then copy that directory, or bake it into "
        "the Docker image (build argument BAKE_WEIGHTS).",
    )
    fetch.add_argument("backbones", nargs="+", metavar="BACKBONE", help="e.g. resnet18 wide_resnet50_2")
    fetch.set_defaults(handler=cmd_fetch_weights)

    synth = commands.add_parser(
        "synth", parents=[quiet], help="generate an MVTec-layout data set of textures with synthetic defects",
        description="Write OUT_DIR/<category>/{train/good,test/<good|defect>,ground_truth/<defect>}. "
        "For demos and tests; works offline.",
    )
    synth.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder to write the categories into")
    synth.add_argument("--categories", default="weave,carpet,tiles",
                       help="comma-separated, of weave, carpet, tiles, leather, wood (default weave,carpet,tiles)")
    synth.add_argument("--train", type=int, default=40, help="normal training images per category (default 40)")
    synth.add_argument("--test-good", type=int, default=8, help="normal test images per category (default 8)")
    synth.add_argument("--test-defect", type=int, default=4, help="test images per defect type (default 4)")
    synth.add_argument("--size", type=int, default=256, help="image side in pixels (default 256)")
    synth.add_argument("--seed", type=int, default=0, help="default 0")
    synth.set_defaults(handler=cmd_synth)


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


def cmd_synth(args: argparse.Namespace) -> int:
    from padim.models.synthetic import CATEGORIES, generate

    categories = tuple(c.strip() for c in args.categories.split(",") if c.strip())
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown or not categories:
        raise UserError(f"--categories: unknown {unknown}; choose from {', '.join(CATEGORIES)}")
    if args.size < 32:
        raise UserError("--size: use at least 32 pixels")
    written = generate(args.out_dir, categories, args.train, args.test_good, args.test_defect, args.size, args.seed)
    print(json.dumps({"categories": [str(p) for p in written]}))
    return 0
