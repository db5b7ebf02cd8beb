"""Pass 1 of a fit (:class:`FirstPass`): every normal picture read through the backbone once, in the order of its
calibration fold, into pass 1's spool (or, where the spool does not fit on the disk, straight into the statistics);
and, without a spool, the calibration's pictures embedded again (:func:`embed_again`), a group that fits in memory
at a time.

Each is handed what it reads with (the pictures, the fit's :class:`~padim.models.fit.passes.Reading`, the
statistics it adds to) and returns what it made (:class:`PassOne`; the scoring passes): it does not call back into
the fit, which takes the result in (:meth:`~padim.models.fit.in_progress.Fit.accumulate`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from tqdm.auto import tqdm

from padim.core.spool import EmbeddingSpool
from padim.core.statistics import (
    ACCUMULATOR_DTYPE,
    GaussianAccumulator,
    GaussianState,
    RowSums,
    all_reduce_state_,
    empty_state,
    mean_of,
)
from padim.models.fit import distributed
from padim.models.fit.distributed import Shard
from padim.models.fit.memory_plan import REEMBED_GROUP_BYTES, UPDATE_BLOCK_BYTES
from padim.models.fit.passes import (
    Accumulated,
    HeldRows,
    Reading,
    ScoringPass,
    Spooled,
    TrainingImage,
    batches_of,
    file_digest,
    run_lengths,
)

T = TypeVar("T")


@dataclass
class PassOne:
    """What pass 1 made: what it found (unreadable pictures, digests, waits), and the pictures' rows held as the fit
    holds them: ``spooled`` (waiting in the spool for the finish to form their comoment) or ``statistics`` (the
    statistics it was handed with them added, without a spool); ``digests``: the content digest of every picture it
    fitted, on every rank."""

    found: Accumulated
    spooled: Spooled | None
    statistics: GaussianState | None
    digests: torch.Tensor


class FirstPass:
    """Pass 1 over ``groups`` (this rank's whole folds under ``shard``), read by ``reading``.

    With a ``spool``, the embeddings go there and the finish forms their comoment; without one, they are added to
    ``statistics`` (the fit's so far: ``None`` for none) at once, in place. ``pixels``: of a row of the statistics.
    ``queries``: where the int8 scorer's query rows of every batch go (:meth:`Reading.embed_and_query`), beside the
    spool.
    """

    def __init__(
        self,
        reading: Reading,
        groups: Sequence[Sequence[TrainingImage]],
        shard: Shard | None,
        spool: EmbeddingSpool | None,
        statistics: GaussianState | None,
        pixels: int,
        queries: EmbeddingSpool | None = None,
    ):
        self.reading, self.shard, self.pixels, self.queries = reading, shard, pixels, queries
        assert queries is None or (spool is not None and reading.queries is not None), "queries beside a spool"
        self.mine = distributed.folds_of(groups, shard)
        self.name_of = {i.path: i.name for group in groups for i in group}
        self.fold_of_path = {i.path: k for k, group in enumerate(self.mine) for i in group}
        self.spooled = Spooled(spool) if spool is not None else None
        self.accumulator: GaussianAccumulator | None = None
        self.sums = RowSums()  # of the spooled rows fitted: their mean
        if spool is None:  # no spool: the statistics are streamed into memory
            base = statistics if shard is None or shard.main else None
            self.accumulator = GaussianAccumulator(base, block_bytes=UPDATE_BLOCK_BYTES)
        self.unreadable: list[tuple[Path, str]] = []
        self.digests: list[tuple[str, int]] = []
        self.rows_fold: list[int] = []  # the fold of every spooled row
        self.waited = 0.0  # seconds pass 1 waited for decoded pictures (and their copies): not the backbone

    def run(self, progress: bool) -> PassOne:
        """Embed every picture, spooled or into the statistics; unreadable pictures are left out and said."""
        distributed.together(functools.partial(self._embed_all, progress), self.shard, self.reading.device)
        spooled, statistics = None, None
        if self.spooled is not None:
            spooled = self._spooled(self.spooled)
        else:
            statistics = self._streamed()
        found, digests = self._found()
        return PassOne(found, spooled, statistics, digests)

    def _batches(self) -> list[list[Path]]:
        batch_size = self.reading.config.run.batch_size
        if self.spooled is None:  # batched as the calibration will embed them again: the same embeddings, bit for bit
            groups = memory_groups(self.reading, self.pixels, self.mine)
            return [b for chunk in groups for b in batches_of(chunk, batch_size)]
        return batches_of(self.mine, batch_size)

    def _embed_all(self, progress: bool) -> None:
        reading, total = self.reading, sum(len(g) for g in self.mine)
        with tqdm(total=total, desc="fit", unit="img", disable=not progress, leave=False) as bar:
            decoded = reading.decoded(self._batches(), self.unreadable, self.name_of.__getitem__)
            for paths, images, copies in _waited_for(decoded, self):
                names = [self.name_of[p] for p in paths]
                rows, asked = reading.embed_and_query(names, images, copies)  # (B * spooled rows, P, D) each
                self._add(paths, rows)
                if self.queries is not None:
                    assert asked is not None, "the int8 embedder is set where its rows are spooled"
                    self.queries.append(asked)  # the same rows, by the int8 backbone
                if self.spooled is not None:
                    bar.set_postfix_str(f"embeddings spooled: {_megabytes(self.spooled.spool.nbytes)}", refresh=False)
                bar.update(len(self.digests) + len(self.unreadable) - bar.n)  # images read so far, good or not

    def _add(self, paths: list[Path], embedded: torch.Tensor) -> None:
        """One batch's spooled rows into the spool (and its sum), or into the accumulator."""
        reading, spooled = self.reading, self.spooled
        fitted = reading.fitted(embedded)
        if spooled is not None:
            spooled.spool.append(embedded)
            self.sums.add_(fitted)
            spooled.names += reading.per_row(self.name_of[p] for p in paths)
            self.rows_fold.extend(reading.per_row(self.fold_of_path[p] for p in paths))
        else:
            assert self.accumulator is not None, "no spool: the images go into the accumulator"
            self.accumulator.partial_fit(fitted)
        self.digests.extend((self.name_of[p], file_digest(p)) for p in paths)

    def _spooled(self, spooled: Spooled) -> Spooled:
        """Every rank's count and mean of the spooled rows, agreed: the spool as the finish reads it."""
        device = self.reading.device
        total_sum = self.sums.sum_or_zeros(self.pixels, self.reading.embedder.embedding_dim, device)
        count = torch.tensor(float(self.sums.count), dtype=ACCUMULATOR_DTYPE, device=device)
        distributed.sum_(total_sum, self.shard)
        distributed.sum_(count, self.shard)
        spooled.count = int(count)
        spooled.mean = mean_of(total_sum, spooled.count)
        self.sums = RowSums()
        spooled.folds = run_lengths(self.rows_fold)
        return spooled

    def _streamed(self) -> GaussianState:
        """The accumulated statistics, every rank's all-reduced."""
        assert self.accumulator is not None, "no spool: the images went into the accumulator"
        statistics = self.accumulator.state
        if statistics is None:
            statistics = empty_state(self.pixels, self.reading.embedder.embedding_dim, self.reading.device)
        if self.shard is not None:
            statistics = all_reduce_state_(statistics)
        return statistics

    def _found(self) -> tuple[Accumulated, torch.Tensor]:
        """Every rank's unreadable pictures and digests, and the digests as a tensor."""
        unreadable = [(self.name_of[p], reason) for p, reason in self.unreadable]
        found = distributed.gather((unreadable, self.digests), self.shard)
        new = [d for _, part in found for d in part]
        digests = torch.tensor([d for _, d in new], dtype=torch.int64)
        return Accumulated(sorted(x for part, _ in found for x in part), new, round(self.waited, 3)), digests


def embed_again(
    reading: Reading, pixels: int, groups: Sequence[Sequence[TrainingImage]], progress: bool, shard: Shard | None
) -> Iterator[ScoringPass]:
    """The calibration without a spool: this rank's folds embedded again, a group that fits in memory at a time
    (``pixels``: of a row of the statistics).

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
        for chunk in memory_groups(reading, pixels, mine):
            fold_of_path = {i.path: k for k, fold in enumerate(chunk) for i in fold}
            name_of = {i.path: i.name for fold in chunk for i in fold}
            names, rows_fold, parts = [], [], []
            for paths, images, copies in reading.decoded(
                batches_of(chunk, reading.config.run.batch_size), [], name_of.__getitem__
            ):
                parts.append(reading.embed([name_of[p] for p in paths], images, copies).cpu())
                names += reading.per_row(name_of[p] for p in paths)
                rows_fold += reading.per_row(fold_of_path[p] for p in paths)
                bar.update(len(paths))
            embedded = torch.cat(parts) if parts else torch.zeros(0, pixels, reading.embedder.embedding_dim)
            yield ScoringPass(HeldRows(embedded), names, run_lengths(rows_fold))


def memory_groups(
    reading: Reading, pixels: int, folds: Sequence[Sequence[TrainingImage]]
) -> list[list[list[TrainingImage]]]:
    """Consecutive non-empty folds in groups whose float32 embeddings fit in :data:`REEMBED_GROUP_BYTES`."""
    per_image = reading.spooled_rows * pixels * reading.embedder.embedding_dim * 4
    chunks: list[list[list[TrainingImage]]] = []
    size = 0
    for fold in (f for f in folds if f):
        if not chunks or (size + len(fold)) * per_image > REEMBED_GROUP_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(list(fold))
        size += len(fold)
    return chunks


def _waited_for(items: Iterator[T], into: FirstPass) -> Iterator[T]:
    """``items``, adding the seconds each took to arrive to ``into.waited``."""
    while True:
        started = time.perf_counter()
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            into.waited += time.perf_counter() - started
        yield item


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.0f} MB" if nbytes < 1e10 else f"{nbytes / 1e9:,.1f} GB"
