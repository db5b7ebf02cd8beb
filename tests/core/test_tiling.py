"""Tiles: where they are cut, and the stitched map against an explicit stitch-then-upsample reference."""

import numpy as np
import pytest
import torch
from helpers import reference_maps

from padim.core.scoring import anomaly_maps
from padim.core.tiling import Tiling, picture_maps, tiled_anomaly_maps


@pytest.mark.parametrize("rows, cols, overlap, sigma", [(2, 2, 0, 0.0), (2, 3, 4, 0.0), (3, 2, 2, 2.0), (1, 3, 5, 4.0)])
def test_stitched_maps_equal_stitching_then_upsampling(rows, cols, overlap, sigma):
    tiling = Tiling(rows, cols, size=64, cell=4, overlap=overlap)
    squared = torch.rand(3, tiling.count * 256, dtype=torch.float64) * 50
    ours = tiled_anomaly_maps(squared, tiling, sigma)
    assert ours.shape == (3, *tiling.input_shape)
    np.testing.assert_allclose(ours.numpy(), reference_maps(squared.numpy(), tiling, sigma), rtol=1e-9, atol=1e-9)


def test_one_tile_is_the_untiled_map():
    tiling = Tiling(1, 1, size=64, cell=4)
    squared = torch.rand(2, 256, dtype=torch.float64)
    per_picture, maps = picture_maps(squared, tiling, 4.0)
    torch.testing.assert_close(maps, anomaly_maps(squared, (16, 16), 64, 4.0))
    torch.testing.assert_close(tiled_anomaly_maps(squared, tiling, 4.0), maps)


def test_tiles_are_cut_row_by_row_where_their_origins_say():
    tiling = Tiling(2, 3, size=32, cell=4, overlap=2)
    assert tiling.step == 24 and tiling.input_shape == (56, 80)
    images = torch.rand(2, 3, *tiling.input_shape)
    tiles = tiling.cut(images).reshape(2, 6, 3, 32, 32)
    for b in range(2):
        for t, (top, left) in enumerate(tiling.origins):
            assert torch.equal(tiles[b, t], images[b, :, top : top + 32, left : left + 32])


def test_rows_of_shared_statistics_are_grouped_by_picture():
    # T rows of P a picture (shared statistics) and one row of T * P (a Gaussian per position): the same map
    tiling = Tiling(2, 2, size=32, cell=4)
    squared = torch.rand(3, 4 * 64, dtype=torch.float64)
    _, by_position = picture_maps(squared, tiling, 0.0)
    _, by_tile_rows = picture_maps(squared.reshape(12, 64), tiling, 0.0)
    torch.testing.assert_close(by_position, by_tile_rows)


@pytest.mark.parametrize(
    "kwargs, message", [(dict(rows=0), "at least 1 x 1"), (dict(size=30), "multiple"), (dict(overlap=16), "below")]
)
def test_bad_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Tiling(**{"rows": 2, "cols": 2, "size": 64, "cell": 4, **kwargs})
