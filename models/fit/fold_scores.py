"""The calibration's distances (:class:`FoldScoring`): each picture of a scoring pass scored by the model without its
own fold, a slice of pixels at a time, by a correction of one factorisation per fold size
(:mod:`padim.core.out_of_fold`: no fold model is fitted); held-out pictures by the fitted model itself. The
distances become maps and raw scores as the scorer makes them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from padim.core.out_of_fold import (
    fold_and_copy_squared_distances,
    fold_base,
    fold_squared_distances,
    held_out_squared_distances,
    refit_is_cheaper,
    refit_squared_distances,
    single_inverse,
)
from padim.core.statistics import Shrinkage
from padim.models.fit.memory_plan import BLOCK_BYTES
from padim.models.fit.passes import Fitting, PixelSlice, ScoringPass, split_rows
from padim.models.scoring.model import score_distances


class FoldScoring:
    """A scoring pass in progress: its pictures, the rows of each fold that can be scored (``kept``:
    :func:`scoreable`), and their ``(N, P)`` distances (as the scorer's maps: float32).

    Args:
        fit: the fit in progress (its configuration and embedder).
        scoring: the pass's pictures (with :attr:`~padim.models.fit.passes.ScoringPass.queries`: their query rows,
            each under the same fold model, into :attr:`asked`, in the same triangular solves).
        kept: the row names of each fold that can be scored.
        count, mean: of every fitted row.
        shrinkage: the model's (its prior is the fold models' regularisation).
    """

    def __init__(
        self,
        fit: Fitting,
        scoring: ScoringPass,
        kept: list[list[str]],
        count: int,
        mean: torch.Tensor,
        shrinkage: Shrinkage,
    ):
        self.fit, self.scoring, self.kept, self.count, self.mean, self.shrinkage = (
            fit,
            scoring,
            kept,
            count,
            mean,
            shrinkage,
        )
        self.squared = torch.zeros(sum(len(rows) for rows in kept), fit.pixels, dtype=torch.float32)
        self.asked = None if scoring.queries is None else torch.zeros_like(self.squared)  # the query rows'

    def score_slice(self, pixels: PixelSlice, covariance: torch.Tensor, cholesky: torch.Tensor) -> None:
        """Distances of the pass's images at the slice's pixels, into :attr:`squared`.

        Out-of-fold: the folds of each size share one base (one Cholesky factorisation of the
        slice per fold size, :func:`padim.core.out_of_fold.fold_base`), and are read and
        corrected in blocks of at most :data:`BLOCK_BYTES` of float64 embeddings.
        """
        source, squared, start, stop = self.scoring, self.squared, pixels.start, pixels.stop
        mean = self.mean[start:stop]
        limit = max(1, BLOCK_BYTES // (8 * pixels.size * self.fit.embedder.embedding_dim))  # rows per block
        if source.folds is None:  # held-out images: the fitted model itself
            assert source.queries is None, "queries are scored out-of-fold"
            rows = len(source.names)
            for first in range(0, rows, limit):
                x = source.rows.read(pixels, first, min(first + limit, rows)).to(self.fit.device)
                squared[first : first + len(x), start:stop] = held_out_squared_distances(cholesky, mean, x).cpu()
            return
        for m, places in sorted(self._folds_by_size().items()):
            self._score_folds(pixels, covariance, mean, m, places, limit)

    def _folds_by_size(self) -> dict[int, list[tuple[int, int]]]:
        """Fold size -> ``[(first row in the source, first row in squared)]`` of every fold that is scored."""
        folds: dict[int, list[tuple[int, int]]] = {}
        row = out = 0
        assert self.scoring.folds is not None, "out-of-fold: the pass names its folds"
        for m, kept in zip(self.scoring.folds, self.kept, strict=True):
            if kept:
                folds.setdefault(m, []).append((row, out))
                out += m
            row += m
        return folds

    def _score_folds(
        self,
        pixels: PixelSlice,
        covariance: torch.Tensor,
        mean: torch.Tensor,
        m: int,
        places: list[tuple[int, int]],
        limit: int,
    ) -> None:
        """The folds of ``m`` rows at ``places``, a block of whole folds at a time, under one base (or refitted,
        where that is cheaper): the members' distances, and those of the copies and query rows scored by the same
        fold models, the copies in the members' float64 solve and the query rows in a float32 one
        (:func:`~padim.core.out_of_fold.fold_and_copy_squared_distances`' ``single``)."""
        fit, count, start = self.fit, self.count, pixels.start
        dim, grid, per_image = fit.embedder.embedding_dim, fit.naming_grid, fit.rows_per_image
        epsilon = self.shrinkage.prior  # fold distances with the prior, then unscaled (Shrinkage.unscaled)
        queried = bool(fit.config.gaussian.expect) and not fit.config.copies_fitted  # copies scored, not fitted
        fitted = m // 2 if queried else m  # the fold's rows in the statistics
        refit = refit_is_cheaper(fitted, dim, len(places))
        base = None if refit else fold_base(covariance, count, fitted, epsilon, start, grid)
        asked = self.scoring.queries
        inverse = None if base is None or asked is None or m == 1 else single_inverse(base)  # every fold's
        per_block = max(1, limit // (m if asked is None else m + (m + 1) // 2))  # query rows: float32, half a row
        for first in range(0, len(places), per_block):
            block = places[first : first + per_block]
            members, scored, single = self._block_rows(pixels, _runs(block, m), len(block), m, queried)
            if refit:  # one factorisation a fold for the members and the rest
                both = torch.cat([members, *(t.to(members.dtype) for t in (scored, single) if t is not None)], dim=2)
                found = refit_squared_distances(covariance, mean, count, members, epsilon, start, grid, both)
                values, rest = found[:, :, :fitted], found[:, :, fitted:]
            elif scored is None and single is None:
                assert base is not None, "not refitted: the fold's base was formed"
                values, rest = fold_squared_distances(base, mean, count, members, start), None
            else:
                assert base is not None, "not refitted: the fold's base was formed"
                values, rest = fold_and_copy_squared_distances(
                    base, mean, count, members, scored, start, single, inverse
                )
            if queried:
                assert rest is not None, "the copies were scored"
                values = _rejoin(values, rest[:, :, :fitted], per_image)
            values = self.shrinkage.unscaled(values).cpu()  # (c, F, m)
            for f, (_, target) in enumerate(block):
                self.squared[target : target + m, start : pixels.stop] = values[:, f].T
            if self.asked is not None:  # set where the pass has query rows
                assert rest is not None, "the query rows were scored"
                query = self.shrinkage.unscaled(rest[:, :, rest.shape[2] - m :]).cpu()  # (c, F, m)
                for f, (_, target) in enumerate(block):
                    self.asked[target : target + m, start : pixels.stop] = query[:, f].T

    def _block_rows(
        self, pixels: PixelSlice, runs: list[tuple[int, int]], folds: int, m: int, queried: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A block of ``folds`` folds of ``m`` rows (``runs``: their source spans), each ``(c, F, rows, D)``: the
        members (float64), their changed copies where scored and not fitted (``queried``, float64), and the same rows
        by the int8 scorer's backbone where the pass has them (as spooled, solved in float32); ``None`` where none."""
        dim, device = self.fit.embedder.embedding_dim, self.fit.device

        def folded(rows: torch.Tensor) -> torch.Tensor:  # (F k, c, D), fold after fold -> (c, F, k, D)
            return rows.transpose(0, 1).reshape(pixels.size, folds, -1, dim)

        x = torch.cat([self.scoring.rows.read(pixels, a, b) for a, b in runs]).to(device).to(torch.float64)
        scored = None
        if queried:  # each picture's rows, then its copy's: members and queries of the same fold model
            own, copied = split_rows(x, self.fit.rows_per_image)  # (F m / 2, c, D) each
            members, scored = folded(own), folded(copied)
        else:
            members = folded(x)
        asked = self.scoring.queries
        single = None if asked is None else folded(torch.cat([asked.read(pixels, a, b) for a, b in runs]).to(device))
        return members, scored, single

    def image_scores(self, queries: bool = False) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scored pictures' names, and their raw scores, input distances and own raw scores ``(B,)``: the
        pictures' maps (tiles stitched) as the scorer makes them and their scores (their changed copies' with
        ``expect``: the third value is then the pictures' own), and the mean of each picture's own distances; of
        their query rows (:attr:`asked`) with ``queries``."""
        fit, config = self.fit, self.fit.config
        squared = self.asked if queries else self.squared
        assert squared is not None, "the pass scored query rows"
        names = [name for rows in self.kept for name in rows[:: fit.spooled_rows]]  # a picture's rows: one name
        scores, inputs, taken, rows = [], [], [], 64 * fit.spooled_rows
        for first in range(0, squared.shape[0], rows):
            block = squared[first : first + rows]
            own, scored = split_rows(block, fit.rows_per_image) if config.gaussian.expect else (block, block)
            out = score_distances(scored, fit.embedder.tiling, config.scoring)
            scores.append(out.raw_scores)
            inputs.append(own.reshape(out.raw_scores.shape[0], -1).mean(1).to(torch.float64))
            taken.append(
                score_distances(own, fit.embedder.tiling, config.scoring).raw_scores
                if config.gaussian.expect
                else out.raw_scores
            )
        if not scores:
            empty = torch.zeros(0, dtype=torch.float64)
            return names, empty, empty, empty
        return names, torch.cat(scores), torch.cat(inputs), torch.cat(taken).to(torch.float64)


def scoreable(
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


def _runs(places: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """``(first, stop)`` source rows of folds of ``size`` rows, adjacent folds read as one span."""
    spans: list[list[int]] = []
    for row, _ in places:
        if spans and spans[-1][1] == row:
            spans[-1][1] = row + size
        else:
            spans.append([row, row + size])
    return [(first, stop) for first, stop in spans]


def _rejoin(own: torch.Tensor, copies: torch.Tensor, per_image: int) -> torch.Tensor:
    """``(c, F, k T)`` distances of a fold's pictures and ``(c, F, k T)`` of their copies -> ``(c, F, 2 k T)`` in
    the source's row order (each picture's rows, then its copy's)."""
    pixels, folds = own.shape[:2]
    both = torch.stack([own.reshape(pixels, folds, -1, per_image), copies.reshape(pixels, folds, -1, per_image)], 3)
    return both.reshape(pixels, folds, -1)
