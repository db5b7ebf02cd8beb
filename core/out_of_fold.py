"""Out-of-fold distances from the fitted model's Cholesky factor, without fitting any fold model.

Calibration scores every training image with the model of "every image but its fold"
(:mod:`padim.core.calibration`). Fitting that model for each fold costs a Cholesky
factorisation of every pixel's ``(D, D)`` matrix per fold. It is not needed: removing a fold
of ``m`` images from the comoment ``C`` of ``n`` images is a rank-``m + 1`` downdate

    ``C_rest = C - U U^T``,  ``U = [x_1 - mu_f, ..., x_m - mu_f, k (mu_f - mu_rest)]``,
    ``k = sqrt(n_rest m / n)``

(the fold's centred embeddings and one column for the shift of the mean), and with the
regulariser defined on the comoment (:mod:`padim.core.statistics`: the model of ``n`` images is
``(C + lambda I) / (n - 1)``, the same ``lambda`` for every fold model) the Woodbury identity
gives the fold model's inverse from the fitted one's. With ``L L^T = (C + lambda I) / (n - 1)``
(the fitted model's Cholesky factor), ``Z = L^-1 U / sqrt(n - 1)`` and ``G = Z^T Z``, the
squared distance of the fold's image ``i`` under the fold model is

    ``d_i^2 = (n_rest - 1) a_i^T G (I - G)^-1 a_i``,  ``a_i = e_i + e_(m+1) / k``,

because ``x_i - mu_rest = U a_i``. Per pixel a fold costs one triangular solve with ``m + 1``
right-hand sides (``D^2 (m + 1)``) and an ``(m + 1) x (m + 1)`` Cholesky, against
``2 D^3 / 3`` for a refit. The correction cancels strongly when the fold spans directions the
rest of the images do not (``I - G`` nearly singular), so it runs in float64: in float32 it
lost 3e-4 relative at ``D = 100``. Folds with ``m + 1`` comparable to ``D`` are cheaper to refit
from the downdated matrix; :func:`out_of_fold_squared_distances` does so by itself.

Example (every fold of two images, against a brute-force refit with the same lambda):
    >>> import torch
    >>> from padim.core.statistics import batch_state, cholesky_slice, covariance, regularised_cholesky
    >>> x = torch.randn(12, 3, 5, dtype=torch.float64)                  # (N, P, D)
    >>> full = batch_state(x)
    >>> L = cholesky_slice(full, 0, 3, epsilon=0.1)
    >>> ours = out_of_fold_squared_distances(L, full.mean, 12, x, [2] * 6, epsilon=0.1)
    >>> rest = batch_state(x[2:])                                        # without the first fold
    >>> eps = 0.1 * (12 - 1) / (10 - 1)                                  # the same lambda
    >>> Lr = regularised_cholesky(covariance(rest), eps)
    >>> y = torch.linalg.solve_triangular(Lr, (x[:2] - rest.mean).permute(1, 2, 0), upper=False)
    >>> torch.allclose(ours[:2], y.square().sum(1).T)
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .statistics import NotPositiveDefiniteError, regulariser

#: A fold is refitted instead of corrected when its correction would cost more than this share
#: of a refit (both counted in multiply-adds per pixel).
REFIT_WHEN_CHEAPER_BY = 1.0


def held_out_squared_distances(cholesky: torch.Tensor, mean: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """Squared distances of images the model has not seen, in float64.

    Args:
        cholesky: ``(c, D, D)`` lower ``L`` of the model's covariance, float64.
        mean: ``(c, D)`` its mean.
        embeddings: ``(R, c, D)``, any float dtype.

    Returns:
        ``(R, c)`` ``||L^-1 (x - mu)||^2``.
    """
    delta = (embeddings.to(cholesky.dtype) - mean.to(cholesky.dtype)).permute(1, 2, 0)  # (c, D, R)
    whitened = torch.linalg.solve_triangular(cholesky, delta, upper=False)
    return whitened.square().sum(dim=1).T


def out_of_fold_squared_distances(cholesky: torch.Tensor, mean: torch.Tensor, count: int, embeddings: torch.Tensor,
                                  fold_sizes: Sequence[int], epsilon: float, pixel_offset: int = 0) -> torch.Tensor:
    """Squared distance of every image under the model of every image outside its fold.

    Args:
        cholesky: ``(c, D, D)`` lower ``L`` of the fitted model, ``L L^T = C / (n - 1) + epsilon I``,
            float64 (see :func:`padim.core.statistics.cholesky_slice`).
        mean: ``(c, D)`` the fitted mean of all ``n`` images.
        count: ``n``, the images the model was fitted on.
        embeddings: ``(R, c, D)`` images of whole folds, one fold after another, any float dtype.
        fold_sizes: images per fold, in order; they add up to ``R``. A fold's model must keep
            at least two images (``n - m >= 2``).
        epsilon: the fitted model's regularisation; every fold model keeps its ``lambda``.
        pixel_offset: index of the first pixel in the whole grid, to name one in an error.

    Returns:
        ``(R, c)`` float64.

    Raises:
        NotPositiveDefiniteError: a fold model that is not positive definite (``epsilon = 0``
            with fewer images outside the fold than channels).
        ValueError: sizes that do not add up, or a fold that leaves fewer than two images.
    """
    pixels, dim = mean.shape
    n = int(count)
    sizes = [int(m) for m in fold_sizes]
    if sum(sizes) != embeddings.shape[0] or any(m < 1 or n - m < 2 for m in sizes):
        raise ValueError(f"fold sizes {sizes} do not split {embeddings.shape[0]} images of a model of {n} "
                         "into folds that leave at least two images each")
    dtype = cholesky.dtype
    x = embeddings.to(dtype).transpose(0, 1)  # (c, R, D)
    mean = mean.to(dtype)
    lam = regulariser(n, epsilon)
    out = torch.empty(pixels, x.shape[1], dtype=dtype, device=x.device)  # (c, R)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    by_size: dict[int, list[int]] = {}
    for k, m in enumerate(sizes):
        by_size.setdefault(m, []).append(k)
    for m, folds in by_size.items():
        rows = torch.tensor([starts[k] + i for k in folds for i in range(m)], device=x.device)
        members = x.index_select(1, rows).view(pixels, len(folds), m, dim)  # (c, F, m, D)
        if _refit_is_cheaper(m, dim):
            values = _refit(cholesky, mean, n, members, lam, pixel_offset)
        else:
            values = _woodbury(cholesky, mean, n, members, pixel_offset)
        out.index_copy_(1, rows, values.reshape(pixels, -1))
    return out.T


def _columns(mean: torch.Tensor, n: int, members: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
    """``U`` of every fold as rows ``(c, F, m + 1, D)``, ``k``, and ``mu_rest`` ``(c, F, D)``."""
    m = members.shape[2]
    fold_mean = members.mean(dim=2)  # (c, F, D)
    rest_mean = (n * mean.unsqueeze(1) - m * fold_mean) / (n - m)
    k = math.sqrt((n - m) * m / n)
    u = torch.cat([members - fold_mean.unsqueeze(2), (k * (fold_mean - rest_mean)).unsqueeze(2)], dim=2)
    return u, k, rest_mean


def _woodbury(cholesky, mean, n, members, pixel_offset) -> torch.Tensor:
    """``(c, F, m)`` distances by the rank-``m + 1`` correction (module docstring)."""
    pixels, folds, m, dim = members.shape
    u, k, _ = _columns(mean, n, members)  # (c, F, m + 1, D)
    z = torch.linalg.solve_triangular(cholesky, u.reshape(pixels, -1, dim).transpose(1, 2), upper=False)
    z = z.transpose(1, 2).reshape(pixels, folds, m + 1, dim) / math.sqrt(n - 1)  # rows: (L^-1 u_j)^T / sqrt(n-1)
    gram = z @ z.transpose(2, 3)  # (c, F, m + 1, m + 1) G
    eye = torch.eye(m + 1, dtype=gram.dtype, device=gram.device)
    factor, info = torch.linalg.cholesky_ex(eye - gram)  # I - G is positive definite iff the fold model is
    _raise_if_not_positive(info, pixel_offset)
    a = torch.cat([torch.eye(m, dtype=gram.dtype, device=gram.device),
                   torch.full((1, m), 1.0 / k, dtype=gram.dtype, device=gram.device)])  # (m + 1, m): a_i as columns
    solved = torch.cholesky_solve(a.expand(pixels, folds, m + 1, m), factor)  # (I - G)^-1 a_i
    return (n - m - 1) * ((gram @ a) * solved).sum(dim=2)  # a_i^T G (I - G)^-1 a_i


def _refit(cholesky, mean, n, members, lam, pixel_offset) -> torch.Tensor:
    """``(c, F, m)`` distances from the downdated matrix itself, factorised again (large folds)."""
    pixels, folds, m, dim = members.shape
    u, _, rest_mean = _columns(mean, n, members)
    scaled = cholesky @ cholesky.transpose(1, 2) * (n - 1)  # C + lambda I, (c, D, D)
    values = []
    for f in range(folds):
        rest = (scaled - u[:, f].transpose(1, 2) @ u[:, f]) / (n - m - 1)  # (C_rest + lambda I) / (n_rest - 1)
        factor, info = torch.linalg.cholesky_ex(rest)
        _raise_if_not_positive(info, pixel_offset)
        delta = (members[:, f] - rest_mean[:, f].unsqueeze(1)).transpose(1, 2)  # (c, D, m)
        values.append(torch.linalg.solve_triangular(factor, delta, upper=False).square().sum(dim=1))
    return torch.stack(values, dim=1)


def _refit_is_cheaper(m: int, dim: int) -> bool:
    woodbury = dim * (m + 1) ** 2 + (m + 1) ** 3 / 3 + (m + 1) ** 2 * m
    refit = dim ** 3 + dim ** 2 * (m + 1) + dim ** 3 / 3  # L L^T, U U^T, Cholesky (the solves cost both the same)
    return woodbury > REFIT_WHEN_CHEAPER_BY * refit


def _raise_if_not_positive(info: torch.Tensor, pixel_offset: int) -> None:
    bad = torch.nonzero(info.reshape(info.shape[0], -1).amax(dim=1)).flatten()
    if bad.numel():
        raise NotPositiveDefiniteError(
            f"the model without one calibration fold is not positive definite at pixel {int(bad[0]) + pixel_offset}: "
            "too few images outside the fold for the embedding size; raise epsilon (e.g. --epsilon 0.01) or add images")
