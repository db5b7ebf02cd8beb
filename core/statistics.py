"""Streaming per-pixel Gaussian statistics (PaDiM, Sec. III-B, Eq. 1).

PaDiM models the embedding of every patch position ``p`` as a multivariate Gaussian
``N(mu_p, Sigma_p)``. Instead of stacking every training embedding (``N * P * D`` floats),
we keep, per pixel, the count, the mean and the *comoment* ``C`` (sum of centred outer
products, often called ``M2``), and merge batches with the pairwise update of Chan, Golub &
LeVeque (1979). The comoment is symmetric, so only its lower triangle is kept, packed
(:mod:`padim.core.packing`): ``P * D (D + 1) / 2`` float64 whatever the number of images,
half the square. The result does not depend on the batch size, and two accumulators fed
disjoint images merge into the one that would have seen them all.

**The model.** The Gaussian of ``n`` images has the sample covariance plus ``epsilon I``
(the paper's regularisation, Sec. III-B): ``Sigma = C / (n - 1) + epsilon I``; so has every
model of fewer images, the out-of-fold models of :mod:`padim.core.out_of_fold` included.

Shapes: ``B`` images, ``P`` pixels (patch positions, ``H * W`` of the feature grid),
``D`` embedding channels, ``T = D (D + 1) / 2`` packed entries.

Example:
    >>> import torch
    >>> x = torch.randn(20, 4, 3, dtype=torch.float64)          # (B, P, D)
    >>> acc = GaussianAccumulator()
    >>> _ = acc.partial_fit(x[:7]).partial_fit(x[7:])
    >>> torch.allclose(acc.mean, x.mean(0))
    True
    >>> reference = torch.stack([torch.cov(x[:, p].T) for p in range(4)])
    >>> torch.allclose(acc.covariance(), reference)
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import SHRINKAGE_AUTO, SHRINKAGE_MAX
from .errors import NotPositiveDefiniteError as NotPositiveDefiniteError  # re-exported: raised here
from .packing import add_lower_products_, packed_length, unpack_lower

ACCUMULATOR_DTYPE = torch.float64
#: Bytes of float64 embeddings converted at a time when a batch is added (a slice of pixels).
UPDATE_SLICE_BYTES = 8 * 2**20


@dataclass
class GaussianState:
    """Sufficient statistics of a set of embeddings, per pixel.

    Attributes:
        count: number of images seen (0-dim int64 tensor).
        mean: ``(P, D)`` per-pixel mean, float64.
        comoment: ``(P, T)`` per-pixel sum of centred outer products
            ``sum_i (x_i - mean)(x_i - mean)^T``, float64, its lower triangle packed row by row.
    """

    count: torch.Tensor
    mean: torch.Tensor
    comoment: torch.Tensor

    @property
    def num_pixels(self) -> int:
        return self.mean.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.mean.shape[1]

    def clone(self) -> GaussianState:
        return GaussianState(self.count.clone(), self.mean.clone(), self.comoment.clone())

    def to(self, device: torch.device | str) -> GaussianState:
        return GaussianState(self.count.to(device), self.mean.to(device), self.comoment.to(device))


def empty_state(num_pixels: int, embedding_dim: int, device: torch.device | str = "cpu") -> GaussianState:
    """The state of an accumulator that has seen nothing."""
    return GaussianState(
        count=torch.zeros((), dtype=torch.int64, device=device),
        mean=torch.zeros(num_pixels, embedding_dim, dtype=ACCUMULATOR_DTYPE, device=device),
        comoment=torch.zeros(num_pixels, packed_length(embedding_dim), dtype=ACCUMULATOR_DTYPE, device=device),
    )


def batch_state(embedding: torch.Tensor) -> GaussianState:
    """Statistics of one batch.

    Args:
        embedding: ``(B, P, D)`` embeddings of ``B`` images, any float dtype.

    Returns:
        The batch's count, mean and comoment, in float64 on the input's device.
    """
    if embedding.ndim != 3:
        raise ValueError(f"embedding must be (B, P, D), got shape {tuple(embedding.shape)}")
    state = empty_state(embedding.shape[1], embedding.shape[2], embedding.device)
    return update_state_(state, embedding)


def merge_states_(into: GaussianState, other: GaussianState) -> GaussianState:
    """Merge ``other`` into ``into`` in place (Chan et al. pairwise update) and return it.

    ``n = n_a + n_b``, ``delta = mean_b - mean_a``,
    ``mean = mean_a + delta * n_b / n``,
    ``M2 = M2_a + M2_b + delta delta^T * n_a * n_b / n``.

    In place so that a fit holds one ``(P, D, D)`` buffer rather than three.
    """
    _check_compatible(into, other)
    n_a, n_b = int(into.count), int(other.count)
    if n_b == 0:
        return into
    if n_a == 0:
        into.count.copy_(other.count)
        into.mean.copy_(other.mean)
        into.comoment.copy_(other.comoment)
        return into
    n = n_a + n_b
    delta = other.mean - into.mean  # (P, D)
    into.comoment.add_(other.comoment)
    add_lower_products_(into.comoment, delta.unsqueeze(1), alpha=n_a * n_b / n)  # + a delta delta^T
    into.mean.add_(delta, alpha=n_b / n)
    into.count.add_(n_b)
    return into


def merge_states(a: GaussianState, b: GaussianState) -> GaussianState:
    """``merge(A, B)``: the state of one accumulator fed A's and B's images."""
    return merge_states_(a.clone(), b)


# ------------------------------------------------------------------ two passes: a spool's moments
# A fit with a spool forms its statistics in two passes: the rows' sum (so their exact mean) while they are spooled,
# then, a slice of pixels at a time, their comoment centred on that mean, merged with any earlier statistics. The
# same Chan merge as :func:`merge_states_`, on an unpacked slice: the square the factors are taken from.
@dataclass
class RowSums:
    """The count and the float64 sum ``(P, D)`` of rows added so far (pass 1 of a spooled fit): their mean."""

    total: torch.Tensor | None = None
    count: int = 0

    def add_(self, rows: torch.Tensor) -> RowSums:
        """``(R, P, D)`` rows added."""
        batch = rows.sum(dim=0, dtype=ACCUMULATOR_DTYPE)
        self.total = batch if self.total is None else self.total.add_(batch)
        self.count += rows.shape[0]
        return self

    def sum_or_zeros(self, pixels: int, dim: int, device: torch.device | str) -> torch.Tensor:
        """The sum, or zeros for no rows (a rank without pictures still all-reduces its share)."""
        if self.total is not None:
            return self.total
        return torch.zeros(pixels, dim, dtype=ACCUMULATOR_DTYPE, device=device)


def mean_of(total: torch.Tensor, count: int) -> torch.Tensor:
    """The mean of ``count`` rows whose sum is ``total`` (zeros for none)."""
    return total / max(count, 1)


def merged_mean(mean_a: torch.Tensor, n_a: int, mean_b: torch.Tensor, n_b: int) -> torch.Tensor:
    """The mean of A's ``n_a`` and B's ``n_b`` rows together: ``mean_a + (mean_b - mean_a) n_b / n``."""
    return mean_a + (mean_b - mean_a) * (n_b / (n_a + n_b))


def add_centred_products_(
    square: torch.Tensor, rows: torch.Tensor, mean: torch.Tensor, first: bool, fourth: torch.Tensor | None = None
) -> torch.Tensor:
    """``(R, c, D)`` rows of ``c`` pixels centred on ``mean`` ``(c, D)``: their products ``sum (x - mean)(x -
    mean)^T`` added to ``square`` ``(c, D, D)`` float64 (written over it when ``first``); with ``fourth`` ``(c,)``,
    their ``sum ||x - mean||^4`` added to it (the tails :class:`PooledMoments` reads)."""
    centred = (rows.to(torch.float64) - mean).transpose(0, 1)  # (c, R, D)
    square.baddbmm_(centred.transpose(1, 2), centred, beta=0.0 if first else 1.0)
    if fourth is not None:
        fourth += centred.square().sum(-1).square().sum(-1)
    return square


def merge_comoment_(
    square: torch.Tensor,
    mean: torch.Tensor,
    count: int,
    other: torch.Tensor,
    other_mean: torch.Tensor,
    other_count: int,
) -> torch.Tensor:
    """The comoment ``square`` ``(c, D, D)`` of ``count`` rows about ``mean`` ``(c, D)`` merged in place with another
    set's (``other``, unpacked, about ``other_mean``): Chan's ``M2 = M2_a + M2_b + delta delta^T n_a n_b / n``, as
    :func:`merge_states_` merges packed statistics."""
    delta = (mean - other_mean).unsqueeze(2)  # (c, D, 1)
    square.add_(other)
    square.baddbmm_(delta, delta.transpose(1, 2), alpha=other_count * count / (other_count + count))
    return square


def update_state_(
    state: GaussianState, embedding: torch.Tensor, slice_bytes: int = UPDATE_SLICE_BYTES
) -> GaussianState:
    """Add one batch of ``(B, P, D)`` embeddings to ``state`` in place.

    The Chan et al. update of :func:`merge_states_`, written straight into ``state.comoment``
    a slice of pixels at a time: the batch's centred rows and the mean-shift row
    ``sqrt(n_a n_b / n) (mean_b - mean_a)`` go through one packed product
    (:func:`~padim.core.packing.add_lower_products_`), and no ``(P, D, D)`` buffer is made.
    The more images a batch holds, the fewer passes over the comoment a fit makes.
    """
    if embedding.ndim != 3 or embedding.shape[1:] != state.mean.shape:
        raise ValueError(
            f"cannot add a batch of shape {tuple(embedding.shape)} to statistics of (P, D)={tuple(state.mean.shape)}"
        )
    n_a, n_b = int(state.count), embedding.shape[0]
    if n_b == 0:
        return state
    n = n_a + n_b
    pixels, dim = state.mean.shape
    step = max(1, slice_bytes // (8 * (n_b + 1) * dim))
    shift = math.sqrt(n_a * n_b / n)
    for start in range(0, pixels, step):
        stop = min(start + step, pixels)
        x = embedding[:, start:stop].to(ACCUMULATOR_DTYPE).transpose(0, 1)  # (c, B, D)
        batch_mean = x.mean(dim=1)  # (c, D)
        delta = batch_mean - state.mean[start:stop]  # (c, D)
        rows = torch.cat([x - batch_mean.unsqueeze(1), (shift * delta).unsqueeze(1)], dim=1)  # (c, B + 1, D)
        add_lower_products_(state.comoment[start:stop], rows)
        state.mean[start:stop].add_(delta, alpha=n_b / n)
    state.count.add_(n_b)
    return state


def downdate_state_(
    state: GaussianState, embedding: torch.Tensor, slice_bytes: int = UPDATE_SLICE_BYTES
) -> GaussianState:
    """Remove a ``(B, P, D)`` batch of rows that ``state`` holds, in place: the inverse of :func:`update_state_`.

    With ``n`` rows of mean ``mu`` and comoment ``M``, removing ``n_b`` rows of mean ``m_b`` and comoment
    ``M_b`` (centred on ``m_b``) leaves ``n_a = n - n_b`` rows with
    ``mu_a = (n mu - n_b m_b) / n_a`` and ``M_a = M - M_b - d d^T n_a n_b / n``, ``d = m_b - mu_a``
    (Chan et al.'s merge solved for the other part). One row (``n_b = 1``) is Welford's downdate:
    ``mu_a = mu - (x - mu) / (n - 1)``, ``M_a = M - n / (n - 1) v v^T`` with ``v = x - mu``.

    Exact in exact arithmetic; in float64 it leaves the rounding of the statistics' own sums, not of the
    removed rows (tested against a fit without them). Rows that were never added give statistics of nothing
    real, and nothing can tell: the caller knows what it added (a model file's ``image_digests``).

    Raises:
        ValueError: a batch of another shape, or one that would leave fewer than 2 rows.
    """
    if embedding.ndim != 3 or embedding.shape[1:] != state.mean.shape:
        raise ValueError(
            f"cannot remove a batch of shape {tuple(embedding.shape)} from statistics of (P, "
            f"D)={tuple(state.mean.shape)}"
        )
    n, n_b = int(state.count), embedding.shape[0]
    if n_b == 0:
        return state
    n_a = n - n_b
    if n_a < 2:
        raise ValueError(f"removing {n_b} of {n} rows would leave fewer than 2: no covariance is left")
    pixels, dim = state.mean.shape
    step = max(1, slice_bytes // (8 * (n_b + 1) * dim))
    shift = math.sqrt(n_a * n_b / n)
    for start in range(0, pixels, step):
        stop = min(start + step, pixels)
        x = embedding[:, start:stop].to(ACCUMULATOR_DTYPE).transpose(0, 1)  # (c, B, D)
        batch_mean = x.mean(dim=1)  # (c, D)
        rest_mean = (state.mean[start:stop] * n - batch_mean * n_b) / n_a  # (c, D)
        delta = batch_mean - rest_mean
        rows = torch.cat([x - batch_mean.unsqueeze(1), (shift * delta).unsqueeze(1)], dim=1)  # (c, B + 1, D)
        add_lower_products_(state.comoment[start:stop], rows, alpha=-1.0)
        state.mean[start:stop] = rest_mean
    state.count.sub_(n_b)
    return state


def all_reduce_state_(state: GaussianState, group=None) -> GaussianState:
    """Merge the states of every rank of a ``torch.distributed`` group, in place, on every rank.

    Exact, not an approximation: with ``N = sum n_r`` and ``mu = sum n_r mu_r / N``,
    ``M2 = sum_r [M2_r + n_r (mu_r - mu)(mu_r - mu)^T]``. Communicates two scalars, one
    ``(P, D)`` and one ``(P, D, D)`` float64 tensor, once. A rank that saw no images passes
    an :func:`empty_state` of the same shape.
    """
    count = state.count.to(ACCUMULATOR_DTYPE)
    dist.all_reduce(count, group=group)
    total = float(count)
    if total == 0:
        return state
    weighted = state.mean * float(state.count)
    dist.all_reduce(weighted, group=group)
    mean = weighted / total  # (P, D)
    delta = state.mean - mean
    add_lower_products_(state.comoment, delta.unsqueeze(1), alpha=float(state.count))
    dist.all_reduce(state.comoment, group=group)
    state.mean.copy_(mean)
    state.count.fill_(int(round(total)))
    return state


def covariance(state: GaussianState, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Unbiased per-pixel covariance ``(c, D, D)`` of pixels ``start .. stop`` (all by default).

    Divides by ``n - 1``, as ``np.cov``; unpacked, so take a slice of a large model.
    """
    n = int(state.count)
    if n < 2:
        raise ValueError(f"a covariance needs at least 2 images, this accumulator has {n}")
    return unpack_lower(state.comoment[start:stop], state.embedding_dim, symmetric=True) / (n - 1)


def regularised_cholesky(
    covariance: torch.Tensor,
    epsilon: float | torch.Tensor,
    grid_shape: tuple[int, int] | None = None,
    pixel_offset: int = 0,
    overwrite: bool = False,
) -> torch.Tensor:
    """Lower Cholesky factor ``L`` of ``Sigma + eps I`` (or ``Sigma + R``) for every pixel (Sec. III-B).

    Args:
        covariance: ``(P, D, D)`` symmetric matrices.
        epsilon: regularisation added to the diagonal (the paper uses 0.01), or a symmetric ``(D, D)`` matrix ``R``
            added to every pixel's (:attr:`Shrinkage.prior`).
        grid_shape: ``(H, W)`` of the feature grid, to name a failing pixel by row and column.
        pixel_offset: index of ``covariance[0]`` in the whole grid (when given a slice).
        overwrite: add ``epsilon`` to ``covariance`` itself (no second buffer).

    Returns:
        ``(P, D, D)`` lower-triangular ``L`` with ``L L^T = Sigma + eps I``.

    Raises:
        NotPositiveDefiniteError: naming the first pixel whose matrix is not positive definite.
    """
    regularised = covariance if overwrite else covariance.clone()
    if isinstance(epsilon, torch.Tensor):
        regularised.add_(epsilon.to(regularised.dtype))
    else:
        regularised.diagonal(dim1=-2, dim2=-1).add_(epsilon)
    cholesky, info = torch.linalg.cholesky_ex(regularised)
    bad = torch.nonzero(info).flatten()
    if bad.numel():
        pixel = int(bad[0]) + pixel_offset
        where = f"pixel {pixel}"
        if grid_shape is not None:
            row, column = divmod(pixel, grid_shape[1])
            where += f" (row {row}, column {column} of the {grid_shape[0]}x{grid_shape[1]} feature grid)"
        raise NotPositiveDefiniteError(
            f"the covariance at {where} is not positive definite even with "
            f"{'the shrunk prior' if isinstance(epsilon, torch.Tensor) else f'epsilon={epsilon:g}'} "
            f"({bad.numel()} of {covariance.shape[0]} pixels checked fail). "
            "Train on more (and more varied) normal images, or raise epsilon (e.g. --epsilon 0.1)."
        )
    return cholesky


def precision_factor(
    covariance: torch.Tensor,
    epsilon: float,
    grid_shape: tuple[int, int] | None = None,
    pixel_offset: int = 0,
) -> torch.Tensor:
    """``W = L^-1`` for ``L L^T = Sigma + eps I``, so that the precision is ``W^T W``.

    Scoring with ``W`` gives ``||W (x - mu)||^2``, the squared Mahalanobis distance, which is
    never negative whatever the rounding. Computed by a triangular solve; no explicit inverse.

    Returns:
        ``(P, D, D)`` lower-triangular precision factors, in the covariance's dtype.
    """
    return triangular_inverse(regularised_cholesky(covariance, epsilon, grid_shape, pixel_offset))  # W = L^-1


def cholesky_slice(
    state: GaussianState, start: int, stop: int, epsilon: float, grid_shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """``L`` with ``L L^T = C / (n - 1) + epsilon I`` for pixels ``start .. stop``: ``(c, D, D)`` float64."""
    return regularised_cholesky(covariance(state, start, stop), epsilon, grid_shape, start)


def finalise(
    state: GaussianState,
    epsilon: float,
    grid_shape: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    chunk_pixels: int = 256,
    shrinkage: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and precision factors for scoring, computed in float64 a slice of pixels at a time.

    Holds the whole ``(P, D, D)`` result: for a model of any size, a fit derives its factors
    slice by slice instead (:meth:`padim.models.fit.in_progress.Fit.finish`). ``shrinkage``: the
    weight of the pooled covariance (:class:`Shrinkage`).

    Returns:
        ``mean`` ``(P, D)`` and ``precision_factor`` ``(P, D, D)``, both in ``dtype``.
    """
    n = int(state.count)
    if n < 2:
        raise ValueError(f"a covariance needs at least 2 images, this accumulator has {n}")
    dim = state.embedding_dim
    shrunk = Shrinkage.of(state, epsilon, shrinkage)
    factors = torch.empty(state.num_pixels, dim, dim, dtype=dtype, device=state.comoment.device)  # (P, D, D) W
    for start in range(0, state.num_pixels, chunk_pixels):
        stop = min(start + chunk_pixels, state.num_pixels)
        factors[start:stop] = triangular_inverse(shrunk.cholesky(covariance(state, start, stop), grid_shape, start))
    return state.mean.to(dtype), factors


def pooled_comoment(state: GaussianState) -> torch.Tensor:
    """``sum_p C_p``, the ``(D, D)`` sum of every pixel's comoment (float64): what :class:`Shrinkage` pools."""
    return unpack_lower(state.comoment.sum(dim=0, keepdim=True), state.embedding_dim, symmetric=True)[0]


@dataclass
class PooledMoments:
    """What the pooled target and its estimated weight need of every pixel's sample covariance ``S_p``, summed a
    slice of pixels at a time (:meth:`add_`): ``sum_p S_p``, ``sum_p ||S_p||_F^2`` and ``sum_p tr(S_p)^2``."""

    total: torch.Tensor  # (D, D) float64, sum_p S_p
    squares: float = 0.0
    trace_squares: float = 0.0
    pixels: int = 0
    #: sum_p of the sampling variance of S_p read from the pictures' fourth moments, and the same as a Gaussian
    #: would give (:meth:`add_tails_`): their ratio scales the Gaussian estimate (1 without them).
    fourth: float = 0.0
    gaussian: float = 0.0

    @classmethod
    def empty(cls, dim: int, device: torch.device | str = "cpu") -> PooledMoments:
        return cls(torch.zeros(dim, dim, dtype=ACCUMULATOR_DTYPE, device=device))

    @classmethod
    def of(cls, state: GaussianState, chunk_pixels: int = 256) -> PooledMoments:
        """The moments of ``state``'s pixels, ``chunk_pixels`` unpacked at a time."""
        moments = cls.empty(state.embedding_dim, state.comoment.device)
        for start in range(0, state.num_pixels, chunk_pixels):
            moments.add_(covariance(state, start, start + chunk_pixels))
        return moments

    def add_(self, covariances: torch.Tensor) -> PooledMoments:
        """Adds ``(c, D, D)`` sample covariances (left unchanged)."""
        covariances = covariances.to(ACCUMULATOR_DTYPE)
        self.total += covariances.sum(dim=0).to(self.total.device)
        self.squares += float(covariances.square().sum())
        self.trace_squares += float(covariances.diagonal(dim1=-2, dim2=-1).sum(-1).square().sum())
        self.pixels += covariances.shape[0]
        return self

    def add_tails_(self, fourth: torch.Tensor, comoment: torch.Tensor, count: int) -> PooledMoments:
        """Adds the tails of ``count`` pictures at ``c`` pixels: ``fourth`` ``(c,)`` ``sum_k ||x_k - m||^4`` and
        ``comoment`` ``(c, D, D)`` ``sum_k (x_k - m)(x_k - m)^T``, both about their own mean ``m``. Ledoit and Wolf's
        estimate of the sampling variance of ``S_p``, ``(sum_k ||x_k x_k^T - S_p||^2) / n^2 = (sum_k ||x_k||^4 -
        n ||S_p||^2) / n^2`` (``S_p`` over ``n``), is summed beside what a Gaussian's would be, ``(||S_p||^2 +
        tr(S_p)^2) / n``: features with heavier tails than a Gaussian's vary more from sample to sample, and ask
        for more shrinkage (:attr:`tails`)."""
        if count < 2:
            return self
        biased = comoment.to(ACCUMULATOR_DTYPE) / count
        squares = biased.square().sum(dim=(-2, -1))  # (c,)
        traces = biased.diagonal(dim1=-2, dim2=-1).sum(-1)  # (c,)
        self.fourth += float((fourth.to(ACCUMULATOR_DTYPE) - count * squares).sum()) / count**2
        self.gaussian += float((squares + traces.square()).sum()) / count
        return self

    @property
    def tails(self) -> float:
        """How much more the sample covariances vary than a Gaussian's would (1: as a Gaussian's, or unmeasured)."""
        return max(self.fourth, 0.0) / self.gaussian if self.gaussian > 0 else 1.0

    @property
    def target(self) -> torch.Tensor:
        """``T = sum_p S_p / P``, the pooled covariance."""
        return self.total / self.pixels

    def intensity(self, count: int, tails: float | None = None) -> float:
        """The weight of ``T`` estimated from ``count`` pictures: :func:`shrinkage_intensity`, its sampling
        variance scaled by ``tails`` (default :attr:`tails`)."""
        target_square = float(self.target.square().sum())
        factor = self.tails if tails is None else tails
        return shrinkage_intensity(self.squares, self.trace_squares, target_square, count, self.pixels, factor)


def shrinkage_intensity(
    squares: float, trace_squares: float, target_square: float, count: int, pixels: int, tails: float = 1.0
) -> float:
    """The Ledoit-Wolf weight of the pooled covariance ``T`` for per-pixel sample covariances ``S_p`` of ``count``
    pictures, with the sampling variance of a Gaussian's covariance in place of fourth moments (which a streamed
    comoment does not keep): the weight that minimises the expected squared Frobenius error of
    ``(1 - lambda) S_p + lambda T`` summed over the pixels, ``T`` taken as known (it has ``P`` times the samples),

        ``lambda = sum_p E ||S_p - Sigma_p||^2 / sum_p ||S_p - T||^2``,  ``E ||S_p - Sigma_p||^2 = (||Sigma_p||^2 +
        tr(Sigma_p)^2) / (n - 1)``

    with ``||Sigma_p||^2`` and ``tr(Sigma_p)^2`` estimated without bias from ``||S_p||^2`` and ``tr(S_p)^2`` (their
    expectations under a Wishart law), times ``tails``: how much more the covariances of these features vary than
    a Gaussian's (:meth:`PooledMoments.add_tails_`, from the pictures' fourth moments, as Ledoit and Wolf read it).
    Few pictures, heavy tails or pixels that differ little from the pool ask for much shrinkage; many pictures for
    little. Clipped to ``[0, 0.95]``.

    Args:
        squares: ``sum_p ||S_p||_F^2``; trace_squares: ``sum_p tr(S_p)^2``; target_square: ``||T||_F^2``.
        count: pictures; pixels: ``P``; tails: the sampling variance's factor over a Gaussian's.

    Example (300 pictures ask for less than 30):
        >>> x = torch.randn(300, 50, 6, dtype=torch.float64) * torch.linspace(0.5, 2, 50)[:, None]
        >>> few, many = (PooledMoments.of(batch_state(x[:n])).intensity(n) for n in (30, 300))
        >>> 0 < many < few < 1
        True
    """
    if count < 3 or pixels < 1:
        return 0.0
    m = count - 1
    frobenius = max((squares - trace_squares / m) / (1 + 1 / m - 2 / m**2), 0.0)  # sum_p ||Sigma_p||^2
    traces = max(trace_squares - 2 * frobenius / m, 0.0)  # sum_p tr(Sigma_p)^2
    error = tails * (frobenius + traces) / m  # sum_p E ||S_p - Sigma_p||^2
    spread = squares - pixels * target_square  # sum_p ||S_p - T||^2
    if spread <= 0.0:
        return SHRINKAGE_MAX
    return min(max(error / spread, 0.0), SHRINKAGE_MAX)


@dataclass(frozen=True)
class Shrinkage:
    """Each pixel's covariance shrunk toward the covariance pooled over every pixel (``train --shrinkage``).

    With ``S_p = C_p / (n - 1)`` a pixel's sample covariance and ``T = sum_p S_p / P`` their mean over the
    ``P`` pixels, the model's covariance is

        ``Sigma_p = (1 - lambda) S_p + lambda T + epsilon I``.

    With 80 pictures and 100 channels each ``S_p`` is estimated from few samples and is too tight in the
    directions those pictures did not vary in; ``T`` is estimated from ``P`` times as many and lends each pixel
    the variation seen elsewhere in the picture (a Ledoit-Wolf style estimator with the pooled covariance as its
    target and a fixed intensity, chosen by measurement: docs/quality.md). ``lambda = 0`` is the paper's model.

    Streaming and merging are unchanged: ``T`` is a sum of the per-pixel comoments, formed when the factors are.
    Every formula of :mod:`padim.core.out_of_fold` holds with ``epsilon I`` replaced by a fixed matrix: written as
    ``Sigma_p = (1 - lambda) (S_p + R)`` with the *prior* ``R = (lambda T + epsilon I) / (1 - lambda)``, a fold
    model is ``(1 - lambda)`` times the usual one with ``R`` for ``epsilon I``, so its squared distances are the
    usual ones divided by ``1 - lambda`` (:attr:`scale`). A fold model keeps the ``T`` of every picture: a
    picture is left out of its own pixels' ``S_p`` exactly, and stays in the pooled ``T`` with weight
    ``lambda / P`` per pixel (measured: docs/calibration.md).

    Example (the model's covariance, from its Cholesky factor):
        >>> x = torch.randn(30, 4, 3, dtype=torch.float64)
        >>> state = batch_state(x)
        >>> shrunk = Shrinkage.of(state, epsilon=0.01, weight=0.5)
        >>> S = covariance(state)
        >>> L = shrunk.cholesky(S)
        >>> torch.allclose(L @ L.mT, 0.5 * S + 0.5 * S.mean(0) + 0.01 * torch.eye(3))
        True
    """

    epsilon: float
    weight: float = 0.0
    target: torch.Tensor | None = None  # (D, D) T, float64; None with weight 0

    @classmethod
    def of(cls, state: GaussianState, epsilon: float, weight: float | str) -> Shrinkage:
        """The shrinkage of ``state``'s pixels toward their pooled covariance (the state's own ``T``); ``weight``
        :data:`SHRINKAGE_AUTO`: estimated from the state (:func:`shrinkage_intensity`)."""
        if weight == SHRINKAGE_AUTO:
            return cls.of_moments(PooledMoments.of(state), int(state.count), epsilon, weight)
        if not weight:
            return cls(epsilon)
        return cls.pooled(pooled_comoment(state), int(state.count), state.num_pixels, epsilon, float(weight))

    @classmethod
    def of_moments(
        cls, moments: PooledMoments, count: int, epsilon: float, weight: float | str, tails: float | None = None
    ) -> Shrinkage:
        """Toward ``moments``' pooled covariance by ``weight``, or with :data:`SHRINKAGE_AUTO` by the weight they ask
        for (:meth:`PooledMoments.intensity`; ``tails``: their factor, if not theirs)."""
        if weight == SHRINKAGE_AUTO:
            weight = moments.intensity(count, tails)
        return cls.toward(moments.target, epsilon, float(weight))

    @classmethod
    def pooled(cls, comoment_sum: torch.Tensor, count: int, pixels: int, epsilon: float, weight: float) -> Shrinkage:
        """From ``sum_p C_p`` (:func:`pooled_comoment`, or summed a slice of pixels at a time) of ``count`` images."""
        return cls.toward(comoment_sum.to(ACCUMULATOR_DTYPE) / (pixels * (count - 1)), epsilon, weight)

    @classmethod
    def toward(cls, target: torch.Tensor, epsilon: float, weight: float) -> Shrinkage:
        """Toward the pooled covariance ``target`` by ``weight`` (none at 0: the paper's model)."""
        if not 0.0 <= weight < 1.0:
            raise ValueError(f"a shrinkage weight is in [0, 1), got {weight}")
        if not weight:
            return cls(epsilon)
        return cls(epsilon, weight, target)

    @property
    def scale(self) -> float:
        """``1 - lambda``: the sample covariances' share; fold distances made with :attr:`prior` are divided by it."""
        return 1.0 - self.weight

    @property
    def prior(self) -> float | torch.Tensor:
        """``R = (lambda T + epsilon I) / (1 - lambda)``, what the formulas written for ``epsilon`` take (``epsilon``
        itself, a float, without shrinkage: the paper's model, to the bit)."""
        if self.target is None:
            return self.epsilon
        eye = torch.eye(self.target.shape[0], dtype=self.target.dtype, device=self.target.device)
        return (self.weight * self.target + self.epsilon * eye) / self.scale

    def unscaled(self, squared: torch.Tensor) -> torch.Tensor:
        """Squared distances computed with :attr:`prior` for epsilon -> the shrunk model's (divided in place by
        :attr:`scale`; unchanged without shrinkage)."""
        return squared if self.target is None else squared.div_(self.scale)

    def cholesky(
        self, covariance: torch.Tensor, grid_shape: tuple[int, int] | None = None, pixel_offset: int = 0
    ) -> torch.Tensor:
        """``L`` with ``L L^T = Sigma_p`` for sample covariances ``S_p`` ``(c, D, D)`` (left unchanged)."""
        cholesky = regularised_cholesky(covariance, self.prior, grid_shape, pixel_offset)
        return cholesky if self.target is None else cholesky.mul_(math.sqrt(self.scale))

    def to(self, device: torch.device | str) -> Shrinkage:
        return self if self.target is None else Shrinkage(self.epsilon, self.weight, self.target.to(device))


def triangular_inverse(cholesky: torch.Tensor) -> torch.Tensor:
    """``W = L^-1`` of ``(c, D, D)`` lower-triangular ``L``, by a triangular solve."""
    eye = torch.eye(cholesky.shape[-1], dtype=cholesky.dtype, device=cholesky.device)
    return torch.linalg.solve_triangular(cholesky, eye.expand_as(cholesky), upper=False)


def precision(covariance: torch.Tensor, epsilon: float, grid_shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Precision ``(Sigma + eps I)^-1`` ``(P, D, D)`` from the Cholesky factor (``cholesky_inverse``)."""
    return torch.cholesky_inverse(regularised_cholesky(covariance, epsilon, grid_shape))


def _check_compatible(a: GaussianState, b: GaussianState) -> None:
    if a.mean.shape != b.mean.shape:
        raise ValueError(
            f"cannot merge statistics of shape (P, D)={tuple(a.mean.shape)} with (P, D)={tuple(b.mean.shape)}"
        )


class GaussianAccumulator:
    """Per-pixel mean and covariance, fed batch by batch (``partial_fit``, as sklearn).

    The shape ``(P, D)`` is taken from the first batch. ``fit`` is ``reset`` + ``partial_fit``;
    ``merge`` folds in another accumulator (resume, several workers).

    Args:
        state: statistics to go on from.
        block_bytes: batches are held until they reach this many bytes and then added as one
            block: each addition is one pass over the packed comoment (3.8 GB for
            wide_resnet50_2 at 224 px), so adding 40 images at a time instead of 16 saves most
            of those passes. 0 adds every batch at once. Reading :attr:`state` adds what is held.
    """

    def __init__(self, state: GaussianState | None = None, block_bytes: int = 0) -> None:
        self._state = state
        self.block_bytes = block_bytes
        self._held: list[torch.Tensor] = []

    @property
    def state(self) -> GaussianState | None:
        """The statistics of every batch given so far."""
        self._flush()
        return self._state

    @state.setter
    def state(self, value: GaussianState | None) -> None:
        self._held = []
        self._state = value

    def reset(self) -> GaussianAccumulator:
        self.state = None
        return self

    def partial_fit(self, embedding: torch.Tensor) -> GaussianAccumulator:
        """Add a ``(B, P, D)`` batch."""
        if embedding.ndim != 3:
            raise ValueError(f"embedding must be (B, P, D), got shape {tuple(embedding.shape)}")
        self._held.append(embedding)
        if sum(e.numel() * e.element_size() for e in self._held) >= self.block_bytes:
            self._flush()
        return self

    def _flush(self) -> None:
        if not self._held:
            return
        block = self._held[0] if len(self._held) == 1 else torch.cat(self._held)
        self._held = []
        if self._state is None:
            self._state = batch_state(block)
        else:
            update_state_(self._state, block)

    def fit(self, batches) -> GaussianAccumulator:
        """Fit on an iterable of ``(B, P, D)`` batches, forgetting anything seen before."""
        self.reset()
        for batch in batches:
            self.partial_fit(batch)
        return self

    def merge(self, other: GaussianAccumulator) -> GaussianAccumulator:
        """Fold ``other``'s images into this accumulator (``other`` is left unchanged)."""
        if other.state is None:
            return self
        if self.state is None:
            self.state = other.state.clone()
        else:
            merge_states_(self.state, other.state)
        return self

    @property
    def count(self) -> int:
        state = self.state
        return 0 if state is None else int(state.count)

    @property
    def mean(self) -> torch.Tensor:
        return self._fitted().mean

    def covariance(self) -> torch.Tensor:
        return covariance(self._fitted())

    def _fitted(self) -> GaussianState:
        state = self.state
        if state is None:
            raise ValueError("this accumulator has seen no images yet")
        return state
