"""A fit in progress (:class:`Fit`): the embedder and the streamed statistics, until they become a detector.

A fit runs in two passes over the normal images, each streaming, so memory does not depend on
how many images there are:

1. **fit** (:meth:`Fit.accumulate`): every image is embedded and added to the per-pixel
   statistics ``T``, in the order of its calibration fold (batches never straddle two folds).
2. **calibrate** (:meth:`Fit.out_of_fold_scores`): for each fold ``k``, its images are embedded
   again into ``S_k``; the model of "every image but fold ``k``" is ``T - S_k`` (an exact
   downdate, the reverse of the Chan merge), finalised, and scores fold ``k``'s images. A
   fold's embeddings are kept between the two uses when they fit in :data:`FOLD_CACHE_BYTES`;
   otherwise they are computed again.

:meth:`Fit.finish` derives the precision factors of ``T`` and returns the
:class:`~padim.models.detector.PadimDetector`. Whole runs (a new fit, resume, partial fits and
their merge) are in :mod:`padim.models.training`.

Under ``torch.distributed`` each rank fits a contiguous share of the fold-ordered images and
the statistics are all-reduced; then each rank calibrates whole folds (fold ``k`` on rank
``k mod world``), and the scores are summed into place on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from padim.core.calibration import Calibration, fold_of
from padim.core.statistics import GaussianAccumulator, GaussianState, all_reduce_state_, empty_state, finalise, subtract_states

from . import distributed
from .backbones import WeightsInfo, build_backbone, used_state, weights_sha256
from .config import PadimConfig
from .detector import PadimDetector, Provenance, choose_precision_dtype, resolve_device
from .distributed import Shard
from .features import Embedding, FeatureEmbedder
from .images import decode_side, iter_decoded
from .model import PadimModel

#: A fold's embeddings are kept between its two uses in the calibrate pass up to this size.
FOLD_CACHE_BYTES = 256 * 2**20


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


class Fit:
    """A fit in progress: the embedder and the streamed statistics; no precision factors, no threshold.

    Attributes:
        config: the detector configuration.
        weights, backbone_weights, embedding: what the embedder is built from (saved with the model).
        embedder: images -> ``(B, P, D)`` embeddings, on :attr:`device`.
        statistics: the streamed statistics ``T`` (``None`` before the first image).
        image_digests: content digests of every image fitted so far (for resume and merge).
        earlier: the calibration of the model this fit resumes (``None`` for a new fit).
        provenance: what earlier fits recorded (image counts, fits).
    """

    def __init__(self, config: PadimConfig, weights: WeightsInfo, backbone_weights: dict[str, torch.Tensor],
                 embedding: Embedding, statistics: GaussianState | None = None, image_digests: torch.Tensor | None = None,
                 earlier: Calibration | None = None, provenance: Provenance | None = None):
        self.config = config
        self.weights = weights
        self.backbone_weights = backbone_weights
        self.embedding = embedding
        self.device = resolve_device(config.device)
        self.embedder = FeatureEmbedder(config, backbone_weights, embedding).to(self.device)
        self.statistics = None if statistics is None else statistics.to(self.device)
        self.image_digests = torch.zeros(0, dtype=torch.int64) if image_digests is None else image_digests
        self.earlier = earlier
        self.provenance = provenance or Provenance()

    @classmethod
    def start(cls, config: PadimConfig) -> Fit:
        """A new fit: the backbone with its weights, the seeded channel reduction, no statistics."""
        backbone, weights = build_backbone(config.backbone, config.weights, config.seed, config.layers)
        backbone_weights = used_state(backbone, config.spec, config.layers)
        weights = WeightsInfo(weights.source, weights.detail, weights_sha256(backbone_weights))
        embedding = Embedding.create(config.spec, config.layers, config.embedding_dim_or_default(), config.reduction,
                                     config.seed)
        return cls(config, weights, backbone_weights, embedding)

    @classmethod
    def load(cls, path: str | Path, runtime: PadimConfig | None = None) -> Fit:
        """A fit from a model file with statistics (see :func:`padim.models.serialization.load_fit`)."""
        from .serialization import load_fit

        return load_fit(path, runtime)

    def save_partial(self, path: str | Path) -> None:
        """Write the statistics alone (see :func:`padim.models.serialization.save_fit`)."""
        from .serialization import save_fit

        save_fit(self, path)

    @property
    def draft_to(self) -> int:
        """JPEGs are decoded down to this side (see :func:`~padim.models.images.decode_side`)."""
        return decode_side(self.config.image_size)

    @property
    def count(self) -> int:
        """Images in the statistics."""
        return 0 if self.statistics is None else int(self.statistics.count)

    def groups(self, images: Sequence[TrainingImage]) -> list[list[TrainingImage]]:
        """``images`` grouped by calibration fold (fold order, then name)."""
        groups: list[list[TrainingImage]] = [[] for _ in range(self.config.calibration_folds)]
        for image in sorted(images, key=lambda i: i.name):
            groups[fold_of(image.name, self.config.calibration_folds)].append(image)
        return groups

    # ------------------------------------------------------------------ pass 1
    def accumulate(self, groups: Sequence[Sequence[TrainingImage]], progress: bool = True,
                   shard: Shard | None = None) -> Accumulated:
        """Pass 1: add every image of ``groups`` to :attr:`statistics` (this rank's share under ``shard``).

        Unreadable images are left out and returned. Under ``shard`` the statistics of every
        rank are merged on every rank afterwards.
        """
        ordered = [image for group in groups for image in group]
        mine = {i.path for i in distributed.shard_of(ordered, shard)}
        name_of = {i.path: i.name for i in ordered}
        batches = batches_of([[i for i in group if i.path in mine] for group in groups], self.config.batch_size)
        accumulator = GaussianAccumulator(self.statistics if shard is None or shard.main else None)
        unreadable: list[tuple[Path, str]] = []
        digests: list[tuple[str, int]] = []

        def run() -> None:
            with tqdm(total=len(mine), desc="fit", unit="img", disable=not progress, leave=False) as bar:
                for paths, images in iter_decoded(batches, self.config.workers, unreadable, self.draft_to):
                    accumulator.partial_fit(self.embedder(self.embedder.preprocess(images)))
                    digests.extend((name_of[p], file_digest(p)) for p in paths)
                    bar.update(len(digests) + len(unreadable) - bar.n)  # images read so far, good or not

        distributed.together(run, shard, self.device)
        statistics = accumulator.state
        if statistics is None:
            grid = self.embedder.grid_shape
            statistics = empty_state(grid[0] * grid[1], self.embedder.embedding_dim, self.device)
        if shard is not None:
            statistics = all_reduce_state_(statistics)
        found = distributed.gather(([(name_of[p], reason) for p, reason in unreadable], digests), shard)
        self.statistics = statistics
        new = [d for _, part in found for d in part]
        self.image_digests = torch.cat([self.image_digests, torch.tensor([d for _, d in new], dtype=torch.int64)]).sort().values
        return Accumulated(sorted(x for part, _ in found for x in part), new)

    # ------------------------------------------------------------------ pass 2
    def out_of_fold_scores(self, groups: Sequence[Sequence[TrainingImage]], progress: bool = True,
                           shard: Shard | None = None) -> tuple[torch.Tensor, list[str], torch.Tensor | None]:
        """Pass 2: score every image of ``groups`` with the model of every image outside its fold.

        ``groups`` are the fitted images (unreadable ones left out), as pass 1 saw them.

        Returns:
            ``(N,)`` float64 out-of-fold raw scores (on every rank), the names of the images that
            could not be scored (their fold holds all but fewer than two of the images), and a
            ``(B, P, D)`` batch of out-of-fold embeddings for the float16 check (``None`` where
            this rank scored none).
        """
        if self.statistics is None:
            raise ValueError("nothing has been fitted")
        rank, world = (shard.rank, shard.world) if shard else (0, 1)
        offsets = [sum(len(g) for g in groups[:k]) for k in range(len(groups))]
        total = sum(len(g) for g in groups)
        scores = torch.zeros(total, dtype=torch.float64, device=self.device)
        scored = torch.zeros(total, dtype=torch.float64, device=self.device)
        sample: list[torch.Tensor] = []
        mine = [k for k in range(len(groups)) if groups[k] and k % world == rank]

        def run() -> None:
            with tqdm(total=sum(len(groups[k]) for k in mine), desc="calibrate", unit="img", disable=not progress,
                      leave=False) as bar:
                for k in mine:
                    values = self._score_fold(groups[k], bar, sample)
                    if values is not None:
                        scores[offsets[k] : offsets[k] + len(values)] = values.to(self.device)
                        scored[offsets[k] : offsets[k] + len(values)] = 1.0

        distributed.together(run, shard, self.device)
        distributed.sum_(scores, shard)
        distributed.sum_(scored, shard)
        names = [i.name for group in groups for i in group]
        unscored = [n for n, ok in zip(names, scored.tolist()) if not ok]
        return scores[scored.bool()].cpu(), unscored, (sample[0] if sample else None)

    def _score_fold(self, images: Sequence[TrainingImage], bar, sample: list) -> torch.Tensor | None:
        """Out-of-fold raw scores ``(n_k,)`` of one fold, or ``None`` if too few images lie outside it."""
        batches = batches_of([images], self.config.batch_size)
        cache: list[torch.Tensor] | None = []
        cached_bytes = 0
        part = GaussianAccumulator()
        for _, pictures in iter_decoded(batches, self.config.workers, [], self.draft_to):
            embedded = self.embedder(self.embedder.preprocess(pictures))  # (B, P, D)
            part.partial_fit(embedded)
            if cache is not None:
                cached_bytes += embedded.numel() * embedded.element_size()
                if cached_bytes <= FOLD_CACHE_BYTES:
                    cache.append(embedded)
                else:
                    cache = None  # too large to keep: embedded again below
        if part.state is None or self.count - part.count < 2:
            bar.update(len(images))
            return None
        rest = subtract_states(self.statistics, part.state, out=part.state)  # reuses S_k's buffer
        mean, precision_factor = finalise(rest, self.config.epsilon, self.embedder.grid_shape)
        del rest, part
        fold_model = PadimModel(self.embedder, mean, precision_factor, self.config.blur_sigma)
        embedded_batches = cache if cache is not None else (
            self.embedder(self.embedder.preprocess(pictures)) for _, pictures in iter_decoded(batches, self.config.workers, [], self.draft_to))
        values = []
        for embedded in embedded_batches:
            values.append(fold_model.score_embeddings(embedded).raw_scores.to(torch.float64))
            if not sample:
                sample.append(embedded)
            bar.update(embedded.shape[0])
        return torch.cat(values)

    # ------------------------------------------------------------------ the detector
    def finish(self, calibration: Calibration, sample: torch.Tensor | None, provenance: Provenance) -> PadimDetector:
        """Precision factors from :attr:`statistics`, and the detector with ``calibration``."""
        if self.count < 2:
            raise ValueError(f"need at least 2 fitted images, have {self.count}")
        mean, precision_factor = finalise(self.statistics, self.config.epsilon, self.embedder.grid_shape)
        model = PadimModel(self.embedder, mean, precision_factor, self.config.blur_sigma)
        precision_dtype = choose_precision_dtype(model, sample, self.config.precision_dtype)
        return PadimDetector(self.config, self.weights, self.backbone_weights, model, calibration, provenance,
                             self.statistics, self.image_digests, precision_dtype)


def file_digest(path: Path) -> int:
    """First 8 bytes of the sha256 of a file's content, as a signed int64 (a fitted image's identity)."""
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def batches_of(groups: Sequence[Sequence[TrainingImage]], batch_size: int) -> list[list[Path]]:
    """Batches of paths that never straddle two groups (folds): the same batches in both passes."""
    return [[i.path for i in group[s : s + batch_size]] for group in groups for s in range(0, len(group), batch_size)]
