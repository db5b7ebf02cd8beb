"""Streaming per-pixel Gaussian statistics (PaDiM, Sec. III-B, Eq. 1).

PaDiM models the embedding of every patch position ``p`` as a multivariate Gaussian
``N(mu_p, Sigma_p)``. Instead of stacking every training embedding (``N * P * D`` floats),
we keep, per pixel, the count, the mean and the *comoment* (sum of centred outer products,
often called ``M2``), and merge batches with the pairwise update of Chan, Golub & LeVeque
(1979). Memory is ``P * D * D`` float64 whatever the number of images, the result does
not depend on the batch size, and two accumulators fed disjoint images merge into the one
that would have seen them all.

Shapes: ``B`` images, ``P`` pixels (patch positions, ``H * W`` of the feature grid),
``D`` embedding channels.

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

from dataclasses import dataclass

import torch

ACCUMULATOR_DTYPE = torch.float64


class NotPositiveDefiniteError(ValueError):
    """A regularised covariance matrix has no Cholesky factorisation."""


@dataclass
class GaussianState:
    """Sufficient statistics of a set of embeddings, per pixel.

    Attributes:
        count: number of images seen (0-dim int64 tensor).
        mean: ``(P, D)`` per-pixel mean, float64.
        comoment: ``(P, D, D)`` per-pixel sum of centred outer products
            ``sum_i (x_i - mean)(x_i - mean)^T``, float64.
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


def empty_state(
    num_pixels: int, embedding_dim: int, device: torch.device | str = "cpu"
) -> GaussianState:
    """The state of an accumulator that has seen nothing."""
    return GaussianState(
        count=torch.zeros((), dtype=torch.int64, device=device),
        mean=torch.zeros(num_pixels, embedding_dim, dtype=ACCUMULATOR_DTYPE, device=device),
        comoment=torch.zeros(num_pixels, embedding_dim, embedding_dim, dtype=ACCUMULATOR_DTYPE, device=device),
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
    x = embedding.to(ACCUMULATOR_DTYPE)
    mean = x.mean(dim=0)  # (P, D)
    centred = (x - mean).permute(1, 0, 2)  # (P, B, D)
    comoment = torch.bmm(centred.transpose(1, 2), centred)  # (P, D, D)
    count = torch.tensor(x.shape[0], dtype=torch.int64, device=x.device)
    return GaussianState(count, mean, comoment)


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
    into.comoment.baddbmm_(delta.unsqueeze(2), delta.unsqueeze(1), alpha=n_a * n_b / n)
    into.mean.add_(delta, alpha=n_b / n)
    into.count.add_(n_b)
    return into


def merge_states(a: GaussianState, b: GaussianState) -> GaussianState:
    """``merge(A, B)``: the state of one accumulator fed A's and B's images."""
    return merge_states_(a.clone(), b)


def subtract_states(total: GaussianState, part: GaussianState, out: GaussianState | None = None) -> GaussianState:
    """``total`` without ``part``: the exact reverse of the Chan et al. merge (a *downdate*).

    If ``total = merge(A, part)``, this returns ``A``: with ``n_a = n - n_b``,
    ``mean_a = (n mean - n_b mean_b) / n_a``, ``delta = mean_b - mean_a`` and
    ``M2_a = M2 - M2_b - delta delta^T * n_a * n_b / n``. Used to score a calibration fold with
    "every image but this fold" without fitting that model from scratch.

    Args:
        total: statistics of every image.
        part: statistics of some of those images (``part.count <= total.count``).
        out: where to write the result (may be ``part`` itself, to save a ``(P, D, D)`` buffer);
            a new state by default.

    Returns:
        The statistics of the images in ``total`` but not in ``part``.
    """
    _check_compatible(total, part)
    n, n_b = int(total.count), int(part.count)
    if n_b > n:
        raise ValueError(f"cannot remove {n_b} images from statistics of {n}")
    if out is None:
        out = empty_state(total.num_pixels, total.embedding_dim, total.mean.device)
    n_a = n - n_b
    if n_a == 0:
        out.count.zero_(), out.mean.zero_(), out.comoment.zero_()
        return out
    if n_b == 0:
        out.count.copy_(total.count), out.mean.copy_(total.mean), out.comoment.copy_(total.comoment)
        return out
    mean_a = (total.mean * n - part.mean * n_b) / n_a  # (P, D)
    delta = part.mean - mean_a  # (P, D)
    # out may alias part: read part.comoment before overwriting it
    torch.sub(total.comoment, part.comoment, out=out.comoment)
    out.comoment.baddbmm_(delta.unsqueeze(2), delta.unsqueeze(1), alpha=-n_a * n_b / n)
    out.mean.copy_(mean_a)
    out.count.fill_(n_a)
    return out


def update_state_(state: GaussianState, embedding: torch.Tensor) -> GaussianState:
    """Add one batch of ``(B, P, D)`` embeddings to ``state`` in place.

    The same Chan et al. update as :func:`merge_states_`, but the batch's centred outer
    products are added straight into ``state.comoment``: no second ``(P, D, D)`` buffer.
    """
    if embedding.ndim != 3 or embedding.shape[1:] != state.mean.shape:
        raise ValueError(
            f"cannot add a batch of shape {tuple(embedding.shape)} to statistics of (P, D)={tuple(state.mean.shape)}"
        )
    n_a, n_b = int(state.count), embedding.shape[0]
    x = embedding.to(ACCUMULATOR_DTYPE)
    batch_mean = x.mean(dim=0)  # (P, D)
    centred = (x - batch_mean).permute(1, 0, 2)  # (P, B, D)
    state.comoment.baddbmm_(centred.transpose(1, 2), centred)
    n = n_a + n_b
    delta = batch_mean - state.mean  # (P, D)
    if n_a:
        state.comoment.baddbmm_(delta.unsqueeze(2), delta.unsqueeze(1), alpha=n_a * n_b / n)
    state.mean.add_(delta, alpha=n_b / n)
    state.count.add_(n_b)
    return state


def all_reduce_state_(state: GaussianState, group=None) -> GaussianState:
    """Merge the states of every rank of a ``torch.distributed`` group, in place, on every rank.

    Exact, not an approximation: with ``N = sum n_r`` and ``mu = sum n_r mu_r / N``,
    ``M2 = sum_r [M2_r + n_r (mu_r - mu)(mu_r - mu)^T]``. Communicates two scalars, one
    ``(P, D)`` and one ``(P, D, D)`` float64 tensor, once. A rank that saw no images passes
    an :func:`empty_state` of the same shape.
    """
    import torch.distributed as dist

    count = state.count.to(ACCUMULATOR_DTYPE)
    dist.all_reduce(count, group=group)
    total = float(count)
    if total == 0:
        return state
    weighted = state.mean * float(state.count)
    dist.all_reduce(weighted, group=group)
    mean = weighted / total  # (P, D)
    delta = state.mean - mean
    state.comoment.baddbmm_(delta.unsqueeze(2), delta.unsqueeze(1), alpha=float(state.count))
    dist.all_reduce(state.comoment, group=group)
    state.mean.copy_(mean)
    state.count.fill_(int(round(total)))
    return state


def covariance(state: GaussianState) -> torch.Tensor:
    """Unbiased per-pixel covariance ``(P, D, D)`` (divides by ``n - 1``, as ``np.cov``)."""
    n = int(state.count)
    if n < 2:
        raise ValueError(f"a covariance needs at least 2 images, this accumulator has {n}")
    return state.comoment / (n - 1)


def regularised_cholesky(
    covariance: torch.Tensor,
    epsilon: float,
    grid_shape: tuple[int, int] | None = None,
    pixel_offset: int = 0,
) -> torch.Tensor:
    """Lower Cholesky factor ``L`` of ``Sigma + eps I`` for every pixel (Sec. III-B).

    Args:
        covariance: ``(P, D, D)`` symmetric matrices.
        epsilon: regularisation added to the diagonal (the paper uses 0.01).
        grid_shape: ``(H, W)`` of the feature grid, to name a failing pixel by row and column.
        pixel_offset: index of ``covariance[0]`` in the whole grid (when given a slice).

    Returns:
        ``(P, D, D)`` lower-triangular ``L`` with ``L L^T = Sigma + eps I``.

    Raises:
        NotPositiveDefiniteError: naming the first pixel whose matrix is not positive definite.
    """
    dim = covariance.shape[-1]
    eye = torch.eye(dim, dtype=covariance.dtype, device=covariance.device)
    cholesky, info = torch.linalg.cholesky_ex(covariance + epsilon * eye)
    bad = torch.nonzero(info).flatten()
    if bad.numel():
        pixel = int(bad[0]) + pixel_offset
        where = f"pixel {pixel}"
        if grid_shape is not None:
            where += f" (row {pixel // grid_shape[1]}, column {pixel % grid_shape[1]} of the {grid_shape[0]}x{grid_shape[1]} feature grid)"
        raise NotPositiveDefiniteError(
            f"the covariance at {where} is not positive definite even with epsilon={epsilon:g} "
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
    cholesky = regularised_cholesky(covariance, epsilon, grid_shape, pixel_offset)  # L
    eye = torch.eye(cholesky.shape[-1], dtype=cholesky.dtype, device=cholesky.device)
    return torch.linalg.solve_triangular(cholesky, eye.expand_as(cholesky), upper=False)  # W = L^-1


def finalise(
    state: GaussianState,
    epsilon: float,
    grid_shape: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    chunk_pixels: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and precision factors for scoring, computed in float64 a slice of pixels at a time.

    Slicing keeps the extra memory to a few ``(chunk, D, D)`` buffers instead of several copies
    of the whole ``(P, D, D)`` covariance.

    Returns:
        ``mean`` ``(P, D)`` and ``precision_factor`` ``(P, D, D)``, both in ``dtype``.
    """
    n = int(state.count)
    if n < 2:
        raise ValueError(f"a covariance needs at least 2 images, this accumulator has {n}")
    factors = torch.empty(state.comoment.shape, dtype=dtype, device=state.comoment.device)  # (P, D, D) W
    for start in range(0, state.num_pixels, chunk_pixels):
        part = state.comoment[start : start + chunk_pixels] / (n - 1)
        factors[start : start + chunk_pixels] = precision_factor(part, epsilon, grid_shape, start)
    return state.mean.to(dtype), factors


def precision(
    covariance: torch.Tensor, epsilon: float, grid_shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """Precision ``(Sigma + eps I)^-1`` ``(P, D, D)`` from the Cholesky factor (``cholesky_inverse``)."""
    return torch.cholesky_inverse(regularised_cholesky(covariance, epsilon, grid_shape))


def _check_compatible(a: GaussianState, b: GaussianState) -> None:
    if a.mean.shape != b.mean.shape:
        raise ValueError(
            f"cannot merge statistics of shape (P, D)={tuple(a.mean.shape)} "
            f"with (P, D)={tuple(b.mean.shape)}"
        )


class GaussianAccumulator:
    """Per-pixel mean and covariance, fed batch by batch (``partial_fit``, as sklearn).

    The shape ``(P, D)`` is taken from the first batch. ``fit`` is ``reset`` + ``partial_fit``;
    ``merge`` folds in another accumulator (resume, several workers).
    """

    def __init__(self, state: GaussianState | None = None) -> None:
        self.state = state

    def reset(self) -> GaussianAccumulator:
        self.state = None
        return self

    def partial_fit(self, embedding: torch.Tensor) -> GaussianAccumulator:
        """Add a ``(B, P, D)`` batch."""
        if self.state is None:
            self.state = batch_state(embedding)
        else:
            update_state_(self.state, embedding)
        return self

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
        return 0 if self.state is None else int(self.state.count)

    @property
    def mean(self) -> torch.Tensor:
        return self._fitted().mean

    def covariance(self) -> torch.Tensor:
        return covariance(self._fitted())

    def _fitted(self) -> GaussianState:
        if self.state is None:
            raise ValueError("this accumulator has seen no images yet")
        return self.state
