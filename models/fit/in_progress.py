"""A fit in progress (:class:`Fit`): the embedder, the statistics and pass 1's spool, wired to its passes.

A fit reads every normal image through the backbone **once**:

1. **pass 1** (:meth:`Fit.accumulate`, :class:`~padim.models.fit.first_pass.FirstPass`): every image is embedded,
   in the order of its calibration fold, and its float32 embeddings go to an
   :class:`~padim.core.spool.EmbeddingSpool` on disk, while their count and sum are kept. When the spool does not
   fit on the disk (:meth:`Fit.spool_or_none` says so), the statistics are streamed into memory instead (the Chan
   update) and the calibration embeds the images again, in groups that fit in memory
   (:func:`~padim.models.fit.first_pass.embed_again`).
2. **finish** (:meth:`Fit.finish`, :class:`~padim.models.fit.finish.Finish`), a slice of pixels at a time: the
   comoment of the spooled images (two passes over the spool, centred on their exact mean) merged into the earlier
   statistics (``--resume``); the Cholesky factor ``L`` of the fitted model; its precision factor ``W = L^-1``,
   written to a scratch file in float32 and checked against float16; and the out-of-fold distance of every image
   (:class:`~padim.models.fit.fold_scores.FoldScoring`), by a rank-``m + 1`` correction of one factorisation per
   fold size (:mod:`padim.core.out_of_fold`: no fold model is fitted, no image is embedded again). The distances
   become maps and out-of-fold raw scores.

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

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from padim.core.calibration import Calibration, fold_of
from padim.core.spool import EmbeddingSpool
from padim.core.statistics import GaussianState
from padim.models.choices import PRECISION_AUTO
from padim.models.config import PadimConfig
from padim.models.data.images import iter_decoded
from padim.models.devices import check_precision, precision_device
from padim.models.errors import FitError
from padim.models.features.backbones import WeightsInfo, build_backbone, used_state, weights_sha256
from padim.models.features.embedding import TRACING, Embedding, FeatureEmbedder
from padim.models.features.quantised import (
    GRAPH_KEY,
    GraphExtractor,
    QuantisedBackbone,
    QuantisedExtractor,
    quantise_backbone,
)
from padim.models.fit.distributed import Shard, gather
from padim.models.fit.finish import Finish
from padim.models.fit.first_pass import FirstPass, embed_again
from padim.models.fit.memory_plan import SLICE_BYTES, spool_fits
from padim.models.fit.passes import (
    Accumulated,
    Finished,
    Reading,
    ScoringPass,
    Spooled,
    TrainingImage,
)
from padim.models.scoring.detector import Provenance
from padim.models.scoring.reduced import Int8Scorer


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
        earlier_int8: its int8 scorer (:mod:`padim.models.scoring.reduced`; ``None``: a new fit, or a model without a
            usable one), whose calibration a resume goes on with.
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
        self.device = precision_device(config.run.device, config.features.precision)
        assert config.features.precision != PRECISION_AUTO, "train resolves --precision auto before a fit starts"
        check_precision(config.features.precision, self.device)
        self.embedder = FeatureEmbedder(config, backbone_weights, embedding).to(self.device)
        self.rows_per_image = self.embedder.rows_per_image  # a picture's rows of embeddings (its tiles when shared)
        self.reading = Reading(config, self.embedder, self.device)
        self.statistics = None if statistics is None else statistics.to(self.device)
        self.spooled: Spooled | None = None
        self._slim_count = 0  # rows fitted into a slim fit, which keeps no statistics
        self.image_digests = torch.zeros(0, dtype=torch.int64) if image_digests is None else image_digests
        self.earlier = earlier
        self.earlier_int8: Int8Scorer | None = None
        self.provenance = provenance or Provenance()

    @classmethod
    def start(cls, config: PadimConfig) -> Fit:
        """A new fit: the backbone with its weights, the seeded channel reduction, no statistics."""
        backbone, weights = build_backbone(
            config.features.backbone, config.features.weights, config.features.seed, config.features.stages
        )
        backbone_weights = used_state(backbone, config.spec, config.features.stages)
        weights = WeightsInfo(weights.source, weights.detail, weights_sha256(backbone_weights))
        embedding = Embedding.create(
            config.spec,
            config.features.stages,
            config.embedding_dim_or_default(),
            config.features.reduction,
            config.features.seed,
            config.gaussian.neighbourhood,
        )
        return cls(config, weights, backbone_weights, embedding)

    def quantise(self, paths: Sequence[Path], shard: Shard | None = None) -> dict:
        """Make the int8 backbone of a new ``--precision int8`` fit (:mod:`padim.models.features.quantised`) from
        ``paths``, at most :data:`~padim.models.features.quantised.QUANTISER_IMAGES` training pictures chosen alike on
        every rank, read as training reads them; every rank quantises and rank 0's graph is used. Returns what made it.

        Raises:
            FitError: none of ``paths`` could be read.
        """
        made = self._quantised(paths, shard)
        self.backbone_weights = {**self.backbone_weights, GRAPH_KEY: made.graph}
        self.embedder.extractor = QuantisedExtractor(made.graph, self.config.features.stages)
        return made.settings

    def prepare_int8_scorer(self, paths: Sequence[Path], shard: Shard | None = None) -> dict | None:
        """The int8 scorer of a float32 fit (:mod:`padim.models.scoring.reduced`): its backbone quantised from ``paths``
        as :meth:`quantise` makes an int8 fit's (a resumed model's own graph kept), and its embedder set to give pass
        1's query rows (:attr:`Reading.queries`). Returns what made a new graph (``None``: the model's own).

        On a CPU, a new graph's float32 source then runs the fit's float32 backbone too (:class:`GraphExtractor`):
        the same stages and weights as torch's, their maps within float32 rounding of torch's (2e-6 of the largest),
        and ONNX Runtime ran them in 0.80x torch's time at batch 16 (224 px resnet18, 2-core Zen 4 VM). A resumed
        model's own graph comes without its source, and torch runs its float32 backbone.

        Raises:
            FitError: none of ``paths`` could be read.
        """
        settings = None
        if GRAPH_KEY not in self.backbone_weights:
            made = self._quantised(paths, shard)
            self.backbone_weights, settings = {**self.backbone_weights, GRAPH_KEY: made.graph}, made.settings
            if self.device.type == "cpu":
                self.embedder.extractor = GraphExtractor(made.float_graph, self.config.features.stages)
        int8 = FeatureEmbedder(self.config.replace(precision="int8"), self.backbone_weights, self.embedding)
        self.reading.queries = int8
        return settings

    @property
    def int8_embedder(self) -> FeatureEmbedder | None:
        """The int8 scorer's embedder (:meth:`prepare_int8_scorer`); ``None`` where the fit makes none."""
        return self.reading.queries

    def _quantised(self, paths: Sequence[Path], shard: Shard | None) -> QuantisedBackbone:
        """The float32 backbone's int8 graph, quantised from ``paths`` read as training reads them (every rank
        quantises, and rank 0's graph is used), what made it, and its float32 source."""
        unreadable: list[tuple[Path, str]] = []
        chunks = [list(paths[i : i + 8]) for i in range(0, len(paths), 8)]
        decoded = iter_decoded(
            chunks, self.config.run.decode_workers, unreadable, self.draft_to, self.config.framing.roi
        )
        batches = [self.embedder.tiles(self.embedder.preprocess(images)).cpu() for _, images in decoded if images]
        if not batches:
            raise FitError(
                f"int8 sets its quantiser's ranges on the training pictures, and none of the {len(paths)} it read "
                f"could be decoded ({unreadable[0][0]}: {unreadable[0][1]})"
            )
        made = quantise_backbone(self.embedder.extractor, batches, TRACING.shared())
        graph, settings = gather((made.graph, made.settings), shard)[0]
        return made._replace(graph=graph, settings=settings)

    @property
    def draft_to(self) -> int:
        """JPEGs are decoded down to this side (:attr:`Reading.draft_to`)."""
        return self.reading.draft_to

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

    def spool_or_none(
        self, directory: Path, rows: int, in_memory: bool = False, dtype: torch.dtype = torch.float32
    ) -> EmbeddingSpool | None:
        """A spool for ``rows`` images in ``directory``, or ``None`` when they would not fit its free disk; with
        ``in_memory``, in the fit's device's memory instead (the caller's plan says it fits there); ``dtype``: how it
        keeps them (:class:`~padim.core.spool.EmbeddingSpool`)."""
        rows *= self.spooled_rows
        dim = self.embedder.embedding_dim
        if in_memory:
            return EmbeddingSpool(directory, rows, self.pixels, dim, self.slice_pixels, device=self.device, dtype=dtype)
        if not spool_fits(directory, rows, self.pixels, dim, dtype):
            return None
        return EmbeddingSpool(directory, rows, self.pixels, dim, self.slice_pixels, dtype=dtype)

    # ------------------------------------------------------------------ pass 1

    # ------------------------------------------------------------------ the passes
    def accumulate(
        self,
        groups: Sequence[Sequence[TrainingImage]],
        progress: bool = True,
        shard: Shard | None = None,
        spool: EmbeddingSpool | None = None,
        queries: EmbeddingSpool | None = None,
    ) -> Accumulated:
        """Pass 1: embed every image of ``groups`` (this rank's whole folds under ``shard``).

        With a ``spool``, the embeddings go there (:attr:`spooled`) and :meth:`finish` forms
        their comoment; without one, they are added to :attr:`statistics` at once. Unreadable
        images are left out and returned. ``queries``: where the int8 scorer's rows go, beside the spool's
        (:meth:`prepare_int8_scorer`).
        """
        made = FirstPass(self.reading, groups, shard, spool, self.statistics, self.pixels, queries).run(progress)
        if made.spooled is not None:
            self.spooled = made.spooled
        else:
            self.statistics = made.statistics
        self.image_digests = torch.cat([self.image_digests, made.digests]).sort().values
        return made.found

    def embed_again(
        self, groups: Sequence[Sequence[TrainingImage]], progress: bool, shard: Shard | None
    ) -> Iterator[ScoringPass]:
        """The calibration without a spool: :func:`~padim.models.fit.first_pass.embed_again`."""
        return embed_again(self.reading, self.pixels, groups, progress, shard)

    def finish(
        self,
        passes: Iterable[ScoringPass],
        scratch: Path | None,
        with_statistics: bool = True,
        progress: bool = True,
        shard: Shard | None = None,
        timing: dict[str, float] | None = None,
    ) -> Finished:
        """Statistics, factors and scores, a slice of pixels at a time (module docstring;
        :class:`~padim.models.fit.finish.Finish`).

        Args:
            passes: the images to score, one :class:`~padim.models.fit.passes.ScoringPass` after another.
            scratch: where the precision factors wait for the file (``None``: no factors, a partial fit).
            with_statistics: form the whole comoment in memory (for a file with statistics).
            timing: adds ``finish`` (statistics and factors) and ``calibrate`` (distances) seconds.

        Raises:
            NotPositiveDefiniteError: a pixel whose matrix has no Cholesky factor (named).
        """
        timing = {} if timing is None else timing
        return Finish(self, scratch, with_statistics, progress, shard, timing).run(passes)

    def formed(self, statistics: GaussianState | None, count: int) -> None:
        """The finish formed the spooled pictures' comoment: the fit's statistics are ``statistics`` (``None`` for a
        slim file, which keeps only their ``count``), and the spool is done with."""
        self.statistics = statistics
        if statistics is None:
            self._slim_count = count
        self.spooled = None
