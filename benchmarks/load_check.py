"""What the integrity check costs when a model file is loaded.

Writes a model file with the tensors of a real detector of each backbone (224 px, default
channels, float16 factors; random values: the digest cost depends on bytes, not values), then
times loading it as ``padim serve`` does (training accumulators skipped) and as
``padim info --verify`` does (every tensor), and how much of each is the sha256 check.

    python benchmarks/load_check.py [--backbones resnet18,wide_resnet50_2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from timing import work_folder

from padim.core import artifact
from padim.core.artifact import load_artifact, save_artifact, tensor_sha256
from padim.models import PadimConfig
from padim.models.features.backbones import build_backbone, used_state


def model_tensors(backbone: str, size: int = 224) -> dict[str, torch.Tensor]:
    """Tensors of a fitted detector of ``backbone`` as ``PadimDetector.save`` writes them."""
    config = PadimConfig(backbone=backbone, weights="random", image_size=size)
    state = used_state(build_backbone(backbone, "random")[0], config.spec, config.features.stages)
    pixels = (size // 4) ** 2
    dim = config.embedding_dim_or_default()
    packed = dim * (dim + 1) // 2
    return {
        "mean": torch.randn(pixels, dim),
        "precision_factor": torch.randn(pixels, packed).half(),
        "calibration.scores": torch.randn(200, dtype=torch.float64),
        "image_digests": torch.arange(200),
        "embedding.channel_index": torch.arange(dim),
        "statistics.count": torch.tensor(200),
        "statistics.mean": torch.randn(pixels, dim, dtype=torch.float64),
        "statistics.comoment": torch.randn(pixels, packed, dtype=torch.float64),
        **{f"backbone.{k}": v for k, v in state.items()},
    }


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backbones", default="resnet18,wide_resnet50_2")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args()
    work = work_folder(args.workdir, "padim-load-check-")
    print(
        "| model (224 px) | file | bytes read when serving | load when serving | of which the check | "
        "every tensor (`info --verify`) | of which the check |"
    )
    print("|---|---|---|---|---|---|---|")
    for backbone in args.backbones.split(","):
        path = work / f"{backbone}.padim"
        tensors = model_tensors(backbone)
        save_artifact(path, tensors, {"kind": "padim-detector"})
        del tensors
        row = [backbone, f"{path.stat().st_size / 1e9:.2f} GB"]
        for skip in (("statistics.",), ()):
            load_artifact(path, skip_prefixes=skip)  # warm the page cache: time the check, not the disk
            seconds = min(timed(lambda path=path, skip=skip: load_artifact(path, skip_prefixes=skip)) for _ in range(3))
            loaded, _ = load_artifact(path, skip_prefixes=skip)
            check = min(timed(lambda loaded=loaded: [tensor_sha256(t) for t in loaded.values()]) for _ in range(3))
            size = sum(t.numel() * t.element_size() for t in loaded.values())
            if skip:
                row.append(f"{size / 1e9:.2f} GB")
            row += [f"{seconds:.2f} s", f"{check:.2f} s ({size / check / 1e9:.2f} GB/s)"]
            loaded = None  # free it before the next file
        print("| " + " | ".join(row) + " |", flush=True)
        path.unlink()
    print(f"(format {artifact.FORMAT_VERSION}; page cache warm; sha256 from Python's hashlib)")


if __name__ == "__main__":
    main()
