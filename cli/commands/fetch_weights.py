"""``padim fetch-weights``: ImageNet backbone weights into torch's cache, for offline nodes and images."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from padim.models.errors import UsageError

from ..options import quiet_option


def register(commands) -> None:
    fetch = commands.add_parser(
        "fetch-weights",
        parents=[quiet_option()],
        help="download ImageNet backbone weights into torch's cache (for offline nodes and images)",
        description="Download torchvision's IMAGENET1K_V1 weights of each BACKBONE into $TORCH_HOME/hub/checkpoints "
        "(default ~/.cache/torch). Run it where there is internet, then copy that directory, or bake it into "
        "the Docker image (build argument BAKE_WEIGHTS).",
    )
    fetch.add_argument("backbones", nargs="+", metavar="BACKBONE", help="any of train --backbone's: resnet18 vgg16 ...")
    fetch.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    import torch

    from padim.models.families import BACKBONES
    from padim.models.features.backbones import build_backbone

    unknown = [b for b in args.backbones if b not in BACKBONES]
    if unknown:
        raise UsageError(f"unknown backbone(s) {', '.join(unknown)}; choose from: {', '.join(BACKBONES)}")
    for name in args.backbones:
        _, info = build_backbone(name, "imagenet")
        print(
            json.dumps(
                {"backbone": name, "weights": info.detail, "cache": str(Path(torch.hub.get_dir()) / "checkpoints")}
            )
        )
    return 0
