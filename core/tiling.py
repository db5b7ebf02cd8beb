"""Tiles of a picture: where they lie on the model input, and how their maps become one map.

A tiled model's input is ``(B, 3, H_in, W_in)``: the picture (or its region of interest) resized
to ``rows x cols`` tiles of ``S x S`` pixels, neighbours overlapping by ``overlap`` cells of the
feature grid. Each tile goes through the backbone on its own (:meth:`Tiling.cut`: the tiles
become a batch), and the tiles' distance grids are stitched into one grid of the whole input,
averaging where tiles overlap, before the map is upsampled (and smoothed) to the input's pixels
(:func:`tiled_anomaly_maps`). Both steps are linear per axis, so they are one precomputed
``(rows, H_in, H)`` and ``(cols, W, W_in)`` pair of matrices: the map is two batched products,
in torch and in an exported graph alike.

Shapes: ``T = rows * cols`` tiles, ``H x W`` each tile's feature grid (``S / cell``), ``P = H * W``.

Example:
    >>> tiling = Tiling(rows=2, cols=3, size=64, cell=4, overlap=4)
    >>> tiling.input_shape, tiling.origins[:2]
    ((112, 160), [(0, 0), (0, 48)])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from padim.core.scoring import anomaly_maps, upsample_blur_operator


@dataclass(frozen=True)
class Tiling:
    """``rows x cols`` tiles of side ``size`` input pixels, ``overlap`` feature cells shared by neighbours.

    Attributes:
        rows, cols: tiles down and across (1 x 1: the model input is one tile, no tiling).
        size: side ``S`` of a tile in input pixels (the backbone's input).
        cell: input pixels per feature-grid cell (the stride of the first layer).
        overlap: feature-grid cells neighbouring tiles share (``overlap * cell`` input pixels).
    """

    rows: int = 1
    cols: int = 1
    size: int = 224
    cell: int = 4
    overlap: int = 0

    def __post_init__(self) -> None:
        if self.rows < 1 or self.cols < 1:
            raise ValueError(f"tiles must be at least 1 x 1, got {self.rows} x {self.cols}")
        if self.size % self.cell:
            raise ValueError(f"tile size {self.size} is not a multiple of the feature cell {self.cell}")
        if not 0 <= self.overlap < self.size // self.cell:
            raise ValueError(f"overlap {self.overlap} cells must be below the tile's {self.size // self.cell} cells")

    @property
    def count(self) -> int:
        """``T``: tiles per picture."""
        return self.rows * self.cols

    @property
    def grid(self) -> tuple[int, int]:
        """``(H, W)``: one tile's feature grid."""
        return self.size // self.cell, self.size // self.cell

    @property
    def step(self) -> int:
        """Input pixels from one tile's origin to the next one's."""
        return self.size - self.overlap * self.cell

    @property
    def input_shape(self) -> tuple[int, int]:
        """``(H_in, W_in)``: the model input, in pixels (``(S, S)`` untiled)."""
        return self.size + (self.rows - 1) * self.step, self.size + (self.cols - 1) * self.step

    @property
    def origins(self) -> list[tuple[int, int]]:
        """``(top, left)`` input pixel of every tile, row by row (the order of the tile batch)."""
        return [(r * self.step, c * self.step) for r in range(self.rows) for c in range(self.cols)]

    def cut(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H_in, W_in)`` -> ``(B * T, 3, S, S)``: every picture's tiles, one after another."""
        if self.count == 1:
            return images
        size = self.size
        tiles = [images[:, :, top : top + size, left : left + size] for top, left in self.origins]
        return torch.stack(tiles, dim=1).reshape(-1, images.shape[1], size, size)

    def map_operators(
        self, sigma: float, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, H_in, H)`` and ``(cols, W, W_in)``: each tile row's (column's) grid onto the input's pixels.

        Stitching (the mean of the tiles covering a cell), bilinear upsampling and the Gaussian blur,
        as one linear map per axis; the maps of :func:`tiled_anomaly_maps` are
        ``sum_rc A_r d_rc B_c``.
        """
        return _operators(self, float(sigma), dtype, torch.device(device))


@functools.lru_cache(maxsize=32)
def _operators(
    tiling: Tiling, sigma: float, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`Tiling.map_operators`, made once per device (a GPU's copy stays there)."""
    rows = _axis_operator(tiling.rows, tiling.grid[0], tiling.overlap, tiling.input_shape[0], sigma)
    cols = _axis_operator(tiling.cols, tiling.grid[1], tiling.overlap, tiling.input_shape[1], sigma)
    return rows.to(dtype=dtype, device=device), cols.transpose(1, 2).contiguous().to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=32)
def _axis_operator(tiles: int, length: int, overlap: int, size: int, sigma: float) -> torch.Tensor:
    """``(tiles, size, length)`` float64: tile ``t``'s grid cells -> the input's pixels along one axis."""
    step = length - overlap
    stitched = length + (tiles - 1) * step
    place = torch.zeros(tiles, stitched, length, dtype=torch.float64)  # where each tile's cells land
    for t in range(tiles):
        place[t, t * step : t * step + length] = torch.eye(length, dtype=torch.float64)
    place /= place.sum(dim=(0, 2)).view(1, stitched, 1)  # the mean of the tiles covering a cell
    upsample = upsample_blur_operator(stitched, size, sigma, torch.float64)  # (size, stitched)
    return upsample @ place  # (tiles, size, length)


def tiled_anomaly_maps(
    squared_distance: torch.Tensor,
    tiling: Tiling,
    sigma: float,
    operators: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Stitched anomaly maps of tiled pictures.

    Args:
        squared_distance: ``(B, T * P)``: every tile's squared distances, tiles in :attr:`Tiling.origins` order.
        tiling: the tiles' layout.
        sigma: Gaussian blur of the stitched map, in input pixels.
        operators: :meth:`Tiling.map_operators` (computed and cached when not given).

    Returns:
        ``(B, H_in, W_in)`` maps: the square root of the distances, stitched (overlaps averaged),
        upsampled and blurred as one map.
    """
    rows_op, cols_op = (
        operators
        if operators is not None
        else tiling.map_operators(sigma, squared_distance.dtype, squared_distance.device)
    )
    height, width = tiling.grid
    distance = squared_distance.clamp_min(0).sqrt().reshape(-1, tiling.rows, tiling.cols, height, width)
    across = torch.matmul(distance, cols_op).sum(dim=2)  # (B, R, H, W_in)
    return torch.matmul(rows_op, across).sum(dim=1)  # (B, H_in, W_in)


def picture_maps(squared_distance: torch.Tensor, tiling: Tiling, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Distances of tiles (or of whole inputs) -> per-picture distances and maps.

    Args:
        squared_distance: ``(N, p)`` rows of squared distances, a picture's rows consecutive: one row
            of ``T * P`` a picture (its own statistics per tile position, or untiled), or ``T`` rows
            of ``P`` (tiles sharing statistics).

    Returns:
        ``(B, T * P)`` distances of each picture and its ``(B, H_in, W_in)`` map.
    """
    height, width = tiling.grid
    per_picture = squared_distance.reshape(-1, tiling.count * height * width)
    if tiling.count == 1:
        return per_picture, anomaly_maps(per_picture, tiling.grid, tiling.size, sigma)
    return per_picture, tiled_anomaly_maps(per_picture, tiling, sigma)
