"""A fit in progress (:class:`Fit`): the embedder, the statistics and the spooled embeddings.

A fit reads every normal image through the backbone **once**:

1. **fit** (:meth:`Fit.accumulate`): every image is embedded, in the order of its calibration
   fold, and its float32 embeddings go to an :class:`~padim.core.spool.EmbeddingSpool` on disk,
   while their count and sum are kept. When the spool does not fit on the disk
   (:meth:`Fit.spool_or_none` says so), the statistics are streamed into memory instead (the
   Chan update) and the calibration embeds the images again, in groups that fit in memory.
2. **finish** (:meth:`Fit.finish`), a slice of pixels at a time: the comoment of the spooled
   images (two passes over the spool, centred on their exact mean) merged into the earlier
   statistics (``--resume``); the Cholesky factor ``L`` of the fitted model; its precision
   factor ``W = L^-1``, written to a scratch file in float32 and checked against float16; and
   the out-of-fold distance of every image, by a rank-``m + 1`` correction of one
   factorisation per fold size (:mod:`padim.core.out_of_fold`: no fold model is fitted, no
   image is embedded again). The distances become maps and out-of-fold raw scores.

**Changed copies** (``expect``, :mod:`padim.models.data.changes`): every picture is embedded a
second time after one seeded draw of the declared changes, and its copy's rows follow its own in
the spool. The copy's out-of-fold distance (under the model without the picture's fold:
:func:`~padim.core.out_of_fold.fold_copy_squared_distances`) gives the picture's calibration
score; the picture's own gives its input distance (the drift reference stays the pictures as
taken). With ``fit_changes`` the copies are fitted too: a picture and its copy are then one
fold's members, and the copy's distance is a member's.

Memory holds the statistics (the packed comoment, when they are kept) and one slice's
temporaries; the precision factors stay on disk until the model file is written
(:func:`padim.models.fit.model_file.save_fitted`). Whole runs (a new fit, resume, partial fits
and their merge) are in :mod:`padim.models.fit.training`.

Under ``torch.distributed`` each rank fits whole folds (a balanced, contiguous share of them) into
its own spool; count and sum are all-reduced after pass 1, and every slice's comoment during
the finish. Every rank derives the factor of every slice and scores its own folds; rank 0 writes
the factors, and the scores are gathered.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm

from padim.core.calibration import Calibration, fold_of
from padim.core.out_of_fold import (
    fold_base,
    fold_copy_squared_distances,
    fold_squared_distances,
    held_out_squared_distances,
    refit_is_cheaper,
    refit_squared_distances,
)
from padim.core.packing import pack_lower, packed_length, unpack_lower
from padim.core.scoring import squared_mahalanobis
from padim.core.spool import EmbeddingSpool, ScratchFile
from padim.core.statistics import (
    ACCUMULATOR_DTYPE,
    GaussianAccumulator,
    GaussianState,
    Shrinkage,
    all_reduce_state_,
    empty_state,
    triangular_inverse,
)
from padim.core.tiling import Tiling
from padim.models.config import PadimConfig
from padim.models.data.changes import apply, seeded
from padim.models.data.images import decode_side, iter_decoded
from padim.models.devices import check_precision, resolve_device
from padim.models.features.backbones import WeightsInfo, build_backbone, used_state, weights_sha256
from padim.models.features.embedding import Embedding, FeatureEmbedder
from padim.models.fit import distributed
from padim.models.fit.distributed import Shard
from padim.models.fit.memory_plan import BLOCK_BYTES, REEMBED_GROUP_BYTES, SLICE_BYTES, UPDATE_BLOCK_BYTES, spool_fits
from padim.models.options import ScoringOptions
from padim.models.scoring.detector import FLOAT16_TOLERANCE, Provenance
from padim.models.scoring.model import score_distances

#: Pictures whose scores the float16 check compares (one batch).
FLOAT16_SAMPLE = 16


@dataclass(frozen=True)
class TrainingImage:
    """A normal image and its name (path relative to the data directory), which decides its fold."""

    path: Path
    name: str


@dataclass
class Accumulated:
    """What pass 1 found: images that could not be read, and the content digest of each image fitted."""

    unreadable: list[tuple[str, str]]  # (name, reason)
    digests: list[tuple[str, int]]  # (name, digest)


@dataclass
class Spooled:
    """This rank's images of pass 1, waiting in the spool: rows in fold order, and their sum.

    Attributes:
        spool: their ``(rows, P, D)`` float32 embeddings (with ``expect``, each picture's rows then its copy's).
        names: the image of every row.
        folds: rows per fold, one entry per non-empty fold of this rank, in row order.
        total: ``(P, D)`` float64 sum of this rank's fitted rows (not the copies, unless they are fitted).
        count, mean: of every rank's fitted rows, set once pass 1 is over (after the all-reduce).
    """

    spool: EmbeddingSpool
    names: list[str] = field(default_factory=list)
    folds: list[int] = field(default_factory=list)
    total: torch.Tensor | None = None
    fitted_rows: int = 0
    count: int = 0
    mean: torch.Tensor | None = None


@dataclass(frozen=True)
class PixelSlice:
    """Pixels ``start .. stop`` of a row of the statistics: the ``index``-th slice the finish works on."""

    index: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class Rows(Protocol):
    """Embeddings of the images a pass scores, read a slice of pixels and a range of rows at a time."""

    def read(self, pixels: PixelSlice, first: int, stop: int) -> torch.Tensor:
        """``(stop - first, c, D)`` embeddings of rows ``first .. stop`` at the slice's ``c`` pixels."""
        ...


@dataclass(frozen=True)
class SpooledRows:
    """Rows in a spool (pass 1's, or the held-out images of a merge), read slice by slice as it stores them."""

    spool: EmbeddingSpool

    def read(self, pixels: PixelSlice, first: int, stop: int) -> torch.Tensor:
        return self.spool.read(pixels.index, first, stop)


@dataclass(frozen=True)
class HeldRows:
    """Rows held in memory: ``(rows, P, D)`` embeddings (images embedded again, or held out)."""

    embeddings: torch.Tensor

    def read(self, pixels: PixelSlice, first: int, stop: int) -> torch.Tensor:
        return self.embeddings[first:stop, pixels.start : pixels.stop]


@dataclass
class ScoringPass:
    """Images the finish scores in one pass over the pixels, whole folds one after another.

    Attributes:
        rows: their embeddings (with ``expect``, each picture's rows then its changed copy's:
            :attr:`Fit.spooled_rows` a picture).
        names: the image of every row.
        folds: rows per fold in row order (out-of-fold scoring), or ``None``: scored by the fitted
            model itself (held-out images).
    """

    rows: Rows
    names: list[str]
    folds: list[int] | None


@dataclass
class Finished:
    """What a finished fit leaves for the model file: everything but the threshold.

    Attributes:
        mean: ``(P, D)`` float32 fitted mean.
        factors: the packed ``(P, T)`` float32 precision factors, on disk, row-major (``None``
            for a partial fit, which has no factors).
        precision_dtype: their storage dtype in the file (the float16 check's answer, or the config's).
        scores: ``(N,)`` float64 raw scores of the images scored (out-of-fold, or held-out).
        scored: the names of those images, in the order of ``scores``.
        input_distances: ``(N,)`` float64 their input distances (:mod:`padim.core.drift`), in the same order.
        taken_scores: ``(N,)`` float64 with ``expect``: the images' own raw scores, where ``scores`` are their
            changed copies'; ``None`` otherwise.
        unscored: names of fitted images left without an out-of-fold score (their fold holds all
            but fewer than two of the images).
        float16_change: largest relative change of the checked scores with float16 factors.
    """

    mean: torch.Tensor
    factors: ScratchFile | None
    precision_dtype: torch.dtype
    scores: torch.Tensor
    scored: list[str]
    unscored: list[str]
    float16_change: float | None = None
    input_distances: torch.Tensor | None = None
    taken_scores: torch.Tensor | None = None


class Fit:
    """A fit in progress: the embedder, the statistics and pass 1's spool; no factors, no threshold.

    Attributes:
        config: the detector configuration.
        weights, backbone_weights, embedding: what the embedder is built from (saved with the model).
        embedder: images -> ``(B, P, D)`` embeddings, on :attr:`device`.
        statistics: the statistics of every image whose comoment has been formed (``None`` before).
        spooled: pass 1's images still in the spool (their comoment is formed by :meth:`finish`).
        image_digests: content digests of every image fitted so far (for resume and merge).
        earlier: the calibration of the model this fit resumes (``None`` for a new fit).
        provenance: what earlier fits recorded (image counts, fits).
    """

    def __init__(
        self,
        config: PadimConfig,
        weights: WeightsInfo,
        backbone_weights: dict[str, torch.Tensor],
        embedding: Embedding,
        statistics: GaussianState | None = None,
        image_digests: torch.Tensor | None = None,
        earlier: Calibration | None = None,
        provenance: Provenance | None = None,
    ):
        self.config = config
        self.weights = weights
        self.backbone_weights = backbone_weights
        self.embedding = embedding
        self.device = resolve_device(config.run.device)
        check_precision(config.features.precision, self.device)
        self.embedder = FeatureEmbedder(config, backbone_weights, embedding).to(self.device)
        self.rows_per_image = self.embedder.rows_per_image  # a picture's rows of embeddings (its tiles when shared)
        self.statistics = None if statistics is None else statistics.to(self.device)
        self.spooled: Spooled | None = None
        self._slim_count = 0  # rows fitted into a slim fit, which keeps no statistics
        self.image_digests = torch.zeros(0, dtype=torch.int64) if image_digests is None else image_digests
        self.earlier = earlier
        self.provenance = provenance or Provenance()

    @classmethod
    def start(cls, config: PadimConfig) -> Fit:
        """A new fit: the backbone with its weights, the seeded channel reduction, no statistics."""
        backbone, weights = build_backbone(
            config.features.backbone, config.features.weights, config.features.seed, config.features.layers
        )
        backbone_weights = used_state(backbone, config.spec, config.features.layers)
        weights = WeightsInfo(weights.source, weights.detail, weights_sha256(backbone_weights))
        embedding = Embedding.create(
            config.spec,
            config.features.layers,
            config.embedding_dim_or_default(),
            config.features.reduction,
            config.features.seed,
            config.gaussian.neighbourhood,
        )
        return cls(config, weights, backbone_weights, embedding)

    @property
    def draft_to(self) -> int:
        """JPEGs are decoded down to this side (see :func:`~padim.models.data.images.decode_side`)."""
        return decode_side(self.config.input_shape)

    @property
    def count(self) -> int:
        """Images fitted: in the statistics, and in the spool waiting for :meth:`finish`."""
        held = int(self.statistics.count) if self.statistics is not None else self._slim_count
        return (held + (self.spooled.count if self.spooled is not None else 0)) // self.fitted_rows

    @property
    def pixels(self) -> int:
        """``p``: pixels of a row of the statistics (``T * P`` with a Gaussian per tile position)."""
        return self.embedder.pixels

    @property
    def fitted_rows(self) -> int:
        """A picture's rows in the statistics: its tiles when they share them, and its changed copy's when fitted."""
        return self.config.rows_per_picture

    @property
    def spooled_rows(self) -> int:
        """A picture's rows of embeddings in pass 1's spool: its own, then its changed copy's (``expect``)."""
        return self.config.spooled_rows_per_picture

    def per_row(self, values: Iterable) -> list:
        """One value per picture -> one per spooled row (:attr:`spooled_rows`: its tiles and its copy's)."""
        return [value for value in values for _ in range(self.spooled_rows)]

    def fitted(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of spooled ``rows`` (whole pictures) that go into the statistics: all but the copies, unless
        those are fitted."""
        if not self.config.gaussian.expect or self.config.copies_fitted:
            return rows
        return split_rows(rows, self.rows_per_image)[0]

    def embed(self, names: Sequence[str], images) -> torch.Tensor:
        """A batch's spooled rows: every picture's embeddings ``(T, P, D)``, then its changed copy's (``expect``:
        one draw of the declared changes, seeded by the picture's name)."""
        embedded = self.embedder(self.embedder.preprocess(images))
        if not self.config.gaussian.expect:
            return embedded
        expected = self.config.expected
        changed = [apply(image, expected.draw(seeded(name))) for name, image in zip(names, images, strict=True)]
        return interleaved(embedded, self.embedder(self.embedder.preprocess(changed)), self.rows_per_image)

    @property
    def naming_grid(self) -> tuple[int, int]:
        """The pixels as rows x columns (tile positions one under another), to name a failing pixel."""
        width = self.embedder.grid_shape[1]
        return self.pixels // width, width

    @property
    def slice_pixels(self) -> int:
        """Pixels per slice of the finish: one ``(c, D, D)`` float64 buffer in :data:`SLICE_BYTES`."""
        budget = SLICE_BYTES["cuda" if self.device.type == "cuda" else "cpu"]
        return max(1, min(self.pixels, budget // (8 * self.embedder.embedding_dim**2)))

    def groups(self, images: Sequence[TrainingImage]) -> list[list[TrainingImage]]:
        """``images`` grouped by calibration fold (fold order, then name); one image a fold for ``loo``."""
        ordered = sorted(images, key=lambda i: i.name)
        folds = self.config.gaussian.calibration_folds
        if isinstance(folds, str):  # "loo", the only word the option takes
            return [[image] for image in ordered]
        groups: list[list[TrainingImage]] = [[] for _ in range(folds)]
        for image in ordered:
            groups[fold_of(image.name, folds)].append(image)
        return groups

    def spool_or_none(self, directory: Path, rows: int) -> EmbeddingSpool | None:
        """A spool for ``rows`` images in ``directory``, or ``None`` when they would not fit its free disk."""
        rows *= self.spooled_rows
        if not spool_fits(directory, rows, self.pixels, self.embedder.embedding_dim):
            return None
        return EmbeddingSpool(directory, rows, self.pixels, self.embedder.embedding_dim, self.slice_pixels)

    # ------------------------------------------------------------------ pass 1
    def accumulate(
        self,
        groups: Sequence[Sequence[TrainingImage]],
        progress: bool = True,
        shard: Shard | None = None,
        spool: EmbeddingSpool | None = None,
    ) -> Accumulated:
        """Pass 1: embed every image of ``groups`` (this rank's whole folds under ``shard``).

        With a ``spool``, the embeddings go there (:attr:`spooled`) and :meth:`finish` forms
        their comoment; without one, they are added to :attr:`statistics` at once. Unreadable
        images are left out and returned.
        """
        mine = distributed.folds_of(groups, shard)
        name_of = {i.path: i.name for group in groups for i in group}
        if spool is None:  # batched as the calibration will embed them again: the same embeddings, bit for bit
            batches = [b for chunk in self._memory_groups(mine) for b in batches_of(chunk, self.config.run.batch_size)]
        else:
            batches = batches_of(mine, self.config.run.batch_size)
        unreadable: list[tuple[Path, str]] = []
        digests: list[tuple[str, int]] = []
        spooled = Spooled(spool) if spool is not None else None
        rows_fold: list[int] = []
        fitted_rows = 0
        accumulator = None
        if spooled is None:  # no spool: the statistics are streamed into memory
            base = self.statistics if shard is None or shard.main else None
            accumulator = GaussianAccumulator(base, block_bytes=UPDATE_BLOCK_BYTES)
        fold_of_path = {i.path: k for k, group in enumerate(mine) for i in group}
        total = sum(len(g) for g in mine)

        def run() -> None:
            nonlocal fitted_rows
            with tqdm(total=total, desc="fit", unit="img", disable=not progress, leave=False) as bar:
                for paths, images in iter_decoded(
                    batches, self.config.run.workers, unreadable, self.draft_to, self.config.framing.roi
                ):
                    embedded = self.embed([name_of[p] for p in paths], images)  # (B * spooled rows, P, D)
                    fitted = self.fitted(embedded)
                    fitted_rows += fitted.shape[0]
                    if spooled is not None:
                        spooled.spool.append(embedded)
                        batch_sum = fitted.sum(dim=0, dtype=ACCUMULATOR_DTYPE)
                        spooled.total = batch_sum if spooled.total is None else spooled.total.add_(batch_sum)
                        spooled.names += self.per_row(name_of[p] for p in paths)
                        rows_fold.extend(self.per_row(fold_of_path[p] for p in paths))
                        bar.set_postfix_str(f"embeddings spooled: {_megabytes(spooled.spool.nbytes)}", refresh=False)
                    else:
                        assert accumulator is not None, "no spool: the images go into the accumulator"
                        accumulator.partial_fit(fitted)
                    digests.extend((name_of[p], file_digest(p)) for p in paths)
                    bar.update(len(digests) + len(unreadable) - bar.n)  # images read so far, good or not

        distributed.together(run, shard, self.device)
        if spooled is not None:
            dim = self.embedder.embedding_dim
            total_sum = (
                spooled.total
                if spooled.total is not None
                else torch.zeros(self.pixels, dim, dtype=ACCUMULATOR_DTYPE, device=self.device)
            )
            count = torch.tensor(float(fitted_rows), dtype=ACCUMULATOR_DTYPE, device=self.device)
            distributed.sum_(total_sum, shard)
            distributed.sum_(count, shard)
            spooled.count = int(count)
            spooled.mean = total_sum / max(spooled.count, 1)
            spooled.total = None
            spooled.folds = run_lengths(rows_fold)
            self.spooled = spooled
        else:
            assert accumulator is not None, "no spool: the images went into the accumulator"
            statistics = accumulator.state
            if statistics is None:
                statistics = empty_state(self.pixels, self.embedder.embedding_dim, self.device)
            if shard is not None:
                statistics = all_reduce_state_(statistics)
            self.statistics = statistics
        found = distributed.gather(([(name_of[p], reason) for p, reason in unreadable], digests), shard)
        new = [d for _, part in found for d in part]
        self.image_digests = (
            torch.cat([self.image_digests, torch.tensor([d for _, d in new], dtype=torch.int64)]).sort().values
        )
        return Accumulated(sorted(x for part, _ in found for x in part), new)

    def embed_again(
        self, groups: Sequence[Sequence[TrainingImage]], progress: bool, shard: Shard | None
    ) -> Iterator[ScoringPass]:
        """The calibration without a spool: this rank's folds embedded again, a group that fits in memory at a time.

        Batched as pass 1 batched them without a spool, so that every image's embedding is the
        one its statistics hold (the out-of-fold correction removes exactly those).
        """
        mine = distributed.folds_of(groups, shard)
        with tqdm(
            total=sum(len(f) for f in mine),
            desc="calibrate: embedding again",
            unit="img",
            disable=not progress,
            leave=False,
        ) as bar:
            for chunk in self._memory_groups(mine):
                fold_of_path = {i.path: k for k, fold in enumerate(chunk) for i in fold}
                name_of = {i.path: i.name for fold in chunk for i in fold}
                names, rows_fold, parts = [], [], []
                for paths, images in iter_decoded(
                    batches_of(chunk, self.config.run.batch_size),
                    self.config.run.workers,
                    [],
                    self.draft_to,
                    self.config.framing.roi,
                ):
                    parts.append(self.embed([name_of[p] for p in paths], images).cpu())
                    names += self.per_row(name_of[p] for p in paths)
                    rows_fold += self.per_row(fold_of_path[p] for p in paths)
                    bar.update(len(paths))
                embedded = torch.cat(parts) if parts else torch.zeros(0, self.pixels, self.embedder.embedding_dim)
                yield ScoringPass(HeldRows(embedded), names, run_lengths(rows_fold))

    def _memory_groups(self, folds: Sequence[Sequence[TrainingImage]]) -> list[list[list[TrainingImage]]]:
        """Consecutive non-empty folds in groups whose float32 embeddings fit in :data:`REEMBED_GROUP_BYTES`."""
        per_image = self.spooled_rows * self.pixels * self.embedder.embedding_dim * 4
        chunks: list[list[list[TrainingImage]]] = []
        size = 0
        for fold in (f for f in folds if f):
            if not chunks or (size + len(fold)) * per_image > REEMBED_GROUP_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(list(fold))
            size += len(fold)
        return chunks

    # ------------------------------------------------------------------ finish
    def finish(
        self,
        passes: Iterable[ScoringPass],
        scratch: Path | None,
        with_statistics: bool = True,
        progress: bool = True,
        shard: Shard | None = None,
        timing: dict[str, float] | None = None,
    ) -> Finished:
        """Statistics, factors and scores, a slice of pixels at a time (module docstring).

        Each pass goes over every slice. The first forms the comoment (kept in memory ``with_statistics``), factors
        it, writes the precision factors and scores its images; a later one (a group embedded again) factors the
        formed comoment again and scores its images. Without a pass: the statistics (and factors) alone.

        Args:
            passes: the images to score, one :class:`ScoringPass` after another.
            scratch: where the precision factors wait for the file (``None``: no factors, a partial fit).
            with_statistics: form the whole comoment in memory (for a file with statistics).
            timing: adds ``finish`` (statistics and factors) and ``calibrate`` (distances) seconds.

        Raises:
            NotPositiveDefiniteError: a pixel whose matrix has no Cholesky factor (named).
        """
        statistics = self._merged_statistics(with_statistics)
        if statistics.count < 2 * self.fitted_rows:
            raise ValueError(f"need at least 2 fitted images, have {statistics.count // self.fitted_rows}")
        main = shard is None or shard.main
        run = _Finishing(
            statistics,
            self._pixel_slices(),
            ScratchFile(scratch, prefix=".padim-factors-") if scratch is not None and main else None,
            shard,
            {} if timing is None else timing,
            progress,
            with_statistics,
            Shrinkage(self.config.gaussian.epsilon),
        )
        try:
            run.shrinkage = self._shrinkage(run)
            for number, scoring in enumerate(passes):
                self._score_pass(run, scoring, first=number == 0)
            if not run.results.passes:
                self._statistics_only(run)
        except BaseException:
            if run.factors is not None:
                run.factors.close()
            raise
        results = run.results.gathered(shard)  # every rank scored its own folds
        change = run.float16.change(self.embedder.tiling, self.config.scoring)
        return Finished(
            statistics.mean.to(torch.float32).cpu(),
            run.factors,
            self._precision_dtype(change),
            results.tensor(results.scores),
            results.names,
            results.unscored,
            change,
            results.tensor(results.input_distances),
            results.tensor(results.taken_scores) if self.config.gaussian.expect else None,
        )

    # ------------------------------------------------------------------ finish, by step
    def _pixel_slices(self) -> list[PixelSlice]:
        """The slices the finish works on: the spool's, or :attr:`slice_pixels` at a time."""
        step = self.slice_pixels
        bounds = (
            self.spooled.spool.slices
            if self.spooled
            else [(p, min(p + step, self.pixels)) for p in range(0, self.pixels, step)]
        )
        return [PixelSlice(index, start, stop) for index, (start, stop) in enumerate(bounds)]

    def _score_pass(self, run: _Finishing, scoring: ScoringPass, first: bool) -> None:
        """One pass over the slices: form and factor each (the first pass writes the factors), then score
        ``scoring``'s images; their maps and scores join ``run``'s results."""
        current = _Pass(
            scoring,
            _scoreable(scoring, run.statistics.count, run.results.unscored, self.fitted_rows, self.spooled_rows),
            self.pixels,
        )
        with tqdm(
            total=self.pixels, desc="finish" if first else "calibrate", unit="px", disable=not run.progress, leave=False
        ) as bar:
            for pixels in run.slices:
                covariance, cholesky = self._factor(run, pixels, forming=first)
                if first:
                    self._write_factors(run, pixels, cholesky, scoring)
                with run.timed("calibrate"):
                    score = functools.partial(self._score_slice, run, current, pixels, covariance, cholesky)
                    distributed.together(score, run.shard, self.device)
                del covariance, cholesky
                bar.update(pixels.size)
        if first:
            self._formed(run.statistics, run.with_statistics)
        with run.timed("calibrate"):
            names = [name for rows in current.kept for name in rows[:: self.spooled_rows]]  # a picture's rows: one name
            run.results.add(names, *self._image_scores(current.squared))

    def _factor(self, run: _Finishing, pixels: PixelSlice, forming: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Covariance ``C / (n - 1)`` and ``L`` of the slice's pixels (``L L^T`` the model's covariance, shrunk
        and regularised), forming (and keeping) the comoment first."""
        with run.timed("finish"):
            comoment = self._comoment(run.statistics, pixels, forming, run.shard)
            covariance = comoment.div_(run.statistics.count - 1)  # (c, D, D)
            cholesky = run.shrinkage.cholesky(covariance, self.naming_grid, pixels.start)
        return covariance, cholesky

    def _shrinkage(self, run: _Finishing) -> Shrinkage:
        """The model's :class:`~padim.core.statistics.Shrinkage`: its pooled covariance needs every pixel's
        comoment before any pixel is factored, so spooled images are formed once more here (a slice at a time,
        kept nowhere) when ``--shrinkage`` is set."""
        epsilon, weight = self.config.gaussian.epsilon, self.config.gaussian.shrinkage
        state = run.statistics
        if not weight:
            return Shrinkage(epsilon)
        if state.spooled is None:
            holder = state.target if state.target is not None else state.base
            assert holder is not None, "without a spool the statistics hold every image"
            return Shrinkage.of(holder, epsilon, weight).to(self.device)
        total = torch.zeros(self.embedder.embedding_dim, self.embedder.embedding_dim, dtype=torch.float64)
        with (
            run.timed("finish"),
            tqdm(total=self.pixels, desc="pool", unit="px", disable=not run.progress, leave=False) as bar,
        ):
            for pixels in run.slices:
                total += self._comoment(state, pixels, True, run.shard, keep=False).sum(dim=0).cpu()
                bar.update(pixels.size)
        return Shrinkage.pooled(total, state.count, self.pixels, epsilon, weight).to(self.device)

    def _write_factors(
        self, run: _Finishing, pixels: PixelSlice, cholesky: torch.Tensor, scoring: ScoringPass | None
    ) -> None:
        """The slice's precision factors ``W = L^-1`` into the scratch file (float32, packed), and the float16
        check's distances of a few of ``scoring``'s pictures with them."""
        if run.factors is None:
            return
        with run.timed("finish"):
            stored = triangular_inverse(cholesky).to(torch.float32)  # (c, D, D) W
            run.factors.write(pixels.start * packed_length(self.embedder.embedding_dim) * 4, pack_lower(stored))
            sample = _sample(scoring, pixels, self.spooled_rows) if scoring is not None else None
            if sample is not None:
                run.float16.add(sample.to(self.device), run.statistics.mean[pixels.start : pixels.stop], stored)

    def _merged_statistics(self, with_statistics: bool) -> _State:
        """Count and mean of every image (earlier statistics and the spool), and where the comoment goes."""
        dim, pixels = self.embedder.embedding_dim, self.pixels
        base = self.statistics
        spooled = self.spooled
        if spooled is None:
            if base is None:
                raise ValueError("nothing has been fitted")
            return _State(int(base.count), base.mean, base, None, None)
        n_b = 0 if base is None else int(base.count)
        n_s = spooled.count
        assert spooled.mean is not None, "the spool's mean is set once pass 1 is over"
        n = n_b + n_s
        if base is None:
            mean = spooled.mean
        else:
            mean = base.mean + (spooled.mean - base.mean) * (n_s / n)
        target = None
        if with_statistics:
            target = base if base is not None else empty_state(pixels, dim, self.device)
        return _State(n, mean, target, base, spooled)

    def _comoment(
        self, state: _State, pixels: PixelSlice, forming: bool, shard: Shard | None, keep: bool = True
    ) -> torch.Tensor:
        """Symmetric ``(c, D, D)`` float64 comoment of every image, for the slice's pixels (``forming``: from the
        spool, kept in the statistics unless ``keep`` is false)."""
        dim, start, stop = self.embedder.embedding_dim, pixels.start, pixels.stop
        spooled = state.spooled
        if spooled is None or (not forming and state.target is not None):
            holder = state.target if state.target is not None else state.base
            assert holder is not None, "without a spool the statistics hold every image"
            return unpack_lower(holder.comoment[start:stop], dim, symmetric=True)
        assert spooled.mean is not None, "the spool's mean is set once pass 1 is over"
        mean = spooled.mean[start:stop]  # (c, D) of the spooled images: centred on their exact mean
        square = torch.empty(stop - start, dim, dim, dtype=torch.float64, device=self.device)

        def local() -> None:
            per = self.spooled_rows  # blocks of whole pictures: their copies are told apart by place
            rows = max(per, BLOCK_BYTES // (8 * (stop - start) * dim) // per * per)
            if not spooled.spool.rows:  # a rank without images
                square.zero_()
            for first in range(0, spooled.spool.rows, rows):
                block = spooled.spool.read(pixels.index, first, min(first + rows, spooled.spool.rows))
                x = self.fitted(block).to(self.device)
                centred = (x.to(torch.float64) - mean).transpose(0, 1)  # (c, R, D)
                square.baddbmm_(centred.transpose(1, 2), centred, beta=0.0 if first == 0 else 1.0)

        distributed.together(local, shard, self.device)
        if shard is not None:  # the lower triangle travels: half the bytes
            square = unpack_lower(distributed.sum_(pack_lower(square), shard), dim, symmetric=True)
        if state.base is not None and int(state.base.count):  # Chan: merge with the earlier statistics
            n_b, n_s = int(state.base.count), spooled.count
            delta = (mean - state.base.mean[start:stop]).unsqueeze(2)  # (c, D, 1)
            square.add_(unpack_lower(state.base.comoment[start:stop], dim, symmetric=True))
            square.baddbmm_(delta, delta.transpose(1, 2), alpha=n_b * n_s / (n_b + n_s))
        if forming and keep and state.target is not None:
            state.target.comoment[start:stop] = pack_lower(square)
        return square

    def _formed(self, state: _State, with_statistics: bool) -> None:
        """The spool's images are in the statistics now (kept in memory, or not at all for a slim file)."""
        if self.spooled is None:
            return
        if with_statistics:
            assert state.target is not None, "statistics kept: the merge named where they go"
            state.target.mean.copy_(state.mean)
            state.target.count.fill_(state.count)
            self.statistics = state.target
        else:
            self.statistics = None  # a slim file: no statistics, only their count
            self._slim_count = state.count
        self.spooled = None
        state.base = None  # the comoment is formed: a second scoring pass reads it, not the spool
        state.spooled = None

    def _statistics_only(self, run: _Finishing) -> None:
        """The comoment (and factors) when nothing is scored: a partial fit, or images all unscoreable."""
        if run.statistics.spooled is None and run.factors is None:
            return
        with tqdm(total=self.pixels, desc="finish", unit="px", disable=not run.progress, leave=False) as bar:
            for pixels in run.slices:
                if run.factors is None:
                    self._comoment(run.statistics, pixels, True, run.shard)
                else:
                    _, cholesky = self._factor(run, pixels, forming=True)
                    self._write_factors(run, pixels, cholesky, None)
                bar.update(pixels.size)
        self._formed(run.statistics, run.with_statistics)

    def _score_slice(
        self,
        run: _Finishing,
        current: _Pass,
        pixels: PixelSlice,
        covariance: torch.Tensor,
        cholesky: torch.Tensor,
    ) -> None:
        """Distances of the pass's images at the slice's pixels, into ``current.squared`` ``(N, P)``.

        Out-of-fold: the folds of each size share one base (one Cholesky factorisation of the
        slice per fold size, :func:`padim.core.out_of_fold.fold_base`), and are read and
        corrected in blocks of at most :data:`BLOCK_BYTES` of float64 embeddings.
        """
        dim, count = self.embedder.embedding_dim, run.statistics.count
        epsilon = run.shrinkage.prior  # fold distances with the prior, then unscaled (Shrinkage.unscaled)
        start, stop, source, squared = pixels.start, pixels.stop, current.scoring, current.squared
        mean = run.statistics.mean[start:stop]
        limit = max(1, BLOCK_BYTES // (8 * pixels.size * dim))  # rows per block
        if source.folds is None:  # held-out images: the fitted model itself
            rows = len(source.names)
            for first in range(0, rows, limit):
                x = source.rows.read(pixels, first, min(first + limit, rows)).to(self.device)
                squared[first : first + len(x), start:stop] = held_out_squared_distances(cholesky, mean, x).cpu()
            return
        folds: dict[int, list[tuple[int, int]]] = {}  # size -> [(first row in the source, first row in squared)]
        row = out = 0
        for m, kept in zip(source.folds, current.kept, strict=True):
            if kept:
                folds.setdefault(m, []).append((row, out))
                out += m
            row += m
        grid = self.naming_grid
        queried = bool(self.config.gaussian.expect) and not self.config.copies_fitted  # copies scored, not fitted
        for m, places in sorted(folds.items()):
            fitted = m // 2 if queried else m  # the fold's rows in the statistics
            refit = refit_is_cheaper(fitted, dim, len(places))
            base = None if refit else fold_base(covariance, count, fitted, epsilon, start, grid)
            per_block = max(1, limit // m)
            for first in range(0, len(places), per_block):
                block = places[first : first + per_block]
                x = torch.cat([source.rows.read(pixels, a, b) for a, b in _runs(block, m)]).to(self.device)
                x = x.to(torch.float64)  # (F m, c, D), fold after fold
                if queried:  # each picture's rows, then its copy's: members and queries of the same fold model
                    own, copied = split_rows(x, self.rows_per_image)  # (F m / 2, c, D) each
                    members = own.transpose(0, 1).reshape(pixels.size, len(block), fitted, dim)
                    copies = copied.transpose(0, 1).reshape(pixels.size, len(block), fitted, dim)
                else:
                    members, copies = x.transpose(0, 1).reshape(pixels.size, len(block), m, dim), None
                if refit:
                    values = refit_squared_distances(covariance, mean, count, members, epsilon, start, grid)
                    if copies is not None:
                        values = _rejoin(
                            values,
                            refit_squared_distances(covariance, mean, count, members, epsilon, start, grid, copies),
                            self.rows_per_image,
                        )
                else:
                    assert base is not None, "not refitted: the fold's base was formed"
                    values = fold_squared_distances(base, mean, count, members, start)
                    if copies is not None:
                        values = _rejoin(
                            values,
                            fold_copy_squared_distances(base, mean, count, members, copies, start),
                            self.rows_per_image,
                        )
                values = run.shrinkage.unscaled(values).cpu()  # (c, F, m)
                for f, (_, target) in enumerate(block):
                    squared[target : target + m, start:stop] = values[:, f].T
            del base

    def _image_scores(self, squared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw scores, input distances and the images' own raw scores ``(B,)`` from distances ``(N, p)`` of whole
        pictures: the pictures' maps (tiles stitched) as the scorer makes them and their scores (their changed
        copies' with ``expect``: the third value is then the pictures' own), and the mean of each picture's own
        distances."""
        scores, inputs, taken, config, rows = [], [], [], self.config, 64 * self.spooled_rows
        for first in range(0, squared.shape[0], rows):
            block = squared[first : first + rows]
            own, scored = split_rows(block, self.rows_per_image) if config.gaussian.expect else (block, block)
            out = score_distances(scored, self.embedder.tiling, config.scoring)
            scores.append(out.raw_scores)
            inputs.append(own.reshape(out.raw_scores.shape[0], -1).mean(1).to(torch.float64))
            taken.append(
                score_distances(own, self.embedder.tiling, config.scoring).raw_scores
                if config.gaussian.expect
                else out.raw_scores
            )
        if not scores:
            empty = torch.zeros(0, dtype=torch.float64)
            return empty, empty, empty
        return torch.cat(scores), torch.cat(inputs), torch.cat(taken).to(torch.float64)

    def _precision_dtype(self, change: float | None) -> torch.dtype:
        choice = self.config.storage.factor_dtype
        if choice != "auto":
            return getattr(torch, choice)
        return torch.float16 if change is not None and change <= FLOAT16_TOLERANCE else torch.float32


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


@dataclass
class _Pass:
    """A scoring pass in progress: its images, the rows of each fold that can be scored, and their ``(N, P)``
    distances (as the scorer's maps: float32)."""

    scoring: ScoringPass
    kept: list[list[str]]
    row_pixels: int
    squared: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.squared = torch.zeros(sum(len(rows) for rows in self.kept), self.row_pixels, dtype=torch.float32)


@dataclass
class _Finishing:
    """One finish: the statistics as it sees them, its slices, where the factors go, what it has scored."""

    statistics: _State
    slices: list[PixelSlice]
    factors: ScratchFile | None
    shard: Shard | None
    timing: dict[str, float]
    progress: bool
    with_statistics: bool
    shrinkage: Shrinkage
    results: _Results = field(default_factory=_Results)
    float16: _Float16Check = field(default_factory=_Float16Check)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timing[phase] = self.timing.get(phase, 0.0) + time.perf_counter() - started


def _scoreable(
    source: ScoringPass, count: int, unscored: list[str], per_image: int = 1, spooled: int | None = None
) -> list[list[str]]:
    """The row names of each fold that can be scored (its model keeps two images, of ``per_image`` rows each in the
    statistics, ``spooled`` in the source), the rest named in ``unscored`` (once a picture)."""
    spooled = spooled or per_image
    if source.folds is None:
        return [source.names]
    keep, row = [], 0
    for m in source.folds:
        names = source.names[row : row + m]
        if count - m // spooled * per_image >= 2 * per_image:
            keep.append(names)
        else:
            keep.append([])
            unscored += names[::spooled]
        row += m
    return keep


def _sample(source: ScoringPass, pixels: PixelSlice, per_image: int = 1) -> torch.Tensor | None:
    rows = min(FLOAT16_SAMPLE * per_image, len(source.names))  # whole pictures (``per_image``: their spooled rows)
    return source.rows.read(pixels, 0, rows) if rows else None


def _runs(places: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """``(first, stop)`` source rows of folds of ``size`` rows, adjacent folds read as one span."""
    spans: list[list[int]] = []
    for row, _ in places:
        if spans and spans[-1][1] == row:
            spans[-1][1] = row + size
        else:
            spans.append([row, row + size])
    return [(first, stop) for first, stop in spans]


def run_lengths(labels: Sequence) -> list[int]:
    """Lengths of the runs of equal consecutive ``labels``: rows per fold, the folds coming one after another."""
    return [len(list(run)) for _, run in itertools.groupby(labels)]


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.0f} MB" if nbytes < 1e10 else f"{nbytes / 1e9:,.1f} GB"


def file_digest(path: Path) -> int:
    """First 8 bytes of the sha256 of a file's content, as a signed int64 (a fitted image's identity)."""
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def batches_of(groups: Sequence[Sequence[TrainingImage]], batch_size: int) -> list[list[Path]]:
    """The paths of ``groups``, in order, in batches of ``batch_size`` (which may span groups: rows stay in order)."""
    paths = [i.path for group in groups for i in group]
    return [paths[s : s + batch_size] for s in range(0, len(paths), batch_size)]


def interleaved(originals: torch.Tensor, copies: torch.Tensor, per_image: int) -> torch.Tensor:
    """``(B T, ...)`` rows of pictures and ``(B T, ...)`` of their copies -> ``(2 B T, ...)``: each picture's ``T``
    rows, then its copy's."""
    pictures = originals.shape[0] // per_image
    shape = (pictures, per_image, *originals.shape[1:])
    return torch.stack([originals.reshape(shape), copies.reshape(shape)], dim=1).reshape(-1, *originals.shape[1:])


def split_rows(rows: torch.Tensor, per_image: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`interleaved`: the pictures' rows and their copies' rows."""
    pictures = rows.shape[0] // (2 * per_image)
    both = rows.reshape(pictures, 2, per_image, *rows.shape[1:])
    return both[:, 0].reshape(-1, *rows.shape[1:]), both[:, 1].reshape(-1, *rows.shape[1:])


def _rejoin(own: torch.Tensor, copies: torch.Tensor, per_image: int) -> torch.Tensor:
    """``(c, F, k T)`` distances of a fold's pictures and ``(c, F, k T)`` of their copies -> ``(c, F, 2 k T)`` in
    the source's row order (each picture's rows, then its copy's)."""
    pixels, folds = own.shape[:2]
    both = torch.stack([own.reshape(pixels, folds, -1, per_image), copies.reshape(pixels, folds, -1, per_image)], 3)
    return both.reshape(pixels, folds, -1)
