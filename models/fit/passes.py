"""What a fit's passes hand each other: the training pictures, pass 1's spool, the rows a scoring pass reads slice by
slice, and what the finish leaves for the model file; the rows of a picture and its changed copy told apart.

:class:`Fitting` is what pass 1 (:mod:`padim.models.fit.first_pass`) and the finish
(:mod:`padim.models.fit.finish`) read of a fit in progress (:class:`~padim.models.fit.in_progress.Fit`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from PIL import Image

from padim.core.spool import EmbeddingSpool, ScratchFile
from padim.core.statistics import GaussianState
from padim.models.config import PadimConfig
from padim.models.data.changes import Expected, apply, seeded
from padim.models.data.images import decode_side, iter_decoded
from padim.models.features.embedding import FeatureEmbedder

if TYPE_CHECKING:
    from padim.models.scoring.detector import Provenance


@dataclass(frozen=True)
class TrainingImage:
    """A normal image and its name (path relative to the data directory), which decides its fold."""

    path: Path
    name: str


@dataclass
class Accumulated:
    """What pass 1 found: images that could not be read, the content digest of each image fitted, and how long it
    waited for pictures."""

    unreadable: list[tuple[str, str]]  # (name, reason)
    digests: list[tuple[str, int]]  # (name, digest)
    waited: float = 0.0  # seconds of the pass spent waiting for decoded pictures and their changed copies


@dataclass
class Spooled:
    """This rank's images of pass 1, waiting in the spool: rows in fold order, and their count and mean.

    Attributes:
        spool: their ``(rows, P, D)`` float32 embeddings (with ``expect``, each picture's rows then its copy's).
        names: the image of every row.
        folds: rows per fold, one entry per non-empty fold of this rank, in row order.
        count, mean: of every rank's fitted rows (not the copies, unless they are fitted), set once pass 1 is over
            (after the all-reduce of their sums, :class:`~padim.core.statistics.RowSums`).
    """

    spool: EmbeddingSpool
    names: list[str] = field(default_factory=list)
    folds: list[int] = field(default_factory=list)
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
            :attr:`Fitting.spooled_rows` a picture).
        names: the image of every row.
        folds: rows per fold in row order (out-of-fold scoring), or ``None``: scored by the fitted
            model itself (held-out images).
        queries: rows scored in place of ``rows``, out-of-fold (``folds`` given), one for one: the same pictures in
            the same layout, each row scored by the model without its picture's fold (whose rows in ``rows`` are the
            fold's members). The int8 scorer's threshold reads the int8 backbone's embeddings of the pictures (and
            of their changed copies) so (:mod:`padim.models.scoring.reduced`); ``None``: the pass scores its own rows.
    """

    rows: Rows
    names: list[str]
    folds: list[int] | None
    queries: Rows | None = None


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
        shrinkage: with ``--shrinkage auto``, the weight estimated from the statistics and what it was estimated
            from (``weight``, ``rows``: samples a pixel, ``pixels``); ``None`` for a weight given.
        queried: what a pass of query rows scored, as the fields above hold the pictures' own (``None``: no such
            pass).
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
    shrinkage: dict | None = None
    queried: Scored | None = None


@dataclass(frozen=True)
class Scored:
    """The out-of-fold values of the pictures a pass scored: their names, ``(N,)`` float64 raw scores, input
    distances (``None``: none) and, with ``expect``, their own raw scores (where ``scores`` are their changed
    copies'; else ``None``)."""

    names: list[str]
    scores: torch.Tensor
    input_distances: torch.Tensor | None
    taken_scores: torch.Tensor | None


def run_lengths(labels: Sequence) -> list[int]:
    """Lengths of the runs of equal consecutive ``labels``: rows per fold, the folds coming one after another."""
    return [len(list(run)) for _, run in itertools.groupby(labels)]


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


class Reading:
    """Pictures read into a fit's rows, as every pass of it reads them: decoded on the fit's threads, each with its
    changed copy (``expect``), through the embedder, one row block a picture.

    Attributes:
        config: the detector configuration (batch size, decode threads, region of interest, the cover).
        embedder: images -> ``(B, P, D)`` embeddings, on ``device``.
        device: where the embedder runs.
        queries: the int8 scorer's embedder, for pass 1's query rows (:meth:`embed_and_query`); ``None``: none.
    """

    def __init__(self, config: PadimConfig, embedder: FeatureEmbedder, device: torch.device):
        self.config, self.embedder, self.device = config, embedder, device
        self.rows_per_image = embedder.rows_per_image  # a picture's rows of embeddings (its tiles when shared)
        self.queries: FeatureEmbedder | None = None

    @property
    def spooled_rows(self) -> int:
        """A picture's rows of embeddings in pass 1's spool: its own, then its changed copy's (``expect``)."""
        return self.config.spooled_rows_per_picture

    @property
    def draft_to(self) -> int:
        """JPEGs are decoded down to this side (see :func:`~padim.models.data.images.decode_side`)."""
        return decode_side(self.config.input_shape)

    def per_row(self, values: Iterable) -> list:
        """One value per picture -> one per spooled row (:attr:`spooled_rows`: its tiles and its copy's)."""
        return [value for value in values for _ in range(self.spooled_rows)]

    def fitted(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of spooled ``rows`` (whole pictures) that go into the statistics: all but the copies, unless
        those are fitted."""
        if not self.config.gaussian.expect or self.config.copies_fitted:
            return rows
        return split_rows(rows, self.rows_per_image)[0]

    def decoded(
        self,
        batches: Sequence[Sequence[Path]],
        unreadable: list[tuple[Path, str]] | None,
        name_of: Callable[[Path], str],
    ) -> Iterator[tuple[list[Path], list[Image.Image], list[Image.Image] | None]]:
        """``batches`` of pictures decoded on the fit's threads (``--decode-workers``) as training reads them, each
        batch with its pictures' changed copies (``expect``; ``None`` without), made on the same threads: a copy costs
        more than decoding (15 ms for a 224 px picture with ``rough``, 280 ms for 1024 px, on one core)."""
        config = self.config
        then = functools.partial(_with_copy, config.expected, name_of) if config.gaussian.expect else None
        for paths, items in iter_decoded(
            batches, config.run.decode_workers, unreadable, self.draft_to, config.framing.roi, then
        ):
            if then is None:
                yield paths, items, None
            else:
                yield paths, [image for image, _ in items], [copy for _, copy in items]

    def embed(self, names: Sequence[str], images, copies: Sequence | None = None) -> torch.Tensor:
        """A batch's spooled rows: every picture's embeddings ``(T, P, D)``, then its changed copy's (``expect``:
        one draw of the declared changes, seeded by the picture's name; made here unless ``copies`` are given, as
        :meth:`decoded` gives them). On a GPU, pictures and copies go through the backbone in one call (half the
        launches); on a CPU one after the other (half the activations' memory, at the same speed)."""
        return self._rows(self.embedder, self._framed(names, images, copies))

    def embed_and_query(
        self, names: Sequence[str], images, copies: Sequence | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`embed`'s rows and, where the fit makes an int8 scorer (:attr:`queries`), the same rows by its
        embedder, one for one (``None`` without); the pictures and copies are framed once for both, and on a CPU
        normalised and cut into tiles once for both (what the float32 backbone reads, the int8 one reads)."""
        framed = self._framed(names, images, copies)
        queries = self.queries
        if queries is None:
            return self._rows(self.embedder, framed), None
        if self.embedder.device.type == "cpu" and queries.device.type == "cpu":
            tiled = [self.embedder.tiles(x) for x in framed]
            return self._tiled_rows(self.embedder, tiled), self._tiled_rows(queries, tiled)
        return self._rows(self.embedder, framed), self._rows(queries, framed)

    def _framed(self, names: Sequence[str], images, copies: Sequence | None) -> list[torch.Tensor]:
        """The model input of the pictures, then of their changed copies (``expect``)."""
        if not self.config.gaussian.expect:
            return [self.embedder.preprocess(images)]
        if copies is None:
            expected = self.config.expected
            copies = [apply(image, expected.draw(seeded(name))) for name, image in zip(names, images, strict=True)]
        return [self.embedder.preprocess(images), self.embedder.preprocess(list(copies))]

    def _rows(self, embedder: FeatureEmbedder, framed: list[torch.Tensor]) -> torch.Tensor:
        if len(framed) > 1 and embedder.device.type == "cuda":
            own, changed = embedder(torch.cat(framed)).chunk(2)  # (2 B T, P, D): pictures, copies
            return interleaved(own, changed, self.rows_per_image)
        return self._tiled_rows(embedder, [embedder.tiles(x.to(embedder.device, non_blocking=True)) for x in framed])

    def _tiled_rows(self, embedder: FeatureEmbedder, tiled: list[torch.Tensor]) -> torch.Tensor:
        """The rows of :meth:`~padim.models.features.embedding.FeatureEmbedder.tiles` of the pictures, then of their
        copies (``expect``), one after the other."""
        if len(tiled) == 1:
            return embedder.from_tiles(tiled[0])
        own, changed = tiled
        return interleaved(embedder.from_tiles(own), embedder.from_tiles(changed), self.rows_per_image)


def _with_copy(expected: Expected, name_of: Callable[[Path], str], path: Path, image: Image.Image):
    """A decoded picture and its changed copy (one seeded draw of ``expected``), made on a decoding thread."""
    return image, apply(image, expected.draw(seeded(name_of(path))))


class Fitting(Protocol):
    """A fit in progress as its passes see it (:class:`~padim.models.fit.in_progress.Fit`)."""

    config: PadimConfig
    embedder: FeatureEmbedder
    device: torch.device
    rows_per_image: int
    statistics: GaussianState | None
    spooled: Spooled | None
    image_digests: torch.Tensor
    provenance: Provenance
    reading: Reading

    @property
    def pixels(self) -> int: ...

    @property
    def fitted_rows(self) -> int: ...

    @property
    def spooled_rows(self) -> int: ...

    @property
    def draft_to(self) -> int: ...

    @property
    def naming_grid(self) -> tuple[int, int]: ...

    @property
    def slice_pixels(self) -> int: ...

    def formed(self, statistics: GaussianState | None, count: int) -> None: ...
