"""Out-of-fold distances from the full model's factor against brute-force refits (numpy float64)."""

import numpy as np
import pytest
import torch

from padim.core.out_of_fold import (
    fold_and_copy_squared_distances,
    fold_base,
    held_out_squared_distances,
    out_of_fold_squared_distances,
    refit_is_cheaper,
)
from padim.core.statistics import NotPositiveDefiniteError, Shrinkage, batch_state, cholesky_slice, covariance


def refit_distances(
    x: np.ndarray,
    sizes: list[int],
    epsilon: float,
    copies: np.ndarray | None = None,
    shrinkage: float = 0.0,
    target: np.ndarray | None = None,
) -> np.ndarray:
    """Each fold's images (or their changed ``copies``, row for row) under a model fitted from scratch on the other
    images, with the same epsilon.

    The fold model of n_rest images is np.cov of them plus epsilon I, as the fitted model of all n is; with
    ``shrinkage``, ``(1 - w) np.cov + w target + epsilon I``, ``target`` the fitted model's pooled covariance.
    """
    scored = x if copies is None else copies
    n, pixels, dim = x.shape
    out = np.empty((n, pixels))
    start = 0
    for m in sizes:
        fold = slice(start, start + m)
        rest = np.delete(x, np.arange(start, start + m), axis=0)
        for p in range(pixels):
            mean = rest[:, p].mean(axis=0)
            centred = rest[:, p] - mean
            cov = centred.T @ centred / (len(rest) - 1) + epsilon * np.eye(dim)
            if shrinkage:
                cov = (1 - shrinkage) * (cov - epsilon * np.eye(dim)) + shrinkage * target + epsilon * np.eye(dim)
            delta = scored[fold, p] - mean
            out[fold, p] = np.einsum("id,de,ie->i", delta, np.linalg.inv(cov), delta)
        start += m
    return out


def ours(
    x: np.ndarray,
    sizes: list[int],
    epsilon: float,
    slices: int = 2,
    copies: np.ndarray | None = None,
    shrinkage: float = 0.0,
) -> np.ndarray:
    """The same distances from the full model's Cholesky factor, a slice of pixels at a time."""
    tensor = torch.from_numpy(x)
    state = batch_state(tensor)
    regulariser = Shrinkage.of(state, epsilon, shrinkage) if shrinkage else epsilon
    pixels = x.shape[1]
    parts = []
    for start in range(0, pixels, -(-pixels // slices)):
        stop = min(start + -(-pixels // slices), pixels)
        parts.append(
            out_of_fold_squared_distances(
                covariance(state, start, stop),
                state.mean[start:stop],
                len(x),
                tensor[:, start:stop],
                sizes,
                regulariser,
                pixel_offset=start,
                copies=None if copies is None else torch.from_numpy(copies[:, start:stop]),
            )
        )
    return torch.cat(parts, dim=1).numpy()


@pytest.mark.parametrize(
    "n, dim, sizes",
    [
        (30, 6, [5, 6, 3, 7, 4, 5]),  # uneven folds, more images than channels
        (12, 20, [3, 2, 4, 3]),  # fewer images than channels: PaDiM's usual case
        (9, 5, [1] * 9),  # leave-one-out
        (40, 4, [30, 10]),  # a fold as large as the embedding: refitted
    ],
)
def test_out_of_fold_equals_same_epsilon_refit_in_float64(n, dim, sizes):
    rng = np.random.default_rng(n + dim)
    x = rng.normal(size=(n, 3, dim)) @ rng.normal(size=(dim, dim)) + rng.normal(size=(1, 3, dim)) * 5
    expected = refit_distances(x, sizes, epsilon=0.01)
    np.testing.assert_allclose(ours(x, sizes, epsilon=0.01), expected, rtol=1e-9, atol=0)


@pytest.mark.parametrize(
    "n, dim, sizes",
    [
        (9, 5, [1] * 9),  # leave-one-out: Sherman-Morrison
        (12, 20, [1] * 12),  # leave-one-out, fewer images than channels
        (30, 6, [5, 6, 3, 7, 4, 5]),  # K folds: the query form of the Woodbury correction
        (12, 20, [3, 2, 4, 3]),
        (40, 4, [30, 10]),  # refitted, scoring the copies
    ],
)
def test_changed_copies_are_scored_as_by_a_refit_without_their_original(n, dim, sizes):
    """``train --expect``: the copy of an image, under the model of every image but the original's fold."""
    rng = np.random.default_rng(n * dim)
    x = rng.normal(size=(n, 3, dim)) @ rng.normal(size=(dim, dim)) + rng.normal(size=(1, 3, dim)) * 5
    copies = x * rng.uniform(0.9, 1.1, size=(n, 1, 1)) + rng.normal(scale=0.3, size=x.shape)  # light, noise
    expected = refit_distances(x, sizes, epsilon=0.01, copies=copies)
    np.testing.assert_allclose(ours(x, sizes, epsilon=0.01, copies=copies), expected, rtol=1e-9, atol=0)
    # a copy that is the image itself gives the image's own out-of-fold distance
    np.testing.assert_allclose(
        ours(x, sizes, epsilon=0.01, copies=x.copy()), ours(x, sizes, epsilon=0.01), rtol=1e-10, atol=0
    )


@pytest.mark.parametrize("n, dim, m", [(30, 6, 5), (12, 20, 3), (24, 40, 4), (9, 5, 1)])
def test_single_copies_are_scored_in_float32_within_its_rounding_beside_float64_ones(n, dim, m):
    """The int8 scorer's rows (``single``): ``s`` and ``h`` in float32 by the base's inverse, against refits; the
    members' distances and the float64 copies' as without them (leave-one-out scores them all in float64)."""
    rng = np.random.default_rng(n + dim + m)
    x = rng.normal(size=(n, 3, dim)) @ rng.normal(size=(dim, dim)) + rng.normal(size=(1, 3, dim)) * 5
    copies = x * rng.uniform(0.9, 1.1, size=(n, 1, 1)) + rng.normal(scale=0.3, size=x.shape)
    queries = x + rng.normal(scale=0.1, size=x.shape)  # another backbone's rows of the same pictures
    state = batch_state(torch.from_numpy(x))
    base = fold_base(covariance(state), n, m, 0.01)

    def folded(rows: np.ndarray) -> torch.Tensor:  # (N, c, D) -> (c, F, m, D)
        return torch.from_numpy(rows).reshape(n // m, m, 3, dim).permute(2, 0, 1, 3).contiguous()

    def unfolded(found: torch.Tensor) -> np.ndarray:  # (c, F, m) -> (N, c)
        return found.permute(1, 2, 0).reshape(n, 3).numpy()

    members = folded(x)
    own, alone = fold_and_copy_squared_distances(base, state.mean, n, members, folded(copies))
    both_own, both = fold_and_copy_squared_distances(
        base, state.mean, n, members, folded(copies), single=folded(queries).float()
    )
    assert both.dtype == torch.float64 and both.shape[2] == 2 * m
    assert torch.equal(both_own, own) and torch.equal(both[:, :, :m], alone)
    expected = refit_distances(x, [m] * (n // m), epsilon=0.01, copies=queries.astype(np.float32).astype(np.float64))
    rtol = 1e-9 if m == 1 else 1e-5  # float32's rounding of s and h (measured: 1e-6 at D = 100)
    np.testing.assert_allclose(unfolded(both[:, :, m:]), expected, rtol=rtol, atol=0)
    _, without_copies = fold_and_copy_squared_distances(
        base, state.mean, n, members, None, single=folded(queries).float()
    )
    np.testing.assert_allclose(without_copies.numpy(), both[:, :, m:].numpy(), rtol=1e-12, atol=0)


def pooled_covariance(x: np.ndarray) -> np.ndarray:
    """The mean over pixels of each pixel's np.cov: the target of ``--shrinkage``."""
    return np.mean([np.cov(x[:, p], rowvar=False) for p in range(x.shape[1])], axis=0)


@pytest.mark.parametrize(
    "n, dim, sizes, weight",
    [
        (9, 5, [1] * 9, 0.5),  # leave-one-out: the closed form with the prior for epsilon I
        (12, 20, [1] * 12, 0.3),  # fewer images than channels
        (30, 6, [5, 6, 3, 7, 4, 5], 0.7),  # K folds: Woodbury
        (40, 4, [30, 10], 0.5),  # refitted
    ],
)
def test_shrunk_out_of_fold_equals_refits_that_keep_the_pooled_target(n, dim, sizes, weight):
    """``train --shrinkage``: each fold model is ``(1 - w) S_rest + w T + eps I`` with the fitted model's ``T``
    (the pooled covariance of every image: docs/calibration.md says what keeping it costs)."""
    rng = np.random.default_rng(n + dim + 1)
    x = rng.normal(size=(n, 4, dim)) @ rng.normal(size=(dim, dim)) + rng.normal(size=(1, 4, dim)) * 5
    target = pooled_covariance(x)
    expected = refit_distances(x, sizes, 0.01, shrinkage=weight, target=target)
    np.testing.assert_allclose(ours(x, sizes, 0.01, shrinkage=weight), expected, rtol=1e-9, atol=0)
    copies = x * rng.uniform(0.9, 1.1, size=(n, 1, 1)) + rng.normal(scale=0.3, size=x.shape)
    expected = refit_distances(x, sizes, 0.01, copies, shrinkage=weight, target=target)
    np.testing.assert_allclose(ours(x, sizes, 0.01, copies=copies, shrinkage=weight), expected, rtol=1e-9, atol=0)
    # and the shrunk model is another model: every distance moves
    assert (ours(x, sizes, 0.01, shrinkage=weight) != ours(x, sizes, 0.01)).all()


def test_large_folds_take_the_refit_and_small_ones_the_correction():
    assert refit_is_cheaper(30, 4, 1) and not refit_is_cheaper(5, 100, 4) and not refit_is_cheaper(1, 550, 40)


def test_leave_one_out_has_a_closed_form_in_the_distance_under_its_base():
    """With m = 1: d_loo^2 = (n - 2) n^2 q / ((n - 1)((n - 1)^2 - n q)), q the distance under the base B_1."""
    rng = np.random.default_rng(7)
    n, dim = 15, 8
    x = torch.from_numpy(rng.normal(size=(n, 2, dim)))
    state = batch_state(x)
    q = held_out_squared_distances(fold_base(covariance(state), n, 1, 0.05), state.mean, x).numpy()
    closed = (n - 2) * n**2 * q / ((n - 1) * ((n - 1) ** 2 - n * q))
    ours = out_of_fold_squared_distances(covariance(state), state.mean, n, x, [1] * n, 0.05).numpy()
    np.testing.assert_allclose(ours, closed, rtol=1e-10)
    np.testing.assert_allclose(ours, refit_distances(x.numpy(), [1] * n, 0.05), rtol=1e-9)


def test_held_out_distances_equal_numpy():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(20, 2, 4))
    state = batch_state(torch.from_numpy(x))
    factor = cholesky_slice(state, 0, 2, 0.01)
    new = rng.normal(size=(3, 2, 4))
    got = held_out_squared_distances(factor, state.mean, torch.from_numpy(new)).numpy()
    for p in range(2):
        cov = np.cov(x[:, p], rowvar=False) + 0.01 * np.eye(4)
        delta = new[:, p] - x[:, p].mean(axis=0)
        np.testing.assert_allclose(got[:, p], np.einsum("id,de,ie->i", delta, np.linalg.inv(cov), delta), rtol=1e-10)


def test_bad_fold_sizes_and_singular_fold_models_are_refused():
    x = torch.randn(6, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    state = batch_state(x)
    with pytest.raises(ValueError, match="do not split"):
        out_of_fold_squared_distances(covariance(state), state.mean, 6, x, [3, 2], 0.1)
    with pytest.raises(ValueError, match="at least two images"):
        out_of_fold_squared_distances(covariance(state), state.mean, 6, x[:5], [5], 0.1)
    # epsilon 0 and a channel no image varies in: the full model is singular. (Fewer images than channels alone is
    # singular too, but only in exact arithmetic: rounding can leave its last pivots a hair above zero, and a CI run
    # drew such a sample.) A constant channel's pivot is exactly zero on every machine.
    flat = x.clone()
    flat[:, :, 3] = 0.5
    with pytest.raises(NotPositiveDefiniteError):
        cholesky_slice(batch_state(flat), 0, 2, 0.0)
