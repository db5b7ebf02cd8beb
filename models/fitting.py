"""Fitting a detector: a fit in progress (:class:`Fit`) and what turns it into a :class:`PadimDetector`.

A fit runs in two passes over the normal images, each streaming, so memory does not depend on
how many images there are:

1. **fit**: every image is embedded and added to the per-pixel statistics ``T``, in the order
   of its calibration fold (batches never straddle two folds).
2. **calibrate**: for each fold ``k``, its images are embedded again into ``S_k``, the model of
   "every image but fold ``k``" is ``T - S_k`` (an exact downdate, the reverse of the Chan
   merge), finalised, and scores fold ``k``'s images. Those out-of-fold scores set the
   threshold (:mod:`padim.core.calibration`). A fold's embeddings are kept between its two
   uses when they fit in :data:`FOLD_CACHE_BYTES`; otherwise they are computed again.

The cost over a plain fit: one more feature pass (two when a fold outgrows the cache), ``K``
more finalisations, and ``T``, ``S_k`` and one set of precision factors in memory at once.

Under ``torch.distributed`` each rank fits a contiguous share of the fold-ordered images and
the statistics are all-reduced; then each rank calibrates whole folds (fold ``k`` on rank
``k mod world``), and rank 0 gathers the scores and finishes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from padim import __version__
from padim.core.artifact import ArtifactError, load_artifact, pack_lower, save_artifact, unpack_lower
from padim.core.calibration import Calibration, CalibrationError, fold_of
from padim.core.scoring import anomaly_maps, image_scores, squared_mahalanobis
from padim.core.statistics import (
    GaussianAccumulator,
    GaussianState,
    all_reduce_state_,
    empty_state,
    finalise,
    merge_states_,
    subtract_states,
)

from .backbones import WeightsInfo, build_backbone, weights_sha256
from .config import PadimConfig
from .detector import (
    PadimDetector,
    choose_precision_dtype,
    common_header,
    embedding_tensors,
    read_calibration,
    read_common,
    resolve_device,
)
from .features import Embedding, FeatureEmbedder, used_state
from .images import iter_decoded, list_images

log = logging.getLogger(__name__)

#: Fewest readable images a new detector is fitted on: two for a covariance, and more to calibrate.
MIN_IMAGES = 3
#: A fold's embeddings are kept between its two uses in the calibrate pass up to this size.
FOLD_CACHE_BYTES = 256 * 2**20
#: Config fields that decide the statistics: they cannot change between a fit and its resume or merge.
STATISTICS_FIELDS = ("backbone", "weights", "layers", "image_size", "reduction", "features", "seed", "epsilon",
                     "calibration_folds")


class FitError(ValueError):
    """A fit that cannot go on; the message is one line that says what to do."""


@dataclass(frozen=True)
class TrainingImage:
    """A normal image and its name (path relative to the data directory), which decides its fold."""

    path: Path
    name: str


def training_images(root: str | Path) -> list[TrainingImage]:
    """Every image under ``root`` (recursively, sorted), named by its path relative to ``root``."""
    root = Path(root)
    return [TrainingImage(p, p.relative_to(root).as_posix() if root.is_dir() else p.name) for p in list_images(root)]


@dataclass
class FitReport:
    """What happened to the images of one run (shown by ``padim train``).

    Attributes:
        listed: images given.
        unreadable: ``(name, reason)`` of images that could not be decoded (left out).
        already_fitted: names of images whose content the resumed model had fitted (left out).
        copies: groups of names of images with the same content (each fitted, in any folds).
        folds: fold of every image given, by name.
        unscored: names of fitted images without an out-of-fold score (their fold held all
            but fewer than two of the images).
        warnings: one line each.
        seconds: wall time of each phase (``fit``, ``calibrate``, ``finish``) on this rank.
        folds_scored: out-of-fold models this rank finalised (one per non-empty fold it calibrated).
    """

    listed: int = 0
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    already_fitted: list[str] = field(default_factory=list)
    copies: list[list[str]] = field(default_factory=list)
    folds: dict[str, int] = field(default_factory=dict)
    unscored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    folds_scored: int = 0

    @property
    def fitted(self) -> int:
        return self.listed - len(self.unreadable) - len(self.already_fitted)


class Fit:
    """A fit in progress: the embedder and the streamed statistics; no precision factors, no threshold.

    Attributes:
        config: the detector configuration.
        backbone_state, weights, embedding: what the embedder is built from (saved with the model).
        embedder: images -> ``(B, P, D)`` embeddings, on :attr:`device`.
        state: accumulated statistics ``T`` (``None`` before the first image).
        image_digests: content digests of every image fitted so far (for resume and merge).
        earlier: the calibration of the model this fit resumes (``None`` for a new fit).
        history: provenance carried into the model file (earlier fits, merges).
    """

    def __init__(self, config: PadimConfig, backbone_state: dict[str, torch.Tensor], weights: WeightsInfo,
                 embedding: Embedding, state: GaussianState | None = None, image_digests: torch.Tensor | None = None,
                 earlier: Calibration | None = None, history: dict | None = None):
        self.config = config
        self.backbone_state = backbone_state
        self.weights = weights
        self.embedding = embedding
        self.device = resolve_device(config.device)
        self.embedder = FeatureEmbedder(config, backbone_state, embedding).to(self.device)
        self.state = None if state is None else state.to(self.device)
        self.image_digests = torch.zeros(0, dtype=torch.int64) if image_digests is None else image_digests
        self.earlier = earlier
        self.history = dict(history or {})

    # ------------------------------------------------------------------ construction
    @classmethod
    def start(cls, config: PadimConfig) -> Fit:
        """A new fit: the backbone with its weights, the seeded channel reduction, no statistics."""
        backbone, weights = build_backbone(config.backbone, config.weights, config.seed)
        backbone_state = used_state(backbone, config)
        weights = WeightsInfo(weights.source, weights.detail, weights_sha256(backbone_state))
        embedding = Embedding.create(config.spec, config.layers, config.embedding_dim, config.reduction, config.seed)
        return cls(config, backbone_state, weights, embedding)

    @classmethod
    def load(cls, path: str | Path, runtime: PadimConfig | None = None) -> Fit:
        """A fit from a model file with accumulators (a detector, or a ``--partial`` file), to go on with.

        Args:
            runtime: batch size, device and workers to use (the rest comes from the file).

        Raises:
            ArtifactError: unreadable file, or one saved without accumulators (``--slim``).
        """
        tensors, header = load_artifact(path, skip_prefixes=("mean", "precision_factor"))
        if header.get("kind") not in ("padim-detector", "padim-partial"):
            raise ArtifactError(f"{path}: a padim file, but not a detector (kind={header.get('kind')!r})")
        if not header.get("has_accumulators"):
            raise ArtifactError(f"{path}: saved with --slim, without the accumulators that resume and merge need; "
                                "train a new model on all the images instead")
        config, embedding, backbone_state, weights = read_common(path, tensors, header)
        if runtime is not None:
            config = config.replace(batch_size=runtime.batch_size, device=runtime.device, workers=runtime.workers)
        try:
            dim = embedding.dim
            state = GaussianState(tensors["accumulator.count"], tensors["accumulator.mean"],
                                  unpack_lower(tensors["accumulator.comoment"], dim, symmetric=True))
            earlier = read_calibration(header, tensors) if header.get("calibration") is not None else None
        except (KeyError, TypeError, ValueError) as error:
            raise ArtifactError(f"{path}: incomplete or inconsistent model file ({type(error).__name__}: {error})") from None
        history = {k: header[k] for k in ("fits", "unreadable_image_count") if k in header}
        return cls(config, backbone_state, weights, embedding, state, tensors.get("image_digests"), earlier, history)

    # ------------------------------------------------------------------ pass 1
    @property
    def count(self) -> int:
        return 0 if self.state is None else int(self.state.count)

    def ordered(self, images: Sequence[TrainingImage], report: FitReport) -> list[list[TrainingImage]]:
        """The images grouped by fold (fold order, then name), leaving out those already fitted."""
        folds = self.config.calibration_folds
        report.listed = len(images)
        report.folds = {image.name: fold_of(image.name, folds) for image in images}
        if self.image_digests.numel():
            known = set(self.image_digests.tolist())
            fresh = []
            for image in images:
                (report.already_fitted if file_digest(image.path) in known else fresh).append(image)
            report.already_fitted = [image.name for image in report.already_fitted]
            images = fresh
        groups: list[list[TrainingImage]] = [[] for _ in range(folds)]
        for image in sorted(images, key=lambda i: i.name):
            groups[report.folds[image.name]].append(image)
        return groups

    def accumulate(self, groups: Sequence[Sequence[TrainingImage]], report: FitReport, progress: bool = True,
                   shard: tuple[int, int] | None = None) -> None:
        """Pass 1: add every image of ``groups`` to :attr:`state` (this rank's share under ``shard``).

        Unreadable images are left out and listed in ``report``. Under ``shard`` the statistics
        of every rank are merged on every rank afterwards.
        """
        ordered = [image for group in groups for image in group]
        mine = set(i.path for i in shard_of(ordered, shard))
        batches = _batches([[i for i in group if i.path in mine] for group in groups], self.config.batch_size)
        unreadable: list[tuple[Path, str]] = []
        accumulator = GaussianAccumulator(self.state if (shard is None or shard[0] == 0) else None)
        name_of = {i.path: i.name for i in ordered}
        digests: list[tuple[str, int]] = []  # (name, content digest) of every image fitted

        def run() -> None:
            with tqdm(total=len(mine), desc="fit", unit="img", disable=not progress, leave=False) as bar:
                for paths, images in iter_decoded(batches, self.config.workers, unreadable):
                    accumulator.partial_fit(self.embedder(self.embedder.preprocess(images)))
                    digests.extend((name_of[p], file_digest(p)) for p in paths)
                    bar.update(len(digests) + len(unreadable) - bar.n)  # images read so far, good or not

        _together(run, shard, self.device)
        state = accumulator.state
        if state is None:
            state = empty_state(self.embedder.grid_shape[0] * self.embedder.grid_shape[1], self.embedder.dim, self.device)
        lost = [(name_of[p], message) for p, message in unreadable]
        if shard is not None:
            import torch.distributed as dist

            state = all_reduce_state_(state)
            gathered: list = [None] * shard[1]
            dist.all_gather_object(gathered, (lost, digests))
            lost = [x for part, _ in gathered for x in part]
            digests = [x for _, part in gathered for x in part]
        self.state = state
        new_digests = torch.tensor([d for _, d in digests], dtype=torch.int64)
        self.image_digests = torch.cat([self.image_digests, new_digests]).sort().values
        report.unreadable = sorted(lost)
        same: dict[int, list[str]] = {}
        for name, digest in digests:
            same.setdefault(digest, []).append(name)
        report.copies = sorted(sorted(names) for names in same.values() if len(names) > 1)

    # ------------------------------------------------------------------ pass 2
    def out_of_fold_scores(self, groups: Sequence[Sequence[TrainingImage]], report: FitReport, progress: bool = True,
                           shard: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pass 2: score every fitted image of ``groups`` with the model of every image outside its fold.

        Returns:
            ``(N,)`` float64 out-of-fold raw scores (on every rank), and a ``(B, P, D)`` batch of
            out-of-fold embeddings for the float16 check (``None`` where this rank scored none).
        """
        if self.state is None:
            raise FitError("nothing has been fitted")
        unreadable = {name for name, _ in report.unreadable}
        groups = [[i for i in group if i.name not in unreadable] for group in groups]
        rank, world = shard or (0, 1)
        total_images = sum(len(g) for g in groups)
        offsets = [sum(len(g) for g in groups[:k]) for k in range(len(groups))]
        scores = torch.zeros(total_images, dtype=torch.float64, device=self.device)
        scored = torch.zeros(total_images, dtype=torch.float64, device=self.device)
        sample: list[torch.Tensor] = []
        mine = [k for k in range(len(groups)) if groups[k] and k % world == rank]
        work = sum(len(groups[k]) for k in mine)

        def run() -> None:
            with tqdm(total=work, desc="calibrate", unit="img", disable=not progress, leave=False) as bar:
                for k in mine:
                    values = self._score_fold(groups[k], bar, sample)
                    if values is not None:
                        scores[offsets[k] : offsets[k] + len(values)] = values.to(self.device)
                        scored[offsets[k] : offsets[k] + len(values)] = 1.0

        _together(run, shard, self.device)
        report.folds_scored = int(sum(1 for k in mine if groups[k]))
        if shard is not None:
            import torch.distributed as dist

            dist.all_reduce(scores)
            dist.all_reduce(scored)
        names = [i.name for group in groups for i in group]
        report.unscored = [n for n, ok in zip(names, scored.tolist()) if not ok]
        return scores[scored.bool()].cpu(), (sample[0] if sample else None)

    def _score_fold(self, images: Sequence[TrainingImage], bar, sample: list) -> torch.Tensor | None:
        """Out-of-fold raw scores ``(n_k,)`` of one fold, or ``None`` if too few images lie outside it."""
        batches = _batches([images], self.config.batch_size)
        cache: list[torch.Tensor] | None = []
        cached_bytes = 0
        part = GaussianAccumulator()
        for _, pictures in iter_decoded(batches, self.config.workers, []):
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
        rest = subtract_states(self.state, part.state, out=part.state)  # reuses S_k's buffer
        mean, factor = finalise(rest, self.config.epsilon, self.embedder.grid_shape)
        del rest, part
        embedded_batches = cache if cache is not None else (
            self.embedder(self.embedder.preprocess(pictures)) for _, pictures in iter_decoded(batches, self.config.workers, []))
        values = []
        for embedded in embedded_batches:
            squared = squared_mahalanobis(embedded, mean, factor)  # (B, P)
            maps = anomaly_maps(squared, self.embedder.grid_shape, self.config.image_size, self.config.blur_sigma)
            values.append(image_scores(maps).to(torch.float64))
            if not sample:
                sample.append(embedded)
            bar.update(embedded.shape[0])
        return torch.cat(values)

    # ------------------------------------------------------------------ the detector
    def finish(self, calibration: Calibration, sample: torch.Tensor | None, info: dict) -> PadimDetector:
        """Precision factors from :attr:`state`, and the detector with ``calibration``."""
        if self.count < 2:
            raise FitError(f"need at least 2 fitted images, have {self.count}")
        mean, factor = finalise(self.state, self.config.epsilon, self.embedder.grid_shape)
        detector = PadimDetector(self.config, self.backbone_state, self.weights, self.embedding, mean, factor,
                                 calibration, self.device, info, state=self.state, image_digests=self.image_digests)
        detector.storage_dtype = choose_precision_dtype(detector, sample, self.config.precision_dtype)
        return detector

    def save_partial(self, path: str | Path, info: dict) -> None:
        """Write the accumulators alone (``train --partial``), to be combined by :func:`merge_fits`."""
        if self.state is None:
            raise FitError("nothing has been fitted")
        tensors = {
            "accumulator.count": self.state.count,
            "accumulator.mean": self.state.mean,
            "accumulator.comoment": pack_lower(self.state.comoment),
            "image_digests": self.image_digests,
            **embedding_tensors(self.embedding),
            **{f"backbone.{k}": v for k, v in self.backbone_state.items()},
        }
        header = {"kind": "padim-partial", "has_accumulators": True,
                  **common_header(self.config, self.weights, self.embedding), **info}
        save_artifact(path, tensors, header)


# ---------------------------------------------------------------------- whole runs
def fit_detector(config: PadimConfig, images: Sequence[TrainingImage], resume: Fit | None = None,
                 progress: bool = True, shard: tuple[int, int] | None = None) -> tuple[PadimDetector | None, FitReport]:
    """Fit (or go on fitting) a detector on normal images, with cross-fitted calibration.

    Args:
        config: the configuration (ignored for ``resume``, which keeps its own).
        images: every rank's images, each with its name (path relative to the data directory).
        resume: a fit loaded from a model file: the images are added to its statistics, and
            their out-of-fold scores to its calibration scores.
        progress: progress bars on stderr.
        shard: ``(rank, world_size)`` inside an initialised ``torch.distributed`` group.

    Returns:
        The detector (``None`` on ranks other than 0) and what happened to the images.

    Raises:
        FitError: too few readable images, or none that could be scored out-of-fold.
    """
    started = time.perf_counter()
    fit = resume if resume is not None else Fit.start(config)
    config = fit.config
    report = FitReport()
    groups = fit.ordered(images, report)
    earlier_count = fit.count
    with _timed(report, "fit"):
        fit.accumulate(groups, report, progress, shard)
    _check_enough(fit, report, earlier_count)
    with _timed(report, "calibrate"):
        scores, sample = fit.out_of_fold_scores(groups, report, progress, shard)
    if shard is not None and shard[0] != 0:
        return None, report
    earlier = fit.earlier.scores if fit.earlier is not None else ()
    if not len(scores) and not earlier:
        raise FitError(f"no image could be scored out-of-fold: the {fit.count} readable images all fall in one of the "
                       f"{config.calibration_folds} calibration folds (folds come from file names); add images")
    all_scores = torch.cat([torch.tensor(earlier, dtype=torch.float64), scores])
    try:
        calibration = Calibration.from_scores(all_scores, config.false_alarm_rate, earlier_scores=len(earlier))
    except CalibrationError as error:
        raise FitError(f"the {fit.count} fitted images cannot be calibrated: {error}. "
                       "Train on images of different parts or shots, as the line will see them") from None
    _warn_about(report, calibration, fit)
    info = _run_info(fit, report, started, shard, resumed=resume is not None)
    with _timed(report, "finish"):
        detector = fit.finish(calibration, sample, info)
    return detector, report


def fit_partial(config: PadimConfig, images: Sequence[TrainingImage], progress: bool = True,
                shard: tuple[int, int] | None = None) -> tuple[Fit, FitReport]:
    """Pass 1 alone, for ``train --partial``: the statistics of every image, no calibration."""
    started = time.perf_counter()
    fit = Fit.start(config)
    report = FitReport()
    fit.accumulate(fit.ordered(images, report), report, progress, shard)
    if not fit.count:
        raise FitError(f"none of the {report.listed} images could be read ({_some(report.unreadable)})")
    fit.history.update(_run_info(fit, report, started, shard, resumed=False))
    del fit.history["calibration_source"]  # a partial fit has no calibration
    return fit, report


def merge_fits(parts: Sequence[Fit], sources: Sequence[str], calibration_images: Sequence[Path],
               runtime: PadimConfig, false_alarm_rate: float | None = None,
               progress: bool = True) -> PadimDetector:
    """Combine fits of disjoint images (``train --partial``) and calibrate on images none of them fitted.

    The merged statistics equal a one-shot fit of every part's images. The threshold comes from
    the scores of ``calibration_images`` under the merged model: images it has not seen, so
    their scores are held out as out-of-fold ones are (no fold needs removing).

    Raises:
        FitError: parts whose settings or weights differ (naming the first two), calibration
            images that a part fitted, or none readable.
    """
    if not parts:
        raise FitError("nothing to merge")
    first = parts[0]
    for part, source in zip(parts, sources):
        clash = statistics_clash(first.config, part.config)
        if clash:
            key = clash[0]
            raise FitError(f"{source}: {key}={getattr(part.config, key)!r} but {sources[0]} has "
                           f"{getattr(first.config, key)!r}; parts must come from the same configuration")
        if part.weights.sha256 != first.weights.sha256:
            raise FitError(f"{source}: other backbone weights than {sources[0]} (sha256 {part.weights.sha256[:12]} vs "
                           f"{first.weights.sha256[:12]})")
        if not _same_embedding(part.embedding, first.embedding):
            raise FitError(f"{source}: another channel selection than {sources[0]} (different --seed or --features)")
    started = time.perf_counter()
    config = first.config.replace(batch_size=runtime.batch_size, device=runtime.device, workers=runtime.workers,
                                  false_alarm_rate=false_alarm_rate)
    merged = Fit(config, first.backbone_state, first.weights, first.embedding, first.state.clone(),
                 torch.cat([p.image_digests for p in parts]).sort().values)
    for part in parts[1:]:
        merge_states_(merged.state, part.state.to(merged.device))
    fitted = set(merged.image_digests.tolist())
    seen = [p for p in calibration_images if file_digest(p) in fitted]
    if seen:
        raise FitError(f"{len(seen)} calibration image(s) were fitted in the parts ({_some([(str(p), '') for p in seen])}); "
                       "calibration needs normal images that no part has seen")
    mean, factor = finalise(merged.state, config.epsilon, merged.embedder.grid_shape)
    unreadable: list[tuple[Path, str]] = []
    values, sample = [], None
    batches = _batches([[TrainingImage(p, p.name) for p in calibration_images]], config.batch_size)
    with tqdm(total=len(calibration_images), desc="calibrate", unit="img", disable=not progress, leave=False) as bar:
        for paths, pictures in iter_decoded(batches, config.workers, unreadable):
            embedded = merged.embedder(merged.embedder.preprocess(pictures))
            sample = embedded if sample is None else sample
            squared = squared_mahalanobis(embedded, mean, factor)
            maps = anomaly_maps(squared, merged.embedder.grid_shape, config.image_size, config.blur_sigma)
            values.append(image_scores(maps).to(torch.float64).cpu())
            bar.update(len(paths))
    if not values:
        raise FitError(f"none of the {len(calibration_images)} calibration images could be read "
                       f"({_some([(str(p), m) for p, m in unreadable])})")
    try:
        calibration = Calibration.from_scores(torch.cat(values), config.false_alarm_rate)
    except CalibrationError as error:
        raise FitError(f"the calibration images cannot set a threshold: {error}") from None
    info = {
        "created": _now(), "padim_version": __version__, "fit_image_count": merged.count,
        "calibration_source": "held_out", "unreadable_image_count": len(unreadable),
        "fit_seconds": round(time.perf_counter() - started, 3), "merged_from": list(sources),
        "fits": [f for p in parts for f in p.history.get("fits", [])],
    }
    detector = PadimDetector(config, merged.backbone_state, merged.weights, merged.embedding, mean, factor, calibration,
                             merged.device, info, state=merged.state, image_digests=merged.image_digests)
    detector.storage_dtype = choose_precision_dtype(detector, sample, config.precision_dtype)
    if unreadable:
        log.warning("left out %d unreadable calibration image(s): %s", len(unreadable),
                    _some([(str(p), m) for p, m in unreadable]))
    return detector


def statistics_clash(a: PadimConfig, b: PadimConfig) -> list[str]:
    """Names of the fields that decide the statistics and differ between ``a`` and ``b``."""
    return [k for k in STATISTICS_FIELDS if getattr(a, k) != getattr(b, k)]


def file_digest(path: Path) -> int:
    """First 8 bytes of the sha256 of a file's content, as a signed int64 (a fitted image's identity)."""
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def shard_of(items: Sequence, shard: tuple[int, int] | None) -> list:
    """This rank's contiguous share of ``items`` (all of them without a shard)."""
    rank, world = shard or (0, 1)
    return list(items[rank * len(items) // world : (rank + 1) * len(items) // world])


# ---------------------------------------------------------------------- helpers
def _batches(groups: Sequence[Sequence[TrainingImage]], batch_size: int) -> list[list[Path]]:
    """Batches of paths that never straddle two groups (folds)."""
    return [[i.path for i in group[s : s + batch_size]] for group in groups for s in range(0, len(group), batch_size)]


def _together(run, shard: tuple[int, int] | None, device: torch.device) -> None:
    """Run ``run`` on every rank; a failure on any rank stops every rank before the next collective.

    The ranks agree on failure first, so none waits forever for a peer that has gone.
    """
    if shard is None:
        run()
        return
    import torch.distributed as dist

    error: Exception | None = None
    try:
        run()
    except Exception as caught:  # reported below, after every rank knows
        error = caught
    failed = torch.tensor([1.0 if error else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if float(failed) > 0:
        raise FitError(f"{int(failed)} other rank(s) failed; see their messages")


@contextlib.contextmanager
def _timed(report: FitReport, phase: str):
    started = time.perf_counter()
    try:
        yield
    finally:
        report.seconds[phase] = round(time.perf_counter() - started, 3)


def _check_enough(fit: Fit, report: FitReport, earlier_count: int) -> None:
    if report.listed and report.fitted == 0 and not report.already_fitted:
        raise FitError(f"none of the {report.listed} images could be read ({_some(report.unreadable)}); "
                       f"a detector needs at least {MIN_IMAGES} readable normal images")
    if fit.count < MIN_IMAGES:
        unread = f", {len(report.unreadable)} unreadable ({_some(report.unreadable)})" if report.unreadable else ""
        raise FitError(f"{fit.count} readable image(s){unread}: a detector needs at least {MIN_IMAGES} normal "
                       "images (2 to fit, and more to calibrate its threshold); a few dozen give a useful one")
    if report.listed and report.fitted == 0 and earlier_count:
        raise FitError(f"all {report.listed} images were already fitted in the resumed model; nothing to add")


def _warn_about(report: FitReport, calibration: Calibration, fit: Fit) -> None:
    if report.unreadable:
        report.warnings.append(f"left out {len(report.unreadable)} unreadable image(s): {_some(report.unreadable)}")
    if report.already_fitted:
        report.warnings.append(f"left out {len(report.already_fitted)} image(s) the resumed model had already fitted "
                               f"(same content): {_some([(n, '') for n in report.already_fitted])}")
    if report.unscored:
        report.warnings.append(f"{len(report.unscored)} image(s) have no out-of-fold score: their calibration fold "
                               f"holds all but {fit.count - len(report.unscored)} of the images")
    if calibration.earlier_scores:
        report.warnings.append(
            f"{calibration.earlier_scores} of the {calibration.count} calibration scores are kept from the resumed "
            "model: its fits scored them with fewer images, so they run slightly high and the threshold errs "
            "towards fewer false alarms; a one-shot fit on all images recalibrates them all")
    shortfall = calibration.shortfall()
    if shortfall:
        report.warnings.append(shortfall)
    if report.copies:
        shown = "; ".join(" = ".join(group) for group in report.copies[:3])
        more = f" and {len(report.copies) - 3} more" if len(report.copies) > 3 else ""
        report.warnings.append(f"{sum(len(g) - 1 for g in report.copies)} image(s) are copies of others (same content: "
                               f"{shown}{more}): a copy in another fold pulls the threshold down; remove copies")


def _run_info(fit: Fit, report: FitReport, started: float, shard, resumed: bool) -> dict:
    fits = list(fit.history.get("fits", []))
    fits.append({"created": _now(), "images": report.fitted, "unreadable": len(report.unreadable),
                 "already_fitted": len(report.already_fitted), "resumed": resumed,
                 "world_size": shard[1] if shard else 1})
    return {
        "created": _now(),
        "padim_version": __version__,
        "fit_image_count": fit.count,
        "calibration_source": "out_of_fold",
        "unreadable_image_count": int(fit.history.get("unreadable_image_count", 0)) + len(report.unreadable),
        "fit_seconds": round(time.perf_counter() - started, 3),
        "fits": fits,
    }


def _some(items: Sequence[tuple[str, str]], shown: int = 3) -> str:
    """``a.png: reason; b.png: reason and 5 more``."""
    text = "; ".join(f"{name}: {reason}" if reason else name for name, reason in items[:shown])
    return text + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _same_embedding(a: Embedding, b: Embedding) -> bool:
    if a.channel_index is not None and b.channel_index is not None:
        return torch.equal(a.channel_index, b.channel_index)
    return a.projection is not None and b.projection is not None and torch.equal(a.projection, b.projection)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

