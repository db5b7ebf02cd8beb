"""The finish of a fit (:class:`Finish`), a slice of pixels at a time: the spooled pictures' comoment merged into the
earlier statistics, its Cholesky factor (shrunk and regularised), the precision factors into a scratch file with
their float16 check, and each scoring pass's distances (:mod:`padim.models.fit.fold_scores`)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from padim.core import SHRINKAGE_AUTO
from padim.core.packing import pack_lower, packed_length, unpack_lower
from padim.core.scoring import squared_mahalanobis
from padim.core.spool import ScratchFile
from padim.core.statistics import (
    GaussianState,
    PooledMoments,
    Shrinkage,
    add_centred_products_,
    empty_state,
    merge_comoment_,
    merged_mean,
    triangular_inverse,
)
from padim.core.tiling import Tiling
from padim.models.fit import distributed
from padim.models.fit.distributed import Shard
from padim.models.fit.fold_scores import FoldScoring, scoreable
from padim.models.fit.memory_plan import BLOCK_BYTES
from padim.models.fit.passes import Finished, Fitting, PixelSlice, Scored, ScoringPass, Spooled
from padim.models.options import ScoringOptions
from padim.models.scoring.detector import FLOAT16_TOLERANCE
from padim.models.scoring.model import score_distances

#: Pictures whose scores the float16 check compares (one batch).
FLOAT16_SAMPLE = 16


class Finish:
    """One finish of ``fit``: statistics, factors and scores (:meth:`run`).

    Args:
        fit: the fit in progress (its statistics and pass 1's spool).
        scratch: where the precision factors wait for the file (``None``: no factors, a partial fit).
        with_statistics: form the whole comoment in memory (for a file with statistics).
        progress: show progress bars.
        shard: this rank's share under ``torch.distributed``.
        timing: adds ``finish`` (statistics and factors) and ``calibrate`` (distances) seconds.
    """

    def __init__(
        self,
        fit: Fitting,
        scratch: Path | None,
        with_statistics: bool,
        progress: bool,
        shard: Shard | None,
        timing: dict[str, float],
    ):
        self.fit, self.with_statistics, self.progress, self.shard, self.timing = (
            fit,
            with_statistics,
            progress,
            shard,
            timing,
        )
        self.statistics = merged_statistics(fit, with_statistics)
        if self.statistics.count < 2 * fit.fitted_rows:
            raise ValueError(f"need at least 2 fitted images, have {self.statistics.count // fit.fitted_rows}")
        main = shard is None or shard.main
        self.slices = pixel_slices(fit)
        self.factors = ScratchFile(scratch, prefix=".padim-factors-") if scratch is not None and main else None
        self.shrinkage = Shrinkage(fit.config.gaussian.epsilon)
        self.tails = 1.0  # --shrinkage auto: how much more the covariances vary than a Gaussian's
        self.results = _Results()
        self.float16 = _Float16Check()

    def run(self, passes: Iterable[ScoringPass]) -> Finished:
        """Each pass goes over every slice. The first forms the comoment (kept in memory ``with_statistics``), factors
        it, writes the precision factors and scores its images (and its query rows, :attr:`ScoringPass.queries`, into
        :attr:`Finished.queried`); a later one (a group embedded again) factors the formed comoment again and scores
        its images. Without a pass: the statistics (and factors) alone.

        Raises:
            NotPositiveDefiniteError: a pixel whose matrix has no Cholesky factor (named).
        """
        fit = self.fit
        queried: Scored | None = None
        try:
            self.shrinkage = self._shrinkage()
            for number, scoring in enumerate(passes):
                queried = self._score_pass(scoring, first=number == 0) or queried
            if not self.results.passes:
                self._statistics_only()
        except BaseException:
            if self.factors is not None:
                self.factors.close()
            raise
        results = self.results.gathered(self.shard)  # every rank scored its own folds
        change = self.float16.change(fit.embedder.tiling, fit.config.scoring)
        return Finished(
            self.statistics.mean.to(torch.float32).cpu(),
            self.factors,
            _precision_dtype(fit.config.storage.factor_dtype, change),
            results.tensor(results.scores),
            results.names,
            results.unscored,
            change,
            results.tensor(results.input_distances),
            results.tensor(results.taken_scores) if fit.config.gaussian.expect else None,
            self._estimated(),
            queried,
        )

    def _samples(self) -> int:
        """The independent samples a pixel's covariance has for ``--shrinkage auto``: its rows, a picture's fitted
        copy not counted (it is the picture changed a little, not another picture; tiles sharing a Gaussian are)."""
        return int(self.statistics.count) // (2 if self.fit.config.copies_fitted else 1)

    def _estimated(self) -> dict | None:
        """What ``--shrinkage auto`` chose, and from what (``None`` for a weight given)."""
        if self.fit.config.gaussian.shrinkage != SHRINKAGE_AUTO:
            return None
        return {
            "weight": float(self.shrinkage.weight),
            "rows": int(self.statistics.count),
            "samples": self._samples(),
            "pixels": self.fit.pixels,
            "tails": round(self.tails, 4),
        }

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timing[phase] = self.timing.get(phase, 0.0) + time.perf_counter() - started

    def _score_pass(self, scoring: ScoringPass, first: bool) -> Scored | None:
        """One pass over the slices: form and factor each (the first pass writes the factors), then score
        ``scoring``'s images; their maps and scores join the results. Its query rows are scored by the same fold
        models in the same solves, and what they scored returned (``None`` without them)."""
        fit = self.fit
        kept = scoreable(scoring, self.statistics.count, self.results.unscored, fit.fitted_rows, fit.spooled_rows)
        current = FoldScoring(fit, scoring, kept, self.statistics.count, self.statistics.mean, self.shrinkage)
        with tqdm(
            total=fit.pixels, desc="finish" if first else "calibrate", unit="px", disable=not self.progress, leave=False
        ) as bar:
            for pixels in self.slices:
                covariance, cholesky = self._factor(pixels, forming=first)
                if first:
                    self._write_factors(pixels, cholesky, scoring)
                with self.timed("calibrate"):
                    score = functools.partial(current.score_slice, pixels, covariance, cholesky)
                    distributed.together(score, self.shard, fit.device)
                del covariance, cholesky
                bar.update(pixels.size)
        if first:
            self._formed()
        with self.timed("calibrate"):
            self.results.add(*current.image_scores())
            return None if scoring.queries is None else _scored(current, self.shard, bool(fit.config.gaussian.expect))

    def _factor(self, pixels: PixelSlice, forming: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Covariance ``C / (n - 1)`` and ``L`` of the slice's pixels (``L L^T`` the model's covariance, shrunk
        and regularised), forming (and keeping) the comoment first."""
        with self.timed("finish"):
            comoment = self._comoment(pixels, forming)
            covariance = comoment.div_(self.statistics.count - 1)  # (c, D, D)
            cholesky = self.shrinkage.cholesky(covariance, self.fit.naming_grid, pixels.start)
        return covariance, cholesky

    def _shrinkage(self) -> Shrinkage:
        """The model's :class:`~padim.core.statistics.Shrinkage`: its pooled covariance (and, with ``--shrinkage
        auto``, the weight estimated from the data) needs every pixel's comoment before any pixel is factored, so
        spooled images are formed once more here (a slice at a time, kept nowhere) when ``--shrinkage`` is set."""
        fit = self.fit
        epsilon, weight = fit.config.gaussian.epsilon, fit.config.gaussian.shrinkage
        state = self.statistics
        if not weight:
            return Shrinkage(epsilon)
        if state.spooled is None:
            holder = state.target if state.target is not None else state.base
            assert holder is not None, "without a spool the statistics hold every image"
            if weight == SHRINKAGE_AUTO:  # no pictures at hand: the tails the model was last estimated with
                self.tails = float((fit.provenance.shrinkage_estimated or {}).get("tails", 1.0))
                moments = PooledMoments.of(holder)
                return Shrinkage.of_moments(moments, self._samples(), epsilon, weight, self.tails).to(fit.device)
            return Shrinkage.of(holder, epsilon, weight).to(fit.device)
        moments = PooledMoments.empty(fit.embedder.embedding_dim)
        tails = moments if weight == SHRINKAGE_AUTO else None  # the spooled pictures' fourth moments too
        with (
            self.timed("finish"),
            tqdm(total=fit.pixels, desc="pool", unit="px", disable=not self.progress, leave=False) as bar,
        ):
            for pixels in self.slices:
                moments.add_(self._comoment(pixels, True, keep=False, tails=tails).div_(state.count - 1).cpu())
                bar.update(pixels.size)
        self.tails = moments.tails
        return Shrinkage.of_moments(moments, self._samples(), epsilon, weight).to(fit.device)

    def _write_factors(self, pixels: PixelSlice, cholesky: torch.Tensor, scoring: ScoringPass | None) -> None:
        """The slice's precision factors ``W = L^-1`` into the scratch file (float32, packed), and the float16
        check's distances of a few of ``scoring``'s pictures with them."""
        if self.factors is None:
            return
        fit = self.fit
        with self.timed("finish"):
            stored = triangular_inverse(cholesky).to(torch.float32)  # (c, D, D) W
            self.factors.write(pixels.start * packed_length(fit.embedder.embedding_dim) * 4, pack_lower(stored))
            sample = _sample(scoring, pixels, fit.spooled_rows) if scoring is not None else None
            if sample is not None:
                self.float16.add(sample.to(fit.device), self.statistics.mean[pixels.start : pixels.stop], stored)

    def _comoment(
        self, pixels: PixelSlice, forming: bool, keep: bool = True, tails: PooledMoments | None = None
    ) -> torch.Tensor:
        """Symmetric ``(c, D, D)`` float64 comoment of every image, for the slice's pixels (``forming``: from the
        spool, kept in the statistics unless ``keep`` is false; ``tails``: the spooled rows' fourth moments added
        to it, :meth:`~padim.core.statistics.PooledMoments.add_tails_`)."""
        fit, state, shard = self.fit, self.statistics, self.shard
        dim, start, stop = fit.embedder.embedding_dim, pixels.start, pixels.stop
        spooled = state.spooled
        if spooled is None or (not forming and state.target is not None):
            holder = state.target if state.target is not None else state.base
            assert holder is not None, "without a spool the statistics hold every image"
            return unpack_lower(holder.comoment[start:stop], dim, symmetric=True)
        assert spooled.mean is not None, "the spool's mean is set once pass 1 is over"
        mean = spooled.mean[start:stop]  # (c, D) of the spooled images: centred on their exact mean
        square = torch.empty(stop - start, dim, dim, dtype=torch.float64, device=fit.device)
        fourth = None if tails is None else torch.zeros(stop - start, dtype=torch.float64, device=fit.device)
        distributed.together(
            functools.partial(_spooled_square, fit, spooled, pixels, mean, square, fourth), shard, fit.device
        )
        if shard is not None:  # the lower triangle travels: half the bytes
            square = unpack_lower(distributed.sum_(pack_lower(square), shard), dim, symmetric=True)
            fourth = None if fourth is None else distributed.sum_(fourth, shard)
        if tails is not None and fourth is not None:
            tails.add_tails_(fourth, square, spooled.count)  # sums read back as numbers: no copy to the host
        if state.base is not None and int(state.base.count):  # Chan: merged with the earlier statistics
            earlier = unpack_lower(state.base.comoment[start:stop], dim, symmetric=True)
            merge_comoment_(square, mean, spooled.count, earlier, state.base.mean[start:stop], int(state.base.count))
        if forming and keep and state.target is not None:
            state.target.comoment[start:stop] = pack_lower(square)
        return square

    def _formed(self) -> None:
        """The spool's images are in the statistics now (kept in memory, or not at all for a slim file)."""
        state = self.statistics
        if self.fit.spooled is None:
            return
        if self.with_statistics:
            assert state.target is not None, "statistics kept: the merge named where they go"
            state.target.mean.copy_(state.mean)
            state.target.count.fill_(state.count)
            self.fit.formed(state.target, state.count)
        else:
            self.fit.formed(None, state.count)  # a slim file: no statistics, only their count
        state.base = None  # the comoment is formed: a second scoring pass reads it, not the spool
        state.spooled = None

    def _statistics_only(self) -> None:
        """The comoment (and factors) when nothing is scored: a partial fit, or images all unscoreable."""
        if self.statistics.spooled is None and self.factors is None:
            return
        with tqdm(total=self.fit.pixels, desc="finish", unit="px", disable=not self.progress, leave=False) as bar:
            for pixels in self.slices:
                if self.factors is None:
                    self._comoment(pixels, True)
                else:
                    _, cholesky = self._factor(pixels, forming=True)
                    self._write_factors(pixels, cholesky, None)
                bar.update(pixels.size)
        self._formed()


def _scored(scoring: FoldScoring, shard: Shard | None, expect: bool) -> Scored:
    """What ``scoring``'s query rows scored, every rank's (each scored its own folds)."""
    results = _Results()
    results.add(*scoring.image_scores(queries=True))
    results = results.gathered(shard)
    taken = results.tensor(results.taken_scores) if expect else None
    return Scored(results.names, results.tensor(results.scores), results.tensor(results.input_distances), taken)


def _spooled_square(
    fit: Fitting,
    spooled: Spooled,
    pixels: PixelSlice,
    mean: torch.Tensor,
    square: torch.Tensor,
    fourth: torch.Tensor | None = None,
) -> None:
    """This rank's comoment of its spooled rows at the slice's pixels, centred on ``mean``, into ``square``; with
    ``fourth`` ``(c,)``, their ``sum ||x - mean||^4`` added to it."""
    start, stop, dim = pixels.start, pixels.stop, fit.embedder.embedding_dim
    per = fit.spooled_rows  # blocks of whole pictures: their copies are told apart by place
    rows = max(per, BLOCK_BYTES // (8 * (stop - start) * dim) // per * per)
    if not spooled.spool.rows:  # a rank without images
        square.zero_()
    for first in range(0, spooled.spool.rows, rows):
        block = spooled.spool.read(pixels.index, first, min(first + rows, spooled.spool.rows))
        add_centred_products_(square, fit.reading.fitted(block).to(fit.device), mean, first == 0, fourth)


def pixel_slices(fit: Fitting) -> list[PixelSlice]:
    """The slices the finish works on: the spool's, or :attr:`~Fitting.slice_pixels` at a time."""
    step, pixels = fit.slice_pixels, fit.pixels
    bounds = fit.spooled.spool.slices if fit.spooled else [(p, min(p + step, pixels)) for p in range(0, pixels, step)]
    return [PixelSlice(index, start, stop) for index, (start, stop) in enumerate(bounds)]


def merged_statistics(fit: Fitting, with_statistics: bool) -> _State:
    """Count and mean of every image (earlier statistics and the spool), and where the comoment goes."""
    base, spooled = fit.statistics, fit.spooled
    if spooled is None:
        if base is None:
            raise ValueError("nothing has been fitted")
        return _State(int(base.count), base.mean, base, None, None)
    n_b = 0 if base is None else int(base.count)
    n_s = spooled.count
    assert spooled.mean is not None, "the spool's mean is set once pass 1 is over"
    n = n_b + n_s
    mean = spooled.mean if base is None else merged_mean(base.mean, n_b, spooled.mean, n_s)
    target = None
    if with_statistics:
        target = base if base is not None else empty_state(fit.pixels, fit.embedder.embedding_dim, fit.device)
    return _State(n, mean, target, base, spooled)


def _precision_dtype(choice: str, change: float | None) -> torch.dtype:
    """The factors' storage dtype: the configured one, or (``auto``) float16 where the check allows it."""
    if choice != "auto":
        return getattr(torch, choice)
    return torch.float16 if change is not None and change <= FLOAT16_TOLERANCE else torch.float32


def _sample(source: ScoringPass, pixels: PixelSlice, per_image: int = 1) -> torch.Tensor | None:
    rows = min(FLOAT16_SAMPLE * per_image, len(source.names))  # whole pictures (``per_image``: their spooled rows)
    return source.rows.read(pixels, 0, rows) if rows else None


@dataclass
class _State:
    """The statistics as the finish sees them: every image's count and mean, and where the comoment is.

    ``target`` receives the comoment as it is formed (``None`` for a slim file); ``base`` holds the
    earlier statistics; ``spooled`` the images whose comoment is still to form.
    """

    count: int
    mean: torch.Tensor
    target: GaussianState | None
    base: GaussianState | None
    spooled: Spooled | None


@dataclass
class _Results:
    """What the finish's passes scored (this rank's, until :meth:`gathered`): every scored picture's name, raw
    score, input distance and own score (its changed copy's is the raw score with ``expect``), and the fitted
    pictures left unscored."""

    names: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    input_distances: list[float] = field(default_factory=list)
    taken_scores: list[float] = field(default_factory=list)
    unscored: list[str] = field(default_factory=list)
    passes: int = 0

    def add(self, names: list[str], scores: torch.Tensor, inputs: torch.Tensor, taken: torch.Tensor) -> None:
        self.names += names
        self.scores += scores.tolist()
        self.input_distances += inputs.tolist()
        self.taken_scores += taken.tolist()
        self.passes += 1

    def gathered(self, shard: Shard | None) -> _Results:
        """Every rank's results, in rank order (this one's alone without ``torch.distributed``)."""
        if shard is None:
            return self
        together = _Results()
        for part in distributed.gather(self, shard):
            together.names += part.names
            together.scores += part.scores
            together.input_distances += part.input_distances
            together.taken_scores += part.taken_scores
            together.unscored += part.unscored
            together.passes += part.passes
        return together

    @staticmethod
    def tensor(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64)


@dataclass
class _Float16Check:
    """A few pictures' distances with float32 factors and with the same factors rounded to float16, slice by
    slice: the largest relative change of their image scores decides ``precision_dtype`` ``auto``."""

    exact: list[torch.Tensor] = field(default_factory=list)
    half: list[torch.Tensor] = field(default_factory=list)

    def add(self, sample: torch.Tensor, mean: torch.Tensor, factor: torch.Tensor) -> None:
        """``sample`` ``(B, c, D)`` at a slice of ``c`` pixels with its ``mean`` and float32 ``factor``."""
        mean = mean.to(torch.float32)
        self.exact.append(squared_mahalanobis(sample, mean, factor).cpu())
        self.half.append(squared_mahalanobis(sample, mean, factor.half().float()).cpu())

    def change(self, tiling: Tiling, scoring: ScoringOptions) -> float | None:
        """Largest relative change of the image scores (``None``: nothing was sampled)."""
        if not self.exact:
            return None
        first, second = (score_distances(torch.cat(d, 1), tiling, scoring).raw_scores for d in (self.exact, self.half))
        return float(((second - first).abs() / first.abs().clamp_min(1e-12)).max())
