"""Lower triangles packed row by row: how the comoment lives in memory and the factors in the file.

A symmetric or lower-triangular ``(D, D)`` matrix is kept as its ``T = D (D + 1) / 2`` entries on
and below the diagonal, row after row: row ``i`` holds columns ``0 .. i`` and starts at
``i (i + 1) / 2``. Rows ``i0 .. i1`` are therefore one contiguous range, which lets a blocked
product write a band of rows straight into place (:func:`add_lower_products_`).

Example:
    >>> import torch
    >>> m = torch.arange(9.0).view(1, 3, 3)
    >>> pack_lower(m)
    tensor([[0., 3., 4., 6., 7., 8.]])
    >>> unpack_lower(pack_lower(m), 3)
    tensor([[[0., 0., 0.],
             [3., 4., 0.],
             [6., 7., 8.]]])
    >>> x = torch.randn(2, 5, 4, dtype=torch.float64)            # (P, B, D)
    >>> packed = torch.zeros(2, packed_length(4), dtype=torch.float64)
    >>> _ = add_lower_products_(packed, x)
    >>> torch.allclose(unpack_lower(packed, 4, symmetric=True), x.transpose(1, 2) @ x)
    True
"""

from __future__ import annotations

import functools

import torch


def packed_length(dim: int) -> int:
    """``T = D (D + 1) / 2``: entries of a packed lower triangle."""
    return dim * (dim + 1) // 2


def row_start(row: int) -> int:
    """Where row ``row`` of the lower triangle starts in the packed layout."""
    return row * (row + 1) // 2


@functools.lru_cache(maxsize=16)
def _lower_flat_index(dim: int, device: torch.device, transposed: bool = False) -> torch.Tensor:
    rows, cols = torch.tril_indices(dim, dim, device=device)
    return (cols * dim + rows) if transposed else (rows * dim + cols)  # (T,) into a row-major (D, D)


def pack_lower(matrices: torch.Tensor) -> torch.Tensor:
    """Lower triangle (diagonal included) of ``(P, D, D)`` as ``(P, T)``."""
    pixels, dim = matrices.shape[0], matrices.shape[-1]
    # one gather over the flat buffer: a gather along dim 1 runs several times slower
    return matrices.reshape(-1).take(_pixels_index(pixels, dim, matrices.device)).view(pixels, packed_length(dim))


_PIXELS_INDEX: dict[tuple[int, torch.device], torch.Tensor] = {}


def _pixels_index(pixels: int, dim: int, device: torch.device) -> torch.Tensor:
    """Flat positions of the lower triangles of ``pixels`` row-major ``(D, D)`` matrices (grown, kept per ``D``)."""
    key = (dim, torch.device(device))
    known = _PIXELS_INDEX.get(key)
    if known is None or known.numel() < pixels * packed_length(dim):
        lower = _lower_flat_index(dim, device)
        known = (torch.arange(pixels, device=device).unsqueeze(1) * (dim * dim) + lower).reshape(-1)
        _PIXELS_INDEX[key] = known
    return known[: pixels * packed_length(dim)]


def unpack_lower(
    packed: torch.Tensor, dim: int, symmetric: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of :func:`pack_lower`: ``(P, T)`` -> ``(P, D, D)``, lower-triangular or symmetric.

    Args:
        out: a ``(P, D, D)`` buffer to fill (reused across slices to avoid allocations).
    """
    pixels = packed.shape[0]
    full = packed.new_zeros(pixels, dim, dim) if out is None else out.zero_()
    flat = full.view(pixels, dim * dim)
    flat.index_copy_(1, _lower_flat_index(dim, packed.device), packed)
    if symmetric:
        flat.index_copy_(1, _lower_flat_index(dim, packed.device, transposed=True), packed)
    return full


#: Rows of the lower triangle computed per product in :func:`add_lower_products_`.
ROW_BLOCK = 64
#: Bytes of one band product in :func:`add_lower_products_`: a few pixels at a time, so that the
#: band stays in cache between the product and the addition.
BAND_BYTES = 2 * 2**20


def add_lower_products_(
    packed: torch.Tensor, x: torch.Tensor, alpha: float = 1.0, row_block: int = ROW_BLOCK
) -> torch.Tensor:
    """``packed += alpha * pack_lower(x^T x)`` per pixel, in place, without a ``(P, D, D)`` temporary.

    Row band ``i0 .. i1`` of ``x^T x`` is computed as one ``(c, i1 - i0, i1)`` product (the
    columns a lower triangle needs, and a few above the diagonal) for a few pixels at a time,
    and its lower part is added to the band's contiguous range of ``packed``: about half the
    arithmetic of the full square, and one pass over ``packed``.

    Args:
        packed: ``(P, T)`` packed lower triangles.
        x: ``(P, B, D)``, in ``packed``'s dtype: the ``x^T x`` of every pixel is a sum over ``B``.
        alpha: scale of the added products.
    """
    pixels, _, dim = x.shape
    step = max(1, BAND_BYTES // (packed.element_size() * min(row_block, dim) * dim))
    for p0 in range(0, pixels, step):
        p1 = min(p0 + step, pixels)
        xs = x[p0:p1]
        xt = xs.transpose(1, 2)  # (c, D, B)
        for i0 in range(0, dim, row_block):
            i1 = min(i0 + row_block, dim)
            band = torch.bmm(xt[:, i0:i1], xs[:, :, :i1])  # (c, i1 - i0, i1): rows i0..i1, columns 0..i1
            target = packed[p0:p1, row_start(i0) : row_start(i1)]
            target.add_(band.view(p1 - p0, -1).index_select(1, _band_index(i0, i1, x.device)), alpha=alpha)
    return packed


@functools.lru_cache(maxsize=256)
def _band_index(i0: int, i1: int, device: torch.device) -> torch.Tensor:
    """Positions, in a row-major ``(i1 - i0, i1)`` band, of the lower-triangle entries of rows ``i0 .. i1``."""
    width = i1
    return torch.cat([torch.arange(r * width, r * width + i0 + r + 1) for r in range(i1 - i0)]).to(device)
