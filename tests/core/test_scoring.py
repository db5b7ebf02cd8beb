"""Mahalanobis scoring and map post-processing against scipy/sklearn."""

import numpy as np
import pytest
import torch
from scipy.ndimage import gaussian_filter
from scipy.spatial.distance import mahalanobis
from sklearn.covariance import EmpiricalCovariance

from padim.core.scoring import anomaly_maps, gaussian_blur, image_scores, squared_mahalanobis
from padim.core.statistics import precision_factor


def test_squared_mahalanobis_matches_scipy_and_sklearn():
    rng = np.random.default_rng(0)
    pixels, dim = 5, 7
    train = rng.normal(size=(pixels, 40, dim)) @ rng.normal(size=(dim, dim))
    queries = rng.normal(size=(3, pixels, dim)) * 2
    means = train.mean(axis=1)
    covs = np.stack([np.cov(t, rowvar=False) for t in train])
    w = precision_factor(torch.from_numpy(covs), epsilon=0.0)
    ours = squared_mahalanobis(torch.from_numpy(queries), torch.from_numpy(means), w).numpy()
    for p in range(pixels):
        inverse = np.linalg.inv(covs[p])  # the explicit-inverse path
        estimator = EmpiricalCovariance().fit(train[p])
        for b in range(3):
            expected = mahalanobis(queries[b, p], means[p], inverse) ** 2
            assert ours[b, p] == pytest.approx(expected, rel=1e-9)
        # sklearn's mahalanobis is squared too, with its own (biased) covariance estimate
        biased = np.stack([np.cov(train[p], rowvar=False, bias=True)])
        w_biased = precision_factor(torch.from_numpy(biased), epsilon=0.0)
        ours_biased = squared_mahalanobis(
            torch.from_numpy(queries[:, p : p + 1]), torch.from_numpy(means[p : p + 1]), w_biased
        )
        np.testing.assert_allclose(ours_biased[:, 0].numpy(), estimator.mahalanobis(queries[:, p]), rtol=1e-9)


def test_mahalanobis_copies_no_pixel_matrix_one_by_one():
    """A channels-first embedding (as the backbone gives it) must not make bmm copy per pixel."""
    from torch.profiler import ProfilerActivity, profile

    batch, pixels, dim = 4, 64, 10
    embedding = torch.randn(batch, dim, pixels).transpose(1, 2)  # (B, P, D) view of (B, D, P) memory
    mean = torch.randn(pixels, dim)
    factor = precision_factor(torch.eye(dim).expand(pixels, dim, dim), epsilon=0.0)
    reference = ((embedding - mean).unsqueeze(-2) @ factor.transpose(1, 2)).squeeze(-2).square().sum(-1)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        got = squared_mahalanobis(embedding, mean, factor)
    copies = sum(e.count for e in trace.key_averages() if e.key in ("aten::copy_", "aten::clone"))
    assert copies < 4, f"{copies} copies for {pixels} pixels: the product copies per pixel again"
    torch.testing.assert_close(got, reference)


def test_float16_factors_are_upcast_by_chunks_for_the_result_of_upcasting_first():
    """Factors kept float16 (half the memory) score as the float32 upcast of the same values,
    with one upcast per chunk of pixels, never per pixel and never the whole tensor at once."""
    from torch.profiler import ProfilerActivity, profile

    generator = torch.Generator().manual_seed(0)
    batch, pixels, dim, chunk = 3, 300, 12, 128
    embedding = torch.randn(batch, dim, pixels, generator=generator).transpose(1, 2)
    mean = torch.randn(pixels, dim, generator=generator)
    spread = torch.randn(pixels, dim, 2 * dim, generator=generator)
    factor = precision_factor(spread @ spread.transpose(1, 2) / (2 * dim), epsilon=0.01).half()  # (P, D, D)
    upcast_first = squared_mahalanobis(embedding, mean, factor.float())
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        got = squared_mahalanobis(embedding, mean, factor, chunk_pixels=chunk)
    chunks = -(-pixels // chunk)
    upcasts = sum(e.count for e in trace.key_averages() if e.key == "aten::_to_copy")
    copies = sum(e.count for e in trace.key_averages() if e.key in ("aten::copy_", "aten::clone"))
    assert upcasts == chunks and copies <= chunks + 3, (upcasts, copies)
    assert got.dtype == torch.float32 and got.shape == (batch, pixels)
    torch.testing.assert_close(got, upcast_first, rtol=1e-6, atol=0)


def test_float32_scoring_close_to_float64():
    rng = np.random.default_rng(1)
    covs = np.stack([np.cov(rng.normal(size=(60, 10)), rowvar=False) for _ in range(8)])
    w = precision_factor(torch.from_numpy(covs), epsilon=0.01)
    x = torch.from_numpy(rng.normal(size=(4, 8, 10)))
    mean = torch.zeros(8, 10, dtype=torch.float64)
    exact = squared_mahalanobis(x, mean, w)
    single = squared_mahalanobis(x.float(), mean.float(), w.float())
    torch.testing.assert_close(single.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sigma", [1.0, 4.0])
def test_separable_blur_matches_scipy(sigma):
    rng = np.random.default_rng(2)
    maps = rng.random((2, 1, 40, 48))
    ours = gaussian_blur(torch.from_numpy(maps), sigma).numpy()
    # torch's "reflect" padding is scipy's "mirror" (edge sample not repeated)
    for i in range(2):
        expected = gaussian_filter(maps[i, 0], sigma, mode="mirror", truncate=4.0)
        np.testing.assert_allclose(ours[i, 0], expected, rtol=1e-10, atol=1e-12)


def test_anomaly_maps_shape_and_image_score_is_max():
    squared = torch.rand(3, 4 * 4) * 10
    maps = anomaly_maps(squared, (4, 4), output_size=32, sigma=1.0)
    assert maps.shape == (3, 32, 32)
    torch.testing.assert_close(image_scores(maps), maps.amax(dim=(1, 2)))
    flat = anomaly_maps(torch.full((1, 16), 9.0), (4, 4), 32, 4.0)
    torch.testing.assert_close(flat, torch.full((1, 32, 32), 3.0))  # sqrt, and blur keeps constants


@pytest.mark.parametrize(
    "grid, size, sigma", [((56, 56), 224, 4.0), ((16, 16), 64, 4.0), ((4, 6), 32, 0.0), ((2, 2), 16, 4.0)]
)
def test_operator_maps_equal_interpolate_then_blur(grid, size, sigma):
    squared = torch.rand(3, grid[0] * grid[1], dtype=torch.float64) * 50
    distance = squared.sqrt().view(3, 1, *grid)
    reference = torch.nn.functional.interpolate(distance, size=(size, size), mode="bilinear", align_corners=False)
    reference = gaussian_blur(reference, sigma)[:, 0]
    torch.testing.assert_close(anomaly_maps(squared, grid, size, sigma), reference, rtol=1e-10, atol=1e-10)


def test_image_scores_by_method_against_numpy():
    rng = np.random.default_rng(3)
    grid, size = (7, 5), 40
    squared = torch.from_numpy(rng.gamma(2.0, 3.0, size=(4, 35)))  # (B, P) float64
    maps = anomaly_maps(squared, grid, size, 2.0)  # (B, S, S)
    flat = maps.numpy().reshape(4, -1)
    np.testing.assert_allclose(image_scores(maps).numpy(), flat.max(axis=1), rtol=0)
    np.testing.assert_allclose(
        image_scores(maps, "patch_max", squared).numpy(), np.sqrt(squared.numpy().max(axis=1)), rtol=1e-12
    )
    k = round(0.05 * size * size)
    expected_top = np.sort(flat, axis=1)[:, -k:].mean(axis=1)
    np.testing.assert_allclose(image_scores(maps, "top_mean", top_fraction=0.05).numpy(), expected_top, rtol=1e-12)
    # the order the docstring states: smoothing averages grid values, a top mean averages map values
    assert (image_scores(maps, "patch_max", squared) >= image_scores(maps) - 1e-9).all()
    assert (image_scores(maps, "top_mean") <= image_scores(maps)).all()
    # the smallest share still averages one pixel: the maximum
    torch.testing.assert_close(image_scores(maps, "top_mean", top_fraction=1e-9), image_scores(maps))


def test_image_scores_refuse_an_unknown_method_or_a_missing_grid():
    maps = torch.rand(2, 8, 8)
    with pytest.raises(ValueError, match="map_max, patch_max, top_mean"):
        image_scores(maps, "mean")
    with pytest.raises(ValueError, match="squared distances"):
        image_scores(maps, "patch_max")
