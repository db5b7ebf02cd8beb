"""Training runs: a new fit, a resumed one, partial fits and their merge, with what happened to each image.

These are what ``padim train`` and ``padim merge`` run (and the Python API). Each turns a list of
:class:`~padim.models.fitting.TrainingImage` into a
:class:`~padim.models.detector.PadimDetector` through a :class:`~padim.models.fitting.Fit`,
and says in a :class:`FitReport` which images were left out and why, and what the threshold
can promise.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from padim.core.calibration import Calibration, CalibrationError, fold_of
from padim.core.statistics import finalise, merge_states_

from .config import PadimConfig
from .detector import PadimDetector, Provenance, choose_precision_dtype, now
from .distributed import Shard
from .fitting import Fit, TrainingImage, batches_of, file_digest
from .images import decode_side, iter_decoded, list_images
from .model import PadimModel

#: Fewest readable images a new detector is fitted on: two for a covariance, and more to calibrate.
MIN_IMAGES = 3


class FitError(ValueError):
    """A fit that cannot go on; the message is one line that says what to do."""


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
    """

    listed: int = 0
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    already_fitted: list[str] = field(default_factory=list)
    copies: list[list[str]] = field(default_factory=list)
    folds: dict[str, int] = field(default_factory=dict)
    unscored: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def fitted(self) -> int:
        return self.listed - len(self.unreadable) - len(self.already_fitted)

    @contextlib.contextmanager
    def timed(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = round(time.perf_counter() - started, 3)


def fit_detector(config: PadimConfig, images: Sequence[TrainingImage], resume: Fit | None = None,
                 progress: bool = True, shard: Shard | None = None) -> tuple[PadimDetector | None, FitReport]:
    """Fit (or go on fitting) a detector on normal images, with cross-fitted calibration.

    Args:
        config: the configuration (ignored for ``resume``, which keeps its own).
        images: every rank's images, each with its name (path relative to the data directory).
        resume: a fit loaded from a model file: the images are added to its statistics, and
            their out-of-fold scores to its calibration scores. Images it already fitted (same
            content) are left out.
        progress: progress bars on stderr.
        shard: this process's place under ``torch.distributed`` (see :mod:`padim.models.distributed`).

    Returns:
        The detector (``None`` on ranks other than 0) and what happened to the images.

    Raises:
        FitError: too few readable images, none that could be scored out-of-fold, or images
            that do not vary.
    """
    started = time.perf_counter()
    fit = resume if resume is not None else Fit.start(config)
    config = fit.config
    report = FitReport()
    images = _leave_out_fitted(fit, images, report)
    groups = fit.groups(images)
    earlier_count = fit.count
    with report.timed("fit"):
        found = fit.accumulate(groups, progress, shard)
    _record(report, found)
    _check_enough(fit, report, earlier_count)
    unreadable = {name for name, _ in report.unreadable}
    with report.timed("calibrate"):
        scores, report.unscored, sample = fit.out_of_fold_scores(
            [[i for i in group if i.name not in unreadable] for group in groups], progress, shard)
    if shard is not None and not shard.main:
        return None, report
    earlier = fit.earlier.scores if fit.earlier is not None else ()
    if not len(scores) and not earlier:
        raise FitError(f"no image could be scored out-of-fold: the {fit.count} readable images all fall in one of the "
                       f"{config.calibration_folds} calibration folds (folds come from file names); add images")
    try:
        calibration = Calibration.from_scores(torch.cat([torch.tensor(earlier, dtype=torch.float64), scores]),
                                              config.false_alarm_rate, earlier_scores=len(earlier))
    except CalibrationError as error:
        raise FitError(f"the {fit.count} fitted images cannot be calibrated: {error}. "
                       "Train on images of different parts or shots, as the line will see them") from None
    _warn(report, calibration, fit)
    provenance = _next_provenance(fit, report, started, shard, resumed=resume is not None, source="out_of_fold")
    with report.timed("finish"):
        detector = fit.finish(calibration, sample, provenance)
    return detector, report


def fit_partial(config: PadimConfig, images: Sequence[TrainingImage], progress: bool = True,
                shard: Shard | None = None) -> tuple[Fit, FitReport]:
    """Pass 1 alone, for ``train --partial``: the statistics of every image, no calibration."""
    started = time.perf_counter()
    fit = Fit.start(config)
    report = FitReport()
    report.listed = len(images)
    report.folds = {i.name: fold_of(i.name, config.calibration_folds) for i in images}
    with report.timed("fit"):
        found = fit.accumulate(fit.groups(images), progress, shard)
    _record(report, found)
    if not fit.count:
        raise FitError(f"none of the {report.listed} images could be read ({_some(report.unreadable)})")
    fit.provenance = _next_provenance(fit, report, started, shard, resumed=False, source=None)
    return fit, report


def merge_fits(parts: Sequence[Fit], sources: Sequence[str], calibration_images: Sequence[Path],
               runtime: PadimConfig, false_alarm_rate: float | None = None, progress: bool = True) -> PadimDetector:
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
        clash = first.config.differences(part.config)
        if clash:
            key = clash[0]
            raise FitError(f"{source}: {key}={getattr(part.config, key)!r} but {sources[0]} has "
                           f"{getattr(first.config, key)!r}; parts must come from the same configuration")
        if part.weights.sha256 != first.weights.sha256:
            raise FitError(f"{source}: other backbone weights than {sources[0]} (sha256 {part.weights.sha256[:12]} vs "
                           f"{first.weights.sha256[:12]})")
        if not first.embedding.same_reduction(part.embedding):
            raise FitError(f"{source}: another channel selection than {sources[0]} (different --seed or --embedding-dim)")
    started = time.perf_counter()
    config = first.config.with_runtime(runtime).replace(false_alarm_rate=false_alarm_rate)
    merged = Fit(config, first.weights, first.backbone_weights, first.embedding, first.statistics.clone(),
                 torch.cat([p.image_digests for p in parts]).sort().values)
    for part in parts[1:]:
        merge_states_(merged.statistics, part.statistics.to(merged.device))
    fitted = set(merged.image_digests.tolist())
    seen = [p for p in calibration_images if file_digest(p) in fitted]
    if seen:
        raise FitError(f"{len(seen)} calibration image(s) were fitted in the parts ({_some([(str(p), '') for p in seen])}); "
                       "calibration needs normal images that no part has seen")
    mean, precision_factor = finalise(merged.statistics, config.epsilon, merged.embedder.grid_shape)
    model = PadimModel(merged.embedder, mean, precision_factor, config.blur_sigma)
    unreadable: list[tuple[Path, str]] = []
    values, sample = [], None
    batches = batches_of([[TrainingImage(p, p.name) for p in calibration_images]], config.batch_size)
    with tqdm(total=len(calibration_images), desc="calibrate", unit="img", disable=not progress, leave=False) as bar:
        for paths, pictures in iter_decoded(batches, config.workers, unreadable, decode_side(config.image_size)):
            embedded = merged.embedder(merged.embedder.preprocess(pictures))
            sample = embedded if sample is None else sample
            values.append(model.score_embeddings(embedded).raw_scores.to(torch.float64).cpu())
            bar.update(len(paths))
    if not values:
        raise FitError(f"none of the {len(calibration_images)} calibration images could be read "
                       f"({_some([(str(p), m) for p, m in unreadable])})")
    try:
        calibration = Calibration.from_scores(torch.cat(values), config.false_alarm_rate)
    except CalibrationError as error:
        raise FitError(f"the calibration images cannot set a threshold: {error}") from None
    provenance = Provenance(
        fit_image_count=merged.count, calibration_source="held_out",
        unreadable_image_count=sum(p.provenance.unreadable_image_count for p in parts),
        fit_seconds=round(time.perf_counter() - started, 3), merged_from=list(sources),
        fits=[f for p in parts for f in p.provenance.fits])
    return PadimDetector(config, merged.weights, merged.backbone_weights, model, calibration, provenance,
                         merged.statistics, merged.image_digests, choose_precision_dtype(model, sample, config.precision_dtype))


# ---------------------------------------------------------------------- helpers
def _leave_out_fitted(fit: Fit, images: Sequence[TrainingImage], report: FitReport) -> list[TrainingImage]:
    """Record every image's fold, and drop those whose content ``fit`` has fitted already."""
    report.listed = len(images)
    report.folds = {i.name: fold_of(i.name, fit.config.calibration_folds) for i in images}
    if not fit.image_digests.numel():
        return list(images)
    known = set(fit.image_digests.tolist())
    fresh = []
    for image in images:
        if file_digest(image.path) in known:
            report.already_fitted.append(image.name)
        else:
            fresh.append(image)
    return fresh


def _record(report: FitReport, found) -> None:
    report.unreadable = found.unreadable
    same: dict[int, list[str]] = {}
    for name, digest in found.digests:
        same.setdefault(digest, []).append(name)
    report.copies = sorted(sorted(names) for names in same.values() if len(names) > 1)


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


def _warn(report: FitReport, calibration: Calibration, fit: Fit) -> None:
    if report.unreadable:
        report.warnings.append(f"left out {len(report.unreadable)} unreadable image(s): {_some(report.unreadable)}")
    if report.already_fitted:
        report.warnings.append(f"left out {len(report.already_fitted)} image(s) the resumed model had already fitted "
                               f"(same content): {_some([(n, '') for n in report.already_fitted])}")
    if report.copies:
        shown = "; ".join(" = ".join(group) for group in report.copies[:3])
        more = f" and {len(report.copies) - 3} more" if len(report.copies) > 3 else ""
        report.warnings.append(f"{sum(len(g) - 1 for g in report.copies)} image(s) are copies of others (same content: "
                               f"{shown}{more}): a copy in another fold pulls the threshold down; remove copies")
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


def _next_provenance(fit: Fit, report: FitReport, started: float, shard: Shard | None, resumed: bool,
                     source: str | None) -> Provenance:
    earlier = fit.provenance
    run = {"created": now(), "images": report.fitted, "unreadable": len(report.unreadable),
           "already_fitted": len(report.already_fitted), "resumed": resumed, "world_size": shard.world if shard else 1}
    return Provenance(fit_image_count=fit.count, calibration_source=source,
                      unreadable_image_count=earlier.unreadable_image_count + len(report.unreadable),
                      fit_seconds=round(time.perf_counter() - started, 3), fits=[*earlier.fits, run],
                      merged_from=list(earlier.merged_from))


def _some(items: Sequence[tuple[str, str]], shown: int = 3) -> str:
    """``a.png: reason; b.png: reason and 5 more``."""
    text = "; ".join(f"{name}: {reason}" if reason else name for name, reason in items[:shown])
    return text + (f" and {len(items) - shown} more" if len(items) > shown else "")

