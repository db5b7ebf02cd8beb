"""A model that learns from its reviews: pictures confirmed normal added, pictures found not normal taken out.

Both are exact, and neither fits the model again:

- **adding** is ``train --resume``: the pictures go through the backbone once, their statistics are merged
  into the file's (Chan et al.), and their out-of-fold scores join the calibration, whose earlier scores are
  kept from their own fits (:func:`padim.models.fit.training.train`);
- **taking out** (an undo of a wrong review) re-embeds the picture's bytes with the file's own embedder and
  removes its rows from the statistics (:func:`padim.core.statistics.downdate_state_`: ``n - 1``,
  ``mu' = mu - (x - mu) / (n - 1)``, ``M' = M - n / (n - 1) v v^T``; the picture's tiles when tiles share
  the statistics, and its changed copy's rows when copies are fitted), its digest from the fitted ones, and
  its calibration values from the calibration (:meth:`padim.core.calibration.Calibration.without`; a file
  older than format 9 has no link from a score to its picture, so the score stays).

The result is a new model file; the file read is not changed. Pictures are named by their content's sha256
(:func:`picture_name`): the name decides the fold and the draw of the changed copy (``expect``), so a picture
taken out is embedded exactly as it was added.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from padim.core.artifact import read_header
from padim.core.calibration import MODEL_THRESHOLD, CalibrationError
from padim.core.errors import ArtifactError
from padim.core.statistics import NotPositiveDefiniteError, downdate_state_
from padim.models.config import PadimConfig
from padim.models.data.images import iter_for_model
from padim.models.errors import FitError, NotUpdatable
from padim.models.fit.in_progress import Fit
from padim.models.fit.model_file import load_detector, load_fit, save_fitted
from padim.models.fit.passes import TrainingImage, batches_of, file_digest
from padim.models.fit.training import MIN_IMAGES, FitReport, timed_into, train
from padim.models.scoring.detector import Provenance, now


def sha256_digest(sha256: str) -> int:
    """The fitted-image digest (:func:`~padim.models.fit.passes.file_digest`) of content with this sha256 (hex)."""
    return int.from_bytes(bytes.fromhex(sha256)[:8], "big", signed=True)


def fitted_digests(path: str | Path) -> set[int]:
    """The content digests of every picture a model file's statistics hold (without reading the rest)."""
    from safetensors import safe_open  # the one tensor, not the file's statistics

    with safe_open(str(path), "pt") as handle:
        return set(handle.get_tensor("image_digests").tolist())


def picture_name(sha256: str) -> str:
    """The name a recorded picture is fitted under: its content's sha256 (hex), whatever its file is called."""
    return sha256.lower()


@dataclass
class UpdateReport:
    """What an update did.

    Attributes:
        added: names of the pictures added to the statistics.
        already_fitted: names of pictures to add that the model had fitted already (left out).
        removed: names of the pictures taken out of the statistics.
        not_fitted: names of pictures to take out that the model never fitted (nothing to take out).
        unreadable: ``(name, reason)`` of pictures that could not be decoded (left out).
        scores_removed: calibration scores taken out with their pictures.
        scores_kept: pictures taken out whose calibration score could not be found (a file older than format 9).
        fit_image_count: pictures in the new model's statistics.
        seconds: wall time of each phase (``remove``, ``add``, ``write``).
        fit: the report of the resumed fit that added pictures (``None`` when none were added).
    """

    added: list[str] = field(default_factory=list)
    already_fitted: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    not_fitted: list[str] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    scores_removed: int = 0
    scores_kept: int = 0
    fit_image_count: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    fit: FitReport | None = None

    def timed(self, phase: str) -> contextlib.AbstractContextManager[None]:
        return timed_into(self.seconds, phase)

    def to_dict(self) -> dict:
        return {
            "added": len(self.added),
            "already_fitted": len(self.already_fitted),
            "removed": len(self.removed),
            "not_fitted": len(self.not_fitted),
            "unreadable": [list(x) for x in self.unreadable],
            "scores_removed": self.scores_removed,
            "scores_kept": self.scores_kept,
            "fit_image_count": self.fit_image_count,
            "seconds": self.seconds,
            "warnings": list(self.fit.warnings) if self.fit is not None else [],
        }


def load_updatable(source: str | Path, run_options: PadimConfig | None = None) -> Fit:
    """The fit of a model file with statistics, to be updated.

    Raises:
        NotUpdatable: an export directory, a ``--slim`` file, or a file that cannot be read; the message says
            what to do.
    """
    source = Path(source)
    if source.is_dir():
        raise NotUpdatable(
            f"{source.name}: an export directory holds no statistics; update the model file it was "
            "exported from (a version made by padim train without --slim), then export again"
        )
    try:
        return load_fit(source, run_options)
    except ArtifactError as error:
        if "--slim" in str(error):
            raise NotUpdatable(
                "the model file was saved with --slim, without the statistics an update extends; "
                "train it again without --slim (or on every picture) and add it as a version"
            ) from None
        raise NotUpdatable(f"the model file cannot be updated: {error}") from None


def update_model(
    source: str | Path,
    add: Sequence[TrainingImage],
    remove: Sequence[TrainingImage],
    output: str | Path,
    run_options: PadimConfig | None = None,
    progress: bool = False,
    scratch_dir: str | Path | None = None,
    on_progress=None,
) -> UpdateReport:
    """A new model file ``output``: ``source`` with the pictures of ``remove`` taken out and those of ``add``
    added, exactly (module docstring). ``source`` is not changed.

    Args:
        add, remove: pictures named by :func:`picture_name` of their content (as they were added).
        run_options: batch size, device and workers (the rest comes from the file).
        on_progress: called with ``(phase, done, total)`` as pictures are taken out and added.

    Raises:
        NotUpdatable: ``source`` has no statistics (an export, ``--slim``).
        FitError: nothing to do, too few pictures left, or none of those to add readable.
    """
    started = time.perf_counter()
    report = UpdateReport()
    fit = load_updatable(source, run_options)
    precision = read_header(source).get("precision_dtype", "float32")
    progress_to = on_progress or (lambda *_: None)
    with report.timed("remove"):
        _take_out(fit, remove, report, progress_to)
    if fit.count < MIN_IMAGES:
        raise FitError(
            f"taking out {len(report.removed)} picture(s) would leave {fit.count}: a detector needs at "
            f"least {MIN_IMAGES}"
        )
    fitted = set(fit.image_digests.tolist())
    fresh: list[TrainingImage] = []
    already: list[TrainingImage] = []
    for image in add:
        (already if file_digest(image.path) in fitted else fresh).append(image)
    report.already_fitted = [i.name for i in already]
    if not fresh and not report.removed:
        raise FitError("nothing to update: every picture to add is fitted already, and none to take out was fitted")
    progress_to("add", 0, len(fresh))
    if fresh:
        with report.timed("add"):
            report.fit = train(fit.config, fresh, output, resume=fit, progress=progress, scratch_dir=scratch_dir)
        report.added = [i.name for i in fresh if i.name not in {n for n, _ in report.fit.unreadable}]
        report.unreadable += report.fit.unreadable
    else:
        with report.timed("write"):
            _write_statistics_only(fit, output, scratch_dir, precision, started, report)
    progress_to("add", len(fresh), len(fresh))
    report.fit_image_count = fit.count
    return report


def _take_out(fit: Fit, remove: Sequence[TrainingImage], report: UpdateReport, on_progress) -> None:
    """Remove ``remove``'s pictures (those the fit holds) from its statistics, digests and calibration."""
    fitted = fit.image_digests.tolist()
    known = set(fitted)
    doomed: dict[Path, tuple[str, int]] = {}
    for image in remove:
        digest = file_digest(image.path)
        if digest in known and digest not in {d for _, d in doomed.values()}:
            doomed[image.path] = (image.name, digest)
        else:
            report.not_fitted.append(image.name)
    if not doomed:
        return
    if fit.statistics is None:
        raise NotUpdatable("the model file holds no statistics to take pictures out of")
    unreadable: list[tuple[Path, str]] = []
    done = 0
    on_progress("remove", 0, len(doomed))
    taken: set[int] = set()
    for paths, images, copies in fit.reading.decoded(
        batches_of([[TrainingImage(p, n) for p, (n, _) in doomed.items()]], fit.config.run.batch_size),
        unreadable,
        lambda path: doomed[path][0],
    ):
        names = [doomed[p][0] for p in paths]
        with torch.no_grad():
            # (pictures x fitted rows, P, D), as fitted
            rows = fit.reading.fitted(fit.reading.embed(names, images, copies))
        try:
            downdate_state_(fit.statistics, rows.to(fit.statistics.mean.device))
        except ValueError as error:
            raise FitError(str(error)) from None
        report.removed += names
        taken |= {doomed[p][1] for p in paths}
        done += len(paths)
        on_progress("remove", done, len(doomed))
    report.unreadable += [(doomed[p][0], reason) for p, reason in unreadable]
    for digest in taken:
        fitted.remove(digest)
    fit.image_digests = torch.tensor(sorted(fitted), dtype=torch.int64)
    if fit.earlier is not None:
        try:
            fit.earlier, found = fit.earlier.without(taken)
        except CalibrationError as error:
            raise FitError(f"the calibration cannot be set again without the pictures taken out: {error}") from None
        report.scores_removed, report.scores_kept = found, len(taken) - found
    int8 = fit.earlier_int8
    if int8 is not None and int8.calibration is not None:  # its values too: linked to the same pictures
        try:
            fit.earlier_int8 = dataclasses.replace(int8, calibration=int8.calibration.without(taken)[0])
        except CalibrationError:  # too few left to set its threshold: the update has none, and says why
            fit.earlier_int8 = None


def _write_statistics_only(
    fit: Fit, output: str | Path, scratch_dir, precision: str, started: float, report: UpdateReport
) -> None:
    """The file of a fit whose statistics changed but that scored no new picture: factors, the same calibration."""
    scratch = Path(scratch_dir or Path(output).parent)
    try:
        finished = fit.finish([], scratch, with_statistics=True, progress=False)
    except NotPositiveDefiniteError as error:
        raise FitError(str(error)) from None
    finished = dataclasses.replace(finished, precision_dtype=getattr(torch, precision))
    earlier = fit.provenance
    run = {
        "created": now(),
        "images": 0,
        "removed": len(report.removed),
        "unreadable": len(report.unreadable),
        "already_fitted": 0,
        "resumed": True,
        "world_size": 1,
    }
    provenance = Provenance(
        fit_image_count=fit.count,
        calibration_source=earlier.calibration_source or "out_of_fold",
        unreadable_image_count=earlier.unreadable_image_count,
        fit_seconds=round(time.perf_counter() - started, 3),
        fits=[*earlier.fits, run],
        merged_from=list(earlier.merged_from),
        expect_measured=earlier.expect_measured,
        shrinkage_estimated=finished.shrinkage,
    )
    try:
        if fit.earlier is None:
            raise FitError("the model file has no calibration to keep")
        save_fitted(output, fit, finished, fit.earlier, provenance, with_statistics=True, int8_scorer=fit.earlier_int8)
    finally:
        if finished.factors is not None:
            finished.factors.close()


@dataclass(frozen=True)
class Gate:
    """The new version against the old on reviewed pictures: recall on defects, false alarms on normal pictures.

    Attributes:
        defects: reviewed defect pictures scored.
        normals: reviewed normal pictures the new version did not fit (held out), scored.
        caught_old, caught_new: defects each version flags (at its own threshold).
        false_alarms_old, false_alarms_new: held-out normal pictures each flags.
        max_recall_drop: the share recall may fall by (``PADIM_UPDATE_MAX_RECALL_DROP``).
    """

    defects: int
    normals: int
    caught_old: int
    caught_new: int
    false_alarms_old: int
    false_alarms_new: int
    max_recall_drop: float

    @property
    def recall_old(self) -> float | None:
        return self.caught_old / self.defects if self.defects else None

    @property
    def recall_new(self) -> float | None:
        return self.caught_new / self.defects if self.defects else None

    @property
    def passed(self) -> bool:
        """Recall fell by at most ``max_recall_drop``, or by a single defect (always allowed)."""
        lost = self.caught_old - self.caught_new
        return lost <= 1 or lost / self.defects <= self.max_recall_drop + 1e-12

    def why(self) -> str:
        if not self.defects:
            return "no reviewed defect to measure recall on: review some defects to gate updates"
        text = (
            f"recall on {self.defects} reviewed defect(s) {self.recall_old:.1%} -> {self.recall_new:.1%} "
            f"(allowed drop {self.max_recall_drop:.1%}, or one defect)"
        )
        if self.normals:
            text += (
                f"; false alarms on {self.normals} held-out reviewed normal(s) {self.false_alarms_old} -> "
                f"{self.false_alarms_new}"
            )
        return text

    def to_dict(self) -> dict:
        return {
            "defects": self.defects,
            "normals": self.normals,
            "caught_old": self.caught_old,
            "caught_new": self.caught_new,
            "recall_old": self.recall_old,
            "recall_new": self.recall_new,
            "false_alarms_old": self.false_alarms_old,
            "false_alarms_new": self.false_alarms_new,
            "max_recall_drop": self.max_recall_drop,
            "passed": self.passed,
            "why": self.why(),
        }


def flagged(model_path: str | Path, pictures: Sequence[Path], device: str = "cpu", batch_size: int = 8) -> list[bool]:
    """Whether the model of ``model_path`` flags each picture at its own threshold (unreadable pictures: ``False``)."""
    if not pictures:
        return []
    detector = load_detector(model_path, device)
    verdicts: dict[Path, bool] = {}
    with torch.no_grad():
        for paths, images in iter_for_model(pictures, detector.config, batch_size, workers=1, unreadable=[]):
            raw = detector.score(detector.preprocess(images)).raw_scores.cpu()
            for path, value in zip(paths, raw.tolist(), strict=True):
                verdicts[path] = detector.calibration.score(value) >= MODEL_THRESHOLD
    return [verdicts.get(p, False) for p in pictures]


def gate(
    old_path: str | Path,
    new_path: str | Path,
    defects: Sequence[Path],
    normals: Sequence[Path],
    max_recall_drop: float,
    device: str = "cpu",
) -> Gate:
    """Score the reviewed defects and the held-out reviewed normals with the old and the new version."""
    old = flagged(old_path, [*defects, *normals], device)
    new = flagged(new_path, [*defects, *normals], device)
    d = len(defects)
    return Gate(d, len(normals), sum(old[:d]), sum(new[:d]), sum(old[d:]), sum(new[d:]), max_recall_drop)
