"""The hand-written kernel of benchmarks/mahalanobis.py --native (benchmarks/kernels/mahalanobis.c), against a float64
reference of the step on its float16 factors: what the benchmark times must be the step. Shapes off its blocks
(positions not a multiple of its chunk, D not of its 16 or 8 rows) and batches on and off its groups of four."""

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mahalanobis  # noqa: E402  (a benchmark's module, beside its script)

from padim.core.statistics import precision_factor  # noqa: E402


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
@pytest.mark.parametrize("dim", [37, 100])
def test_native_kernel_is_the_step(tmp_path: Path, dim: int) -> None:
    pixels = 41
    mean, factor = mahalanobis.gaussians(pixels, dim, samples=3 * dim, seed=0)
    factor = factor.half().float()  # as the model keeps it: the kernel's error is then its own arithmetic
    steps = mahalanobis.native_steps(mean, factor, tmp_path)
    if not steps:
        pytest.skip("this CPU has neither AVX-512 nor AVX2")
    generator = torch.Generator().manual_seed(1)
    for batch in (1, 3, 4, 9):
        rows = mean + torch.randn(batch, pixels, dim, generator=generator)  # (N, P, D)
        delta = (rows - mean).double()
        expected = torch.einsum("pij,npj->npi", factor.double(), delta).square().sum(-1)  # (N, P)
        channels_first = np.ascontiguousarray(rows.transpose(1, 2).numpy())  # (N, D, P), as the step is given
        for name, step in steps.items():
            found = torch.from_numpy(step(channels_first)).double()
            torch.testing.assert_close(found, expected, rtol=2e-5, atol=0, msg=f"{name}, batch {batch}")


def test_packed_layout_holds_the_triangle_once() -> None:
    dim = 20
    factor = precision_factor(torch.eye(dim).expand(3, dim, dim) * 2.0, epsilon=0.0).contiguous()
    factor = factor + torch.tril(torch.rand(3, dim, dim), -1)  # distinct entries below the diagonal
    for rows in (8, 16):
        packed = torch.from_numpy(mahalanobis.pack_blocks(factor, rows).view(np.float16).astype(np.float32))
        blocks = -(-dim // rows)
        assert packed.shape == (3, sum((blocks - k // rows) * rows for k in range(dim)))
        # every entry on or below the diagonal once (as float16), zeros for the rest of the blocks
        kept = torch.sort(packed[packed != 0]).values
        assert torch.equal(kept, torch.sort(factor.tril().half().float()[factor.tril() != 0]).values)
