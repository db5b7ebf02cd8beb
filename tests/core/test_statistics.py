"""Streaming statistics against one-shot numpy float64 references."""

import numpy as np
import pytest
import torch

from padim.core.packing import pack_lower, unpack_lower
from padim.core.statistics import (
    GaussianAccumulator,
    NotPositiveDefiniteError,
    PooledMoments,
    RowSums,
    Shrinkage,
    add_centred_products_,
    batch_state,
    covariance,
    finalise,
    mean_of,
    merge_comoment_,
    merge_states,
    merged_mean,
    pooled_comoment,
    precision,
    precision_factor,
    regularised_cholesky,
    update_state_,
)


def reference_moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-pixel mean (P, D) and unbiased covariance (P, D, D) of (N, P, D), float64."""
    x = x.astype(np.float64)
    mean = x.mean(axis=0)
    cov = np.stack([np.cov(x[:, p, :], rowvar=False) for p in range(x.shape[1])])
    return mean, cov


def stream(x: torch.Tensor, batch_size: int) -> GaussianAccumulator:
    acc = GaussianAccumulator()
    for start in range(0, x.shape[0], batch_size):
        acc.partial_fit(x[start : start + batch_size])
    return acc


@pytest.mark.parametrize("batch_size", [1, 7, 32])
def test_streaming_equals_one_shot_numpy(batch_size):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 6, 5)) @ rng.normal(size=(5, 5))  # correlated channels
    x = x.astype(np.float32)
    acc = stream(torch.from_numpy(x), batch_size)
    mean, cov = reference_moments(x)
    assert acc.count == 50
    np.testing.assert_allclose(acc.mean.numpy(), mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(acc.covariance().numpy(), cov, rtol=1e-10, atol=1e-12)


def test_uneven_batches_like_sklearn():
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.normal(size=(68, 3, 4)))
    acc = GaussianAccumulator()
    for chunk in torch.split(x, [11, 20, 37]):
        acc.partial_fit(chunk)
    mean, cov = reference_moments(x.numpy())
    np.testing.assert_allclose(acc.covariance().numpy(), cov, rtol=1e-10)


def test_large_offset_stays_accurate():
    # mean 1e4, std 1: a naive sum-of-squares accumulator loses every digit here
    rng = np.random.default_rng(2)
    x = (1e4 + rng.normal(size=(400, 4, 3))).astype(np.float32)
    acc = stream(torch.from_numpy(x), 7)
    mean, cov = reference_moments(x)
    np.testing.assert_allclose(acc.mean.numpy(), mean, rtol=1e-6)
    np.testing.assert_allclose(acc.covariance().numpy(), cov, rtol=1e-6, atol=1e-6 * np.abs(cov).max())


def test_merge_equals_fit_on_union():
    rng = np.random.default_rng(3)
    a = torch.from_numpy(rng.normal(size=(13, 5, 4)))
    b = torch.from_numpy(rng.normal(loc=2.0, size=(29, 5, 4)))
    merged = merge_states(stream(a, 5).state, stream(b, 8).state)
    whole = stream(torch.cat([a, b]), 42).state
    assert int(merged.count) == 42
    torch.testing.assert_close(merged.mean, whole.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged.comoment, whole.comoment, rtol=1e-11, atol=1e-11)


def test_merge_leaves_inputs_unchanged_and_handles_empty():
    x = torch.randn(10, 2, 3, dtype=torch.float64)
    a = batch_state(x[:4])
    before = a.clone()
    merge_states(a, batch_state(x[4:]))
    torch.testing.assert_close(a.comoment, before.comoment)
    acc = GaussianAccumulator().merge(GaussianAccumulator(batch_state(x)))
    torch.testing.assert_close(acc.mean, x.mean(0))
    with pytest.raises(ValueError, match="cannot merge"):
        merge_states(a, batch_state(torch.randn(3, 2, 4)))


def test_covariance_needs_two_images():
    with pytest.raises(ValueError, match="at least 2 images"):
        covariance(batch_state(torch.randn(1, 2, 3)))


def random_spd(p: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(p, d, 2 * d, generator=g, dtype=torch.float64)
    return a @ a.transpose(1, 2) / (2 * d)


def test_precision_factor_and_precision_match_numpy_inverse():
    cov = random_spd(4, 6, 0)
    eps = 0.01
    inverse = np.linalg.inv(cov.numpy() + eps * np.eye(6))
    w = precision_factor(cov, eps)
    assert torch.all(w.triu(1) == 0), "W must be lower triangular"
    np.testing.assert_allclose((w.transpose(1, 2) @ w).numpy(), inverse, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(precision(cov, eps).numpy(), inverse, rtol=1e-9, atol=1e-9)


def test_not_positive_definite_names_the_pixel():
    cov = torch.eye(3, dtype=torch.float64).repeat(6, 1, 1)
    cov[4, 0, 0] = -1.0
    with pytest.raises(
        NotPositiveDefiniteError, match=r"pixel 4 \(row 2, column 0 of the 3x2 feature grid\).*raise epsilon"
    ):
        precision_factor(cov, epsilon=0.0, grid_shape=(3, 2))


def test_finalise_in_slices_equals_whole():
    cov_state = stream(torch.randn(30, 10, 4, dtype=torch.float64), 7).state
    mean, factor = finalise(cov_state, 0.01, dtype=torch.float64, chunk_pixels=3)
    torch.testing.assert_close(factor, precision_factor(covariance(cov_state), 0.01))
    torch.testing.assert_close(mean, cov_state.mean)
    cov_state.comoment[7] = pack_lower(-torch.eye(4, dtype=torch.float64)[None])[0]
    with pytest.raises(NotPositiveDefiniteError, match="pixel 7"):
        finalise(cov_state, 0.0, chunk_pixels=3)


def test_in_place_update_rejects_other_shapes():
    acc = GaussianAccumulator().partial_fit(torch.randn(3, 2, 4))
    with pytest.raises(ValueError, match="cannot add a batch"):
        acc.partial_fit(torch.randn(3, 2, 5))


@pytest.mark.parametrize("block_bytes", [0, 1, 10**9])
def test_held_batches_added_as_one_block_equal_batch_by_batch(block_bytes):
    """Holding batches until a block is full changes only how often the comoment is passed over."""
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.normal(loc=3.0, size=(41, 7, 6)).astype(np.float32))
    acc = GaussianAccumulator(block_bytes=block_bytes)
    for chunk in torch.split(x, [5, 16, 16, 4]):
        acc.partial_fit(chunk)
    mean, cov = reference_moments(x.numpy())
    assert acc.count == 41
    np.testing.assert_allclose(acc.mean.numpy(), mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(acc.covariance().numpy(), cov, rtol=1e-10, atol=1e-12)


def test_comoment_is_the_packed_lower_triangle_of_the_square():
    x = torch.randn(9, 3, 5, dtype=torch.float64)
    state = batch_state(x)
    centred = (x - x.mean(0)).permute(1, 0, 2)
    square = centred.transpose(1, 2) @ centred
    assert state.comoment.shape == (3, 15)
    torch.testing.assert_close(state.comoment, pack_lower(square))
    torch.testing.assert_close(unpack_lower(state.comoment, 5, symmetric=True), square)


@pytest.mark.parametrize("removed", [1, 3])
def test_downdate_equals_a_fit_without_the_rows(removed):
    """Removing rows leaves the statistics of the others (float64 numpy reference), whatever was added first."""
    from padim.core.statistics import downdate_state_

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(25, 6, 5, generator=generator, dtype=torch.float64) * 3 + 100  # a large offset too
    state = batch_state(x[:11])
    update_state_(state, x[11:])
    gone = [2, 17, 24][:removed]
    downdate_state_(state, x[gone])
    kept = np.delete(x.numpy(), gone, axis=0)
    assert int(state.count) == 25 - removed
    np.testing.assert_allclose(state.mean.numpy(), kept.mean(0), rtol=1e-12)
    reference = np.stack([np.cov(kept[:, p].T) for p in range(6)])
    np.testing.assert_allclose(covariance(state).numpy(), reference, rtol=1e-9, atol=1e-9)


def test_downdate_refuses_to_leave_fewer_than_two_rows_or_a_wrong_shape():
    from padim.core.statistics import downdate_state_

    x = torch.randn(3, 2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="fewer than 2"):
        downdate_state_(batch_state(x), x[:2])
    with pytest.raises(ValueError, match="cannot remove"):
        downdate_state_(batch_state(x), torch.zeros(1, 3, 2, dtype=torch.float64))


# ---------------------------------------------------------------- shrinkage toward the pooled covariance
def test_shrunk_cholesky_is_the_formula_against_numpy():
    """``Sigma_p = (1 - w) S_p + w T + eps I``, ``T`` the mean over pixels of every pixel's np.cov."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(25, 6, 4)) @ rng.normal(size=(4, 4)) + rng.normal(size=(1, 6, 4)) * 3
    state = batch_state(torch.from_numpy(x))
    covariances = np.stack([np.cov(x[:, p], rowvar=False) for p in range(6)])
    target = covariances.mean(axis=0)
    shrunk = Shrinkage.of(state, epsilon=0.05, weight=0.4)
    np.testing.assert_allclose(shrunk.target.numpy(), target, rtol=1e-12)
    cholesky = shrunk.cholesky(covariance(state)).numpy()
    expected = 0.6 * covariances + 0.4 * target + 0.05 * np.eye(4)
    np.testing.assert_allclose(cholesky @ cholesky.transpose(0, 2, 1), expected, rtol=1e-10)
    # the precision factors of finalise score as numpy's inverse does
    mean, factors = finalise(state, 0.05, dtype=torch.float64, shrinkage=0.4, chunk_pixels=4)
    delta = x[:3] - x.mean(axis=0)
    ours = np.square(np.einsum("pde,npe->npd", factors.numpy(), delta)).sum(-1)
    np.testing.assert_allclose(ours, np.einsum("npd,pde,npe->np", delta, np.linalg.inv(expected), delta), rtol=1e-9)


def test_no_shrinkage_is_the_paper_model_to_the_bit():
    x = torch.randn(12, 5, 3, dtype=torch.float64)
    state = batch_state(x)
    plain = regularised_cholesky(covariance(state), 0.01)
    assert torch.equal(Shrinkage.of(state, 0.01, 0.0).cholesky(covariance(state)), plain)
    assert torch.equal(finalise(state, 0.01, shrinkage=0.0)[1], finalise(state, 0.01)[1])
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        Shrinkage.of(state, 0.01, 1.0)


def test_the_pooled_target_streams_and_merges_like_the_statistics():
    """The pooled comoment is a sum of the per-pixel ones: batches of any size, and two merged accumulators, give
    the target of one fit, to float64's rounding (a merge sums in another order: an element near zero may differ by
    an ulp, which is a large relative difference, hence a tolerance in units of the target's scale)."""
    x = torch.randn(37, 8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 2 + 7
    one = Shrinkage.of(batch_state(x), 0.01, 0.5).target
    close = {"rtol": 1e-12, "atol": 1e-13 * float(one.abs().max())}
    streamed = GaussianAccumulator()
    for start, stop in ((0, 11), (11, 31), (31, 37)):
        streamed.partial_fit(x[start:stop])
    torch.testing.assert_close(Shrinkage.of(streamed.state, 0.01, 0.5).target, one, **close)
    a, b = GaussianAccumulator().fit([x[:20]]), GaussianAccumulator().fit([x[20:]])
    torch.testing.assert_close(Shrinkage.of(a.merge(b).state, 0.01, 0.5).target, one, **close)
    pooled = pooled_comoment(batch_state(x))
    torch.testing.assert_close(
        pooled, (covariance(batch_state(x)) * 36).sum(0), rtol=1e-12, atol=1e-13 * float(pooled.abs().max())
    )


@pytest.mark.parametrize("pictures", [12, 40, 150, 600])
def test_the_estimated_weight_is_the_oracle_weight_on_gaussian_pixels(pictures):
    """``--shrinkage auto`` against the oracle: the weight that, knowing each pixel's true covariance, minimises
    ``sum_p ||(1 - w) S_p + w T - Sigma_p||_F^2`` (``<S_p - Sigma_p, S_p - T> / ||S_p - T||^2`` summed), on pixels
    drawn from Gaussians of known, different covariances. Averaged over draws, within 0.03 of it."""
    generator = torch.Generator().manual_seed(pictures)
    pixels, dim, draws = 48, 6, 12
    base = torch.randn(dim, dim, dtype=torch.float64, generator=generator)
    base = base @ base.T / dim + torch.eye(dim, dtype=torch.float64)
    estimated, oracle = [], []
    for _ in range(draws):
        spread = torch.randn(pixels, dim, dim, dtype=torch.float64, generator=generator) * 0.3
        sigma = base + spread @ spread.mT  # (P, D, D) each pixel's own covariance
        noise = torch.randn(pixels, dim, pictures, dtype=torch.float64, generator=generator)
        x = (torch.linalg.cholesky(sigma) @ noise).permute(2, 0, 1)  # (N, P, D)
        state = batch_state(x)
        estimated.append(PooledMoments.of(state, chunk_pixels=10).intensity(pictures))
        sample = torch.from_numpy(np.stack([np.cov(x[:, p].numpy(), rowvar=False) for p in range(pixels)]))
        target = sample.mean(0)
        oracle.append(float(((sample - sigma) * (sample - target)).sum() / (sample - target).square().sum()))
    assert abs(np.mean(estimated) - np.mean(oracle)) < 0.03, (np.mean(estimated), np.mean(oracle))
    # and the model it gives is the fixed weight's model with that weight
    state = batch_state(x)
    auto = Shrinkage.of(state, 0.01, "auto")
    fixed = Shrinkage.of(state, 0.01, auto.weight)
    torch.testing.assert_close(auto.cholesky(covariance(state)), fixed.cholesky(covariance(state)))


def test_the_estimated_weight_falls_as_pictures_come_and_is_bounded():
    """More pictures, less shrinkage; pixels identical to the pool ask for the most (0.95); two pictures, none."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(800, 20, 5, dtype=torch.float64, generator=generator) * torch.linspace(0.5, 3, 20)[:, None]
    weights = [PooledMoments.of(batch_state(x[:n])).intensity(n) for n in (20, 80, 800)]
    assert 0.95 >= weights[0] > weights[1] > weights[2] > 0, weights
    same = torch.randn(30, 1, 4, dtype=torch.float64, generator=generator).expand(30, 6, 4)
    assert PooledMoments.of(batch_state(same.contiguous())).intensity(30) == 0.95
    assert PooledMoments.of(batch_state(x[:2])).intensity(2) == 0.0
    # streamed a slice at a time, the moments are those of one pass
    whole = PooledMoments.empty(5).add_(covariance(batch_state(x)))
    sliced = PooledMoments.of(batch_state(x), chunk_pixels=3)
    torch.testing.assert_close(sliced.total, whole.total)
    assert sliced.squares == pytest.approx(whole.squares, rel=1e-12)
    assert sliced.trace_squares == pytest.approx(whole.trace_squares, rel=1e-12)


def test_heavy_tails_ask_for_more_shrinkage_as_ledoit_and_wolf_read_them():
    """The tails factor against Ledoit and Wolf's own estimate of each pixel's sampling variance, computed brute
    force from every picture's outer product (``sum_k ||x_k x_k^T - S||^2 / n^2``): Gaussian pictures vary as a
    Gaussian's covariance does (about 1), pictures with a random scale each (heavy tails) more, and so get a larger
    weight than the Gaussian formula gives."""
    generator = torch.Generator().manual_seed(7)
    pictures, pixels, dim = 200, 12, 5
    gaussian = torch.randn(pictures, pixels, dim, dtype=torch.float64, generator=generator)
    scales = torch.exp(torch.randn(pictures, pixels, 1, dtype=torch.float64, generator=generator))
    for x, low, high in ((gaussian, 0.8, 1.25), (gaussian * scales, 2.0, 50.0)):
        state = batch_state(x)
        centred = x - x.mean(0)
        moments = PooledMoments.of(state).add_tails_(
            centred.square().sum(-1).square().sum(0), covariance(state) * (pictures - 1), pictures
        )
        assert low < moments.tails < high, moments.tails
        biased = covariance(state) * (pictures - 1) / pictures
        outer = centred.unsqueeze(-1) * centred.unsqueeze(-2)  # (N, P, D, D)
        brute = float((outer - biased).square().sum()) / pictures**2
        assert moments.fourth == pytest.approx(brute, rel=1e-9)
    assert moments.intensity(pictures) > moments.intensity(pictures, tails=1.0)


def test_two_passes_over_a_spool_give_the_statistics_of_one_accumulator():
    """A spooled fit's arithmetic (pass 1's sums, the finish's centred products a block at a time, Chan's merge with
    earlier statistics on an unpacked slice) against NumPy's moments of every row and the packed merge_states."""
    gen = torch.Generator().manual_seed(7)
    earlier = torch.randn(9, 5, 4, generator=gen, dtype=torch.float64) * 2 + 1
    spooled = torch.randn(13, 5, 4, generator=gen, dtype=torch.float64) - 0.5
    sums = RowSums()
    for block in spooled.split(4):
        sums.add_(block.float())  # the spool holds float32 rows; the sums are float64
    rows32 = spooled.float().double()
    assert sums.count == 13
    mean = mean_of(sums.sum_or_zeros(5, 4, "cpu"), sums.count)
    torch.testing.assert_close(mean, rows32.mean(0), rtol=0, atol=1e-12)
    square = torch.full((5, 4, 4), float("nan"), dtype=torch.float64)  # written over by the first block
    fourth = torch.zeros(5, dtype=torch.float64)
    for i, block in enumerate(spooled.float().split(5)):
        add_centred_products_(square, block, mean, first=i == 0, fourth=fourth)
    centred = (rows32 - rows32.mean(0)).numpy()
    np.testing.assert_allclose(square.numpy(), np.einsum("npi,npj->pij", centred, centred), rtol=1e-10)
    np.testing.assert_allclose(fourth.numpy(), (np.square(centred).sum(-1) ** 2).sum(0), rtol=1e-10)
    base = batch_state(earlier)
    merge_comoment_(square, mean, 13, unpack_lower(base.comoment, 4, symmetric=True), base.mean, 9)
    together = torch.cat([earlier, rows32]).numpy()
    reference_mean, reference_cov = reference_moments(together)
    np.testing.assert_allclose(square.numpy() / (22 - 1), reference_cov, rtol=1e-10)
    np.testing.assert_allclose(merged_mean(base.mean, 9, mean, 13).numpy(), reference_mean, rtol=1e-12, atol=1e-12)
    packed = merge_states(base, batch_state(rows32))
    torch.testing.assert_close(pack_lower(square), packed.comoment, rtol=1e-12, atol=1e-10)
    assert RowSums().sum_or_zeros(5, 4, "cpu").eq(0).all() and mean_of(torch.zeros(5, 4), 0).eq(0).all()
