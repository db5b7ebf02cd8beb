"""Pass 1 of a fit (:class:`FirstPass`): every normal picture read through the backbone once, in the order of its
calibration fold, into pass 1's spool (or, where the spool does not fit on the disk, straight into the statistics);
and, without a spool, the calibration's pictures embedded again (:func:`embed_again`), a group that fits in memory
at a time."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from tqdm.auto import tqdm

from padim.core.spool import EmbeddingSpool
from padim.core.statistics import ACCUMULATOR_DTYPE, GaussianAccumulator, all_reduce_state_, empty_state
from padim.models.fit import distributed
from padim.models.fit.distributed import Shard
from padim.models.fit.memory_plan import REEMBED_GROUP_BYTES, UPDATE_BLOCK_BYTES
from padim.models.fit.passes import (
    Accumulated,
    Fitting,
    HeldRows,
    ScoringPass,
    Spooled,
    TrainingImage,
    batches_of,
    file_digest,
    run_lengths,
)

T = TypeVar("T")


class FirstPass:
    """Pass 1 over ``groups`` (this rank's whole folds under ``shard``) of ``fit``.

    With a ``spool``, the embeddings go there (the fit's ``spooled``) and the finish forms their comoment; without
    one, they are added to the fit's statistics at once.
    """

    def __init__(
        self,
        fit: Fitting,
        groups: Sequence[Sequence[TrainingImage]],
        shard: Shard | None,
        spool: EmbeddingSpool | None,
    ):
        self.fit, self.shard = fit, shard
        self.mine = distributed.folds_of(groups, shard)
        self.name_of = {i.path: i.name for group in groups for i in group}
        self.fold_of_path = {i.path: k for k, group in enumerate(self.mine) for i in group}
        self.spooled = Spooled(spool) if spool is not None else None
        self.accumulator: GaussianAccumulator | None = None
        if spool is None:  # no spool: the statistics are streamed into memory
            base = fit.statistics if shard is None or shard.main else None
            self.accumulator = GaussianAccumulator(base, block_bytes=UPDATE_BLOCK_BYTES)
        self.unreadable: list[tuple[Path, str]] = []
        self.digests: list[tuple[str, int]] = []
        self.rows_fold: list[int] = []  # the fold of every spooled row
        self.fitted_rows = 0
        self.waited = 0.0  # seconds pass 1 waited for decoded pictures (and their copies): not the backbone

    def run(self, progress: bool) -> Accumulated:
        """Embed every picture; the fit then holds them (spooled, or in its statistics). Unreadable pictures are left
        out and returned, with the content digest of each picture fitted."""
        distributed.together(functools.partial(self._embed_all, progress), self.shard, self.fit.device)
        if self.spooled is not None:
            self._spooled(self.spooled)
        else:
            self._streamed()
        return self._found()

    def _batches(self) -> list[list[Path]]:
        batch_size = self.fit.config.run.batch_size
        if self.spooled is None:  # batched as the calibration will embed them again: the same embeddings, bit for bit
            return [b for chunk in memory_groups(self.fit, self.mine) for b in batches_of(chunk, batch_size)]
        return batches_of(self.mine, batch_size)

    def _embed_all(self, progress: bool) -> None:
        fit, total = self.fit, sum(len(g) for g in self.mine)
        with tqdm(total=total, desc="fit", unit="img", disable=not progress, leave=False) as bar:
            decoded = fit.decoded(self._batches(), self.unreadable, self.name_of.__getitem__)
            for paths, images, copies in _waited_for(decoded, self):
                names = [self.name_of[p] for p in paths]
                self._add(paths, fit.embed(names, images, copies))  # (B * spooled rows, P, D)
                if self.spooled is not None:
                    bar.set_postfix_str(f"embeddings spooled: {_megabytes(self.spooled.spool.nbytes)}", refresh=False)
                bar.update(len(self.digests) + len(self.unreadable) - bar.n)  # images read so far, good or not

    def _add(self, paths: list[Path], embedded: torch.Tensor) -> None:
        """One batch's spooled rows into the spool (and its sum), or into the accumulator."""
        fit, spooled = self.fit, self.spooled
        fitted = fit.fitted(embedded)
        self.fitted_rows += fitted.shape[0]
        if spooled is not None:
            spooled.spool.append(embedded)
            batch_sum = fitted.sum(dim=0, dtype=ACCUMULATOR_DTYPE)
            spooled.total = batch_sum if spooled.total is None else spooled.total.add_(batch_sum)
            spooled.names += fit.per_row(self.name_of[p] for p in paths)
            self.rows_fold.extend(fit.per_row(self.fold_of_path[p] for p in paths))
        else:
            assert self.accumulator is not None, "no spool: the images go into the accumulator"
            self.accumulator.partial_fit(fitted)
        self.digests.extend((self.name_of[p], file_digest(p)) for p in paths)

    def _spooled(self, spooled: Spooled) -> None:
        """Every rank's count and mean of the spooled rows, agreed; the spool handed to the fit."""
        fit = self.fit
        total_sum = (
            spooled.total
            if spooled.total is not None
            else torch.zeros(fit.pixels, fit.embedder.embedding_dim, dtype=ACCUMULATOR_DTYPE, device=fit.device)
        )
        count = torch.tensor(float(self.fitted_rows), dtype=ACCUMULATOR_DTYPE, device=fit.device)
        distributed.sum_(total_sum, self.shard)
        distributed.sum_(count, self.shard)
        spooled.count = int(count)
        spooled.mean = total_sum / max(spooled.count, 1)
        spooled.total = None
        spooled.folds = run_lengths(self.rows_fold)
        fit.spooled = spooled

    def _streamed(self) -> None:
        """The accumulated statistics (every rank's, all-reduced) become the fit's."""
        assert self.accumulator is not None, "no spool: the images went into the accumulator"
        statistics = self.accumulator.state
        if statistics is None:
            statistics = empty_state(self.fit.pixels, self.fit.embedder.embedding_dim, self.fit.device)
        if self.shard is not None:
            statistics = all_reduce_state_(statistics)
        self.fit.statistics = statistics

    def _found(self) -> Accumulated:
        """Every rank's unreadable pictures and digests; the new digests join the fit's."""
        unreadable = [(self.name_of[p], reason) for p, reason in self.unreadable]
        found = distributed.gather((unreadable, self.digests), self.shard)
        new = [d for _, part in found for d in part]
        digests = torch.tensor([d for _, d in new], dtype=torch.int64)
        self.fit.image_digests = torch.cat([self.fit.image_digests, digests]).sort().values
        return Accumulated(sorted(x for part, _ in found for x in part), new, round(self.waited, 3))


def embed_again(
    fit: Fitting, groups: Sequence[Sequence[TrainingImage]], progress: bool, shard: Shard | None
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
        for chunk in memory_groups(fit, mine):
            fold_of_path = {i.path: k for k, fold in enumerate(chunk) for i in fold}
            name_of = {i.path: i.name for fold in chunk for i in fold}
            names, rows_fold, parts = [], [], []
            for paths, images, copies in fit.decoded(
                batches_of(chunk, fit.config.run.batch_size), [], name_of.__getitem__
            ):
                parts.append(fit.embed([name_of[p] for p in paths], images, copies).cpu())
                names += fit.per_row(name_of[p] for p in paths)
                rows_fold += fit.per_row(fold_of_path[p] for p in paths)
                bar.update(len(paths))
            embedded = torch.cat(parts) if parts else torch.zeros(0, fit.pixels, fit.embedder.embedding_dim)
            yield ScoringPass(HeldRows(embedded), names, run_lengths(rows_fold))


def memory_groups(fit: Fitting, folds: Sequence[Sequence[TrainingImage]]) -> list[list[list[TrainingImage]]]:
    """Consecutive non-empty folds in groups whose float32 embeddings fit in :data:`REEMBED_GROUP_BYTES`."""
    per_image = fit.spooled_rows * fit.pixels * fit.embedder.embedding_dim * 4
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
