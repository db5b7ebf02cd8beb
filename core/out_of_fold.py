"""Out-of-fold distances without fitting any fold model: a rank-``m + 1`` correction per fold.

Calibration scores every training image with the model of "every image but its fold"
(:mod:`padim.core.calibration`): the model of the ``n_k = n - m`` other images, with the
fitted model's regularisation ``epsilon`` (``Sigma_k = C_k / (n_k - 1) + epsilon I``). Fitting
it costs a downdate of the ``(D, D)`` comoment and a Cholesky factorisation per pixel per fold,
and embedding the fold again. Neither is needed. Removing a fold of ``m`` images from the
comoment ``C`` of ``n`` images is a rank-``m + 1`` downdate

    ``C_k = C - U U^T``,  ``U = [x_1 - mu_f, ..., x_m - mu_f, k (mu_f - mu_k)]``,
    ``k = sqrt(n_k m / n)``

(the fold's centred embeddings and one column for the shift of the mean). With the *base*
``B_m = C + epsilon (n_k - 1) I`` (so that ``B_m - U U^T = (n_k - 1) Sigma_k``), its Cholesky
factor ``L_m L_m^T = B_m / (n - 1)``, ``Z = L_m^-1 U / sqrt(n - 1)`` and ``G = Z^T Z``, the
Woodbury identity gives the squared distance of the fold's image ``i`` under the fold model:

    ``d_i^2 = (n_k - 1) a_i^T G (I - G)^-1 a_i``,  ``a_i = e_i + e_(m+1) / k``,

because ``x_i - mu_k = U a_i``. ``B_m`` depends on the fold only through its size, so one
Cholesky factorisation per distinct fold size serves every fold of that size (one, for
leave-one-out, where the correction is a closed form in ``q = ||L_1^-1 (x - mu)||^2``:
``d^2 = (n - 2) n^2 q / ((n - 1) ((n - 1)^2 - n q))``). Per pixel a fold then costs one triangular solve
with ``m + 1`` right-hand sides (``D^2 (m + 1)``) and an ``(m + 1) x (m + 1)`` Cholesky, against a downdate and a
factorisation (``D^3 / 3``) for a refit. The correction cancels strongly when the fold spans
directions the other images do not (``I - G`` nearly singular), so it runs in float64: in
float32 it lost 3e-4 relative at ``D = 100``. Folds with ``m + 1`` comparable to ``D`` are
cheaper to refit from the downdated matrix; :func:`out_of_fold_squared_distances` does so by
itself.

**Changed copies** (``train --expect``). A copy ``y`` of a fold's image (the same picture after a
small change of the line: light, placement, focus) is not a column of ``U``, so its distance
under the fold model takes the *query* form of the same identity: with ``r = y - mu_k``,
``s = L_m^-1 r / sqrt(n - 1)`` and ``h = Z^T s``,

    ``d^2 = (n_k - 1) (||s||^2 + h^T (I - G)^-1 h)``,

which at ``y = x_i`` (``r = U a_i``) is the distance above. For leave-one-out it is a closed form
(Sherman-Morrison): with ``v = x - mu``, ``w = y - mu + v / (n - 1)``, ``a = L_1^-1 w``,
``b = L_1^-1 v`` (``L_1`` as above), ``A = ||a||^2``, ``P = a.b``, ``q = ||b||^2``:
``d^2 = (n - 2) / (n - 1) (A + n P^2 / ((n - 1)^2 - n q))``.

Why not one ``B`` for every fold (the fitted model's ``C + epsilon (n - 1) I``)? Its fold
models would carry ``epsilon (n - 1) / (n_k - 1)``, up to 12% more than the fitted model at 10
images, and with fewer images than channels a distance scales as ``1 / epsilon``: measured on
``benchmarks/calibration.py``, such scores ran low and the threshold flagged 4.1% of unseen
normal images at 10 training images for a requested 1% (0.8% with the fitted ``epsilon``).

Example (every fold of two images, against a brute-force refit):
    >>> import torch
    >>> from padim.core.statistics import batch_state, covariance, regularised_cholesky
    >>> x = torch.randn(12, 3, 5, dtype=torch.float64)                  # (N, P, D)
    >>> full = batch_state(x)
    >>> ours = out_of_fold_squared_distances(covariance(full), full.mean, 12, x, [2] * 6, epsilon=0.1)
    >>> rest = batch_state(x[2:])                                        # without the first fold
    >>> Lr = regularised_cholesky(covariance(rest), 0.1)
    >>> y = torch.linalg.solve_triangular(Lr, (x[:2] - rest.mean).permute(1, 2, 0), upper=False)
    >>> torch.allclose(ours[:2], y.square().sum(1).T)
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .statistics import NotPositiveDefiniteError, Shrinkage, regularised_cholesky

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
    return squared_norm(whitened, 1).T


def out_of_fold_squared_distances(
    covariance: torch.Tensor,
    mean: torch.Tensor,
    count: int,
    embeddings: torch.Tensor,
    fold_sizes: Sequence[int],
    epsilon: float | torch.Tensor | Shrinkage,
    pixel_offset: int = 0,
    grid_shape: tuple[int, int] | None = None,
    copies: torch.Tensor | None = None,
) -> torch.Tensor:
    """Squared distance of every image (or of its changed copy) under the model of every image outside its fold.

    Groups the folds by size and calls :func:`fold_base` and :func:`fold_squared_distances` (or
    :func:`refit_squared_distances`, where that is cheaper) once per size.

    Args:
        covariance: ``(c, D, D)`` ``C / (n - 1)`` of the fitted model (unregularised), float64.
        mean: ``(c, D)`` the fitted mean of all ``n`` images.
        count: ``n``, the images the model was fitted on.
        embeddings: ``(R, c, D)`` images of whole folds, one fold after another, any float dtype.
        fold_sizes: images per fold, in order; they add up to ``R``. A fold's model must keep
            at least two images (``n - m >= 2``).
        epsilon: the regularisation of the fitted model, and of every fold model; or its :class:`Shrinkage`
            (every fold model then keeps the fitted model's pooled target).
        pixel_offset, grid_shape: where ``covariance[0]`` is in the grid, to name a pixel in an error.
        copies: ``(R, c, D)`` a changed copy of every image, row for row: their distances are returned instead,
            each under the model without its original's fold (the statistics stay the images').

    Returns:
        ``(R, c)`` float64.

    Raises:
        NotPositiveDefiniteError: a fold model that is not positive definite (``epsilon = 0``
            with fewer images outside the fold than channels).
        ValueError: sizes that do not add up, or a fold that leaves fewer than two images.
    """
    if isinstance(epsilon, Shrinkage):  # (1 - lambda) times the model with the prior for epsilon I
        shrunk = epsilon.to(covariance.device)
        plain = out_of_fold_squared_distances(
            covariance, mean, count, embeddings, fold_sizes, shrunk.prior, pixel_offset, grid_shape, copies
        )
        return shrunk.unscaled(plain)
    pixels, dim = mean.shape
    n = int(count)
    sizes = [int(m) for m in fold_sizes]
    if sum(sizes) != embeddings.shape[0] or any(m < 1 or n - m < 2 for m in sizes):
        raise ValueError(
            f"fold sizes {sizes} do not split {embeddings.shape[0]} images of a model of {n} "
            "into folds that leave at least two images each"
        )
    x = embeddings.to(covariance.dtype).transpose(0, 1)  # (c, R, D)
    y = None if copies is None else copies.to(covariance.dtype).transpose(0, 1)
    out = torch.empty(pixels, x.shape[1], dtype=covariance.dtype, device=x.device)  # (c, R)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    by_size: dict[int, list[int]] = {}
    for k, m in enumerate(sizes):
        by_size.setdefault(m, []).append(k)
    for m, folds in by_size.items():
        rows = torch.tensor([starts[k] + i for k in folds for i in range(m)], device=x.device)
        members = x.index_select(1, rows).view(pixels, len(folds), m, dim)  # (c, F, m, D)
        queries = None if y is None else y.index_select(1, rows).view(pixels, len(folds), m, dim)
        if refit_is_cheaper(m, dim, len(folds)):
            values = refit_squared_distances(covariance, mean, n, members, epsilon, pixel_offset, grid_shape, queries)
        else:
            base = fold_base(covariance, n, m, epsilon, pixel_offset, grid_shape)
            values = (
                fold_squared_distances(base, mean, n, members, pixel_offset)
                if queries is None
                else fold_copy_squared_distances(base, mean, n, members, queries, pixel_offset)
            )
        out.index_copy_(1, rows, values.reshape(pixels, -1))
    return out.T


def fold_base(
    covariance: torch.Tensor,
    count: int,
    size: int,
    epsilon: float | torch.Tensor,
    pixel_offset: int = 0,
    grid_shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``L_m``, ``L_m L_m^T = B_m / (n - 1)``: the base of every fold of ``size`` images, ``(c, D, D)``.

    ``epsilon`` may be a ``(D, D)`` matrix ``R`` (a :attr:`~padim.core.statistics.Shrinkage.prior`): every
    formula here holds with ``epsilon I`` replaced by a fixed symmetric matrix."""
    return regularised_cholesky(covariance, epsilon * (count - size - 1) / (count - 1), grid_shape, pixel_offset)


def fold_squared_distances(
    base: torch.Tensor, mean: torch.Tensor, count: int, members: torch.Tensor, pixel_offset: int = 0
) -> torch.Tensor:
    """Distances of folds of ``m`` images under their fold models, by the rank-``m + 1`` correction.

    Args:
        base: :func:`fold_base` for this fold size.
        mean: ``(c, D)`` the fitted mean of all ``n = count`` images.
        members: ``(c, F, m, D)`` float64: ``F`` folds of ``m`` images each.

    Returns:
        ``(c, F, m)`` float64.
    """
    pixels, folds, m, dim = members.shape
    n = int(count)
    if m == 1:  # leave-one-out: U's first column is zero, and the correction has a closed form
        q = held_out_squared_distances(base, mean, members[:, :, 0].transpose(0, 1)).T  # (c, F) under B_1
        room = (n - 1) ** 2 - n * q  # (n - 1)^2 (1 - g): positive iff the fold model is positive definite
        _raise_if_not_positive((room <= 0).to(torch.int32), pixel_offset)
        return ((n - 2) * n**2 * q / ((n - 1) * room)).unsqueeze(2)
    z, _, k = _solved_columns(base, mean, n, members)  # rows: (L_m^-1 u_j)^T / sqrt(n - 1)
    return _members_distances(z, n, k, pixel_offset)[0]


def fold_copy_squared_distances(
    base: torch.Tensor,
    mean: torch.Tensor,
    count: int,
    members: torch.Tensor,
    copies: torch.Tensor,
    pixel_offset: int = 0,
) -> torch.Tensor:
    """Distances of changed copies of folds' images under their fold models (the query form, module docstring).

    Args:
        base: :func:`fold_base` for this fold size.
        mean: ``(c, D)`` the fitted mean of all ``n = count`` images.
        members: ``(c, F, m, D)`` float64: ``F`` folds of ``m`` images each (the fitted images).
        copies: ``(c, F, q, D)``: ``q`` changed copies of each fold's images (not fitted), any float dtype.

    Returns:
        ``(c, F, q)`` float64.
    """
    return fold_and_copy_squared_distances(base, mean, count, members, copies, pixel_offset)[1]


def fold_and_copy_squared_distances(
    base: torch.Tensor,
    mean: torch.Tensor,
    count: int,
    members: torch.Tensor,
    copies: torch.Tensor | None,
    pixel_offset: int = 0,
    single: torch.Tensor | None = None,
    inverse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fold_squared_distances` of the members and :func:`fold_copy_squared_distances` of the copies at once:
    one triangular solve of the fold's columns and the copies' together (the members' distances are read from the
    same ``G``), a third less work than the two apart where ``q = m``.

    ``single``: more copies ``(c, F, r, D)`` scored the same way, their ``s`` and ``h`` in float32, ``s`` by the
    base's float32 inverse (``inverse``: :func:`single_inverse`, made here if not given): the int8 scorer's rows,
    whose own rounding is percents. The members' ``G`` and the factor of ``I - G``, where the correction cancels,
    stay float64; a copy's distance adds two positive terms, so float32's rounding of ``s`` moves it by about its
    own size.

    Returns:
        ``(c, F, m)`` and ``(c, F, q + r)`` float64 (the copies', then ``single``'s).
    """
    pixels, folds, m, dim = members.shape
    n = int(count)
    if m == 1 and single is not None:  # leave-one-out's closed form is cheap: every copy in float64
        single = single.to(members.dtype)
        copies, single = (single if copies is None else torch.cat([copies.to(members.dtype), single], dim=2)), None
    q = 0 if copies is None else copies.shape[2]
    mean = mean.to(members.dtype)
    if m == 1:  # leave-one-out: Sherman-Morrison
        assert copies is not None, "copies to score"
        v = members[:, :, 0] - mean.unsqueeze(1)  # (c, F, D)
        # the solve's columns, written in place: each member's v, then its copies' w = y - (mu - v / (n - 1))
        both = torch.empty(pixels, folds, q + 1, dim, dtype=members.dtype, device=members.device)
        both[:, :, 0] = v
        both[:, :, 1:].copy_(copies).sub_((mean.unsqueeze(1) - v / (n - 1)).unsqueeze(2))  # 4x faster than a new w
        solved = torch.linalg.solve_triangular(base, both.view(pixels, -1, dim).transpose(1, 2), upper=False)
        solved = solved.transpose(1, 2).view(pixels, folds, q + 1, dim)
        b, a = solved[:, :, :1], solved[:, :, 1:]  # (c, F, 1, D), (c, F, q, D)
        held = squared_norm(b, 3)  # (c, F, 1): the member under B_1, as fold_squared_distances reads it
        room = (n - 1) ** 2 - n * held
        _raise_if_not_positive((room <= 0).to(torch.int32), pixel_offset)
        along = torch.linalg.vecdot(a, b)  # (c, F, q)
        own = (n - 2) * n**2 * held / ((n - 1) * room)
        return own, (n - 2) / (n - 1) * (squared_norm(a, 3) + n * along.square() / room)
    z, s, k = _solved_columns(base, mean, n, members, copies)  # (c, F, m + 1, D), (c, F, q, D)
    own, factor = _members_distances(z, n, k, pixel_offset)
    found = []
    if q:
        h = z @ s.transpose(2, 3)  # (c, F, m + 1, q): Z^T s for every copy; h^T (I - G)^-1 h, the correction
        found.append((n - m - 1) * (squared_norm(s, 3) + (h * torch.cholesky_solve(h, factor)).sum(dim=2)))
    if single is not None:
        inverse = single_inverse(base) if inverse is None else inverse
        t = _single_columns(inverse, mean, n, m, k, z, single)  # (c, F, r, D) float32
        h = (z.to(t.dtype) @ t.transpose(2, 3)).to(factor.dtype)  # (c, F, m + 1, r)
        found.append((n - m - 1) * (squared_norm(t, 3).to(factor.dtype) + (h * torch.cholesky_solve(h, factor)).sum(2)))
    return own, torch.cat(found, dim=2) if found else own.new_zeros(pixels, folds, 0)


def refit_squared_distances(
    covariance: torch.Tensor,
    mean: torch.Tensor,
    count: int,
    members: torch.Tensor,
    epsilon: float | torch.Tensor,
    pixel_offset: int = 0,
    grid_shape: tuple[int, int] | None = None,
    queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fold_squared_distances` (or, given ``queries`` ``(c, F, q, D)``, :func:`fold_copy_squared_distances`) by
    downdating and factorising each fold model itself (large folds)."""
    pixels, folds, m, dim = members.shape
    n = int(count)
    u, _, rest_mean = _columns(mean.to(members.dtype), n, members)
    scored = members if queries is None else queries.to(members.dtype)
    values = []
    for f in range(folds):
        rest = (covariance * (n - 1) - u[:, f].transpose(1, 2) @ u[:, f]) / (n - m - 1)  # C_k / (n_k - 1)
        factor = regularised_cholesky(rest, epsilon, grid_shape, pixel_offset, overwrite=True)
        delta = (scored[:, f] - rest_mean[:, f].unsqueeze(1)).transpose(1, 2)  # (c, D, m or q)
        values.append(squared_norm(torch.linalg.solve_triangular(factor, delta, upper=False), 1))
    return torch.stack(values, dim=1)


def refit_is_cheaper(m: int, dim: int, folds: int) -> bool:
    """Whether refitting ``folds`` folds of ``m`` images costs less than correcting them (multiply-adds per pixel)."""
    per_fold = dim * (m + 1) ** 2 + (m + 1) ** 3 / 3 + (m + 1) ** 2 * m  # G, the small Cholesky, the solves
    woodbury = dim**3 / 3 + folds * per_fold  # one base per size
    refit = folds * (dim**2 * (m + 1) + dim**3 / 3)  # U U^T and a Cholesky per fold (the big solves cost both alike)
    return woodbury > REFIT_WHEN_CHEAPER_BY * refit


def squared_norm(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.square().sum(dim)`` in one pass over ``x``, without a temporary as large as it: measured 5-10x faster on a
    CPU for float64 rows of 100 (``sqrt`` then square costs 1e-16 relative)."""
    return torch.linalg.vector_norm(x, dim=dim).square()


def _solved_columns(
    base: torch.Tensor, mean: torch.Tensor, n: int, members: torch.Tensor, copies: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``Z``'s rows ``(L_m^-1 u_j)^T / sqrt(n - 1)`` ``(c, F, m + 1, D)``, the copies' ``s`` ``(c, F, q, D)`` (``q = 0``
    without copies) and ``k``, from one triangular solve of ``m + q`` columns a fold, not ``m + 1 + q``.

    Every column is a combination of the solved ``e_i = x_i - mu`` and ``y - mu``: with ``f`` the fold's mean and
    ``e = f - mu``, ``x_i - f = e_i - e``, ``k (f - mu_k) = k n / (n - m) e`` and ``y - mu_k = y - mu + m / (n - m) e``.
    """
    pixels, folds, m, dim = members.shape
    q = 0 if copies is None else copies.shape[2]
    centre = mean.to(members.dtype).view(pixels, 1, 1, dim)
    columns = torch.empty(pixels, folds, m + q, dim, dtype=members.dtype, device=members.device)
    torch.sub(members, centre, out=columns[:, :, :m])
    if copies is not None:  # copied, then centred in place: a new difference of mixed dtypes costs 4x
        columns[:, :, m:].copy_(copies).sub_(centre)
    solved = torch.linalg.solve_triangular(base, columns.view(pixels, -1, dim).transpose(1, 2), upper=False)
    solved = solved.transpose(1, 2).view(pixels, folds, m + q, dim).mul_(1.0 / math.sqrt(n - 1))
    e = solved[:, :, :m]
    shift = e.mean(dim=2, keepdim=True)  # L_m^-1 (f - mu) / sqrt(n - 1)
    k = math.sqrt((n - m) * m / n)
    z = torch.cat([e - shift, shift * (k * n / (n - m))], dim=2)
    return z, solved[:, :, m:].add_(shift, alpha=m / (n - m)), k


def single_inverse(base: torch.Tensor) -> torch.Tensor:
    """``L_m^-1`` of a :func:`fold_base` ``(c, D, D)`` in float32: what :func:`fold_and_copy_squared_distances` solves
    its ``single`` copies with, as one product a pixel (2.5x faster than a float64 triangular solve of 400 columns,
    1.2x than a float32 one, on a 2-core Zen 4 VM; one inverse serves every fold of the base's size)."""
    eye = torch.eye(base.shape[-1], dtype=base.dtype, device=base.device).expand_as(base)
    return torch.linalg.solve_triangular(base, eye, upper=False).to(torch.float32)


def _single_columns(
    inverse: torch.Tensor, mean: torch.Tensor, n: int, m: int, k: float, z: torch.Tensor, copies: torch.Tensor
) -> torch.Tensor:
    """:func:`_solved_columns`' ``s`` of ``copies`` ``(c, F, r, D)`` in float32, by ``inverse`` (:func:`single_inverse`;
    ``z``: the members' float64 rows, whose last is the fold's shift)."""
    pixels, folds, r, dim = copies.shape
    narrow = inverse.dtype
    columns = copies.to(narrow) - mean.to(narrow).view(pixels, 1, 1, dim)  # one pass where they are float32
    scaled = inverse.mT * (1.0 / math.sqrt(n - 1))  # (c, D, D): a quarter of the columns' size or less
    solved = (columns.view(pixels, -1, dim) @ scaled).view(pixels, folds, r, dim)
    shift = z[:, :, m:].to(narrow)  # the shift times k n / (n - m): :func:`_solved_columns`' last row
    return solved.add_(shift, alpha=m / (k * n))


def _members_distances(z: torch.Tensor, n: int, k: float, pixel_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The members' distances under their fold models ``(c, F, m)``, from ``Z``'s rows ``(c, F, m + 1, D)``
    (:func:`_solved_columns`), and the Cholesky factor of ``I - G`` that the copies' correction solves with.

    Raises:
        NotPositiveDefiniteError: a fold model that is not positive definite (``I - G`` is not).
    """
    pixels, folds, columns, _ = z.shape
    m = columns - 1
    gram = z @ z.transpose(2, 3)  # (c, F, m + 1, m + 1) G
    eye = torch.eye(m + 1, dtype=gram.dtype, device=gram.device)
    factor, info = torch.linalg.cholesky_ex(eye - gram)  # I - G is positive definite iff the fold model is
    _raise_if_not_positive(info, pixel_offset)
    ones = torch.eye(m, dtype=gram.dtype, device=gram.device)
    a = torch.cat([ones, torch.full((1, m), 1.0 / k, dtype=gram.dtype, device=gram.device)])  # a_i as columns
    solved = torch.cholesky_solve(a.expand(pixels, folds, m + 1, m), factor)  # (I - G)^-1 a_i
    return (n - m - 1) * ((gram @ a) * solved).sum(dim=2), factor  # a_i^T G (I - G)^-1 a_i


def _columns(mean: torch.Tensor, n: int, members: torch.Tensor) -> tuple[torch.Tensor, float, torch.Tensor]:
    """``U`` of every fold as rows ``(c, F, m + 1, D)``, ``k``, and ``mu_k`` ``(c, F, D)``."""
    m = members.shape[2]
    fold_mean = members.mean(dim=2)  # (c, F, D)
    rest_mean = (n * mean.unsqueeze(1) - m * fold_mean) / (n - m)
    k = math.sqrt((n - m) * m / n)
    u = torch.cat([members - fold_mean.unsqueeze(2), (k * (fold_mean - rest_mean)).unsqueeze(2)], dim=2)
    return u, k, rest_mean


def _raise_if_not_positive(info: torch.Tensor, pixel_offset: int) -> None:
    bad = torch.nonzero(info.reshape(info.shape[0], -1).amax(dim=1)).flatten()
    if bad.numel():
        raise NotPositiveDefiniteError(
            f"the model without one calibration fold is not positive definite at pixel {int(bad[0]) + pixel_offset}: "
            "too few images outside the fold for the embedding size; raise epsilon (e.g. --epsilon 0.01) or add images"
        )
