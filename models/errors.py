"""The error family's cases above the core, and the one table of what each case becomes.

Every error here is a :class:`~padim.core.errors.PadimError`: the command line catches
``PadimError`` once and exits with :attr:`Outcome.exit_status`; the service catches it once and
answers :attr:`Outcome.http_status` with :attr:`Outcome.code`. A new case is a subclass here
and, where it should not be answered as its parent is, a row in :data:`OUTCOMES`.

This module imports no torch: ``padim --help`` and ``padim health`` load it.

Example:
    >>> outcome(ImageTooLarge("a.png", "too many pixels")).http_status
    413
    >>> outcome(ImageError("a.png", "not an image")).code
    'invalid_image'
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from padim.core.errors import ArtifactError, CalibrationError, NotPositiveDefiniteError, PadimError

#: The operating system's errors of a full disk: ENOSPC, and EDQUOT (a quota's).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class UsageError(PadimError, ValueError):
    """What was asked cannot be done as asked: a missing file, options that contradict each other."""


class ConfigError(PadimError, ValueError):
    """A configuration value is not allowed; the message says which values are."""


class WeightsError(PadimError, RuntimeError):
    """Backbone weights that cannot be had or do not fit; the message says what to do."""


class ImageError(PadimError, ValueError):
    """An input that is not a readable image: ``"<name>: <reason>"``, with both parts as attributes."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"{name}: {reason}")
        self.name, self.reason = name, reason


class ImageTooLarge(ImageError):
    """An image with more pixels than allowed (a decompression bomb, or just too big)."""


class FitError(PadimError, ValueError):
    """A fit that cannot go on; the message is one line that says what to do."""


class DoesNotFit(FitError):
    """A fit that would run out of memory; the message says what would fit."""


class RankFailed(PadimError, RuntimeError):
    """Another rank of a distributed fit failed; its own message is in its output."""


class ExportError(PadimError):
    """An export that cannot be made or an export directory that cannot be used (one line)."""


class PrecisionGateFailed(FitError):
    """A model fitted at a reduced precision (``train --precision``) moved scores past its tolerance: nothing was
    written. ``check``: the gate's reading (a :class:`~padim.models.fit.precision.PrecisionCheck`), where known."""

    check = None


class AccuracyGateFailed(ExportError):
    """A quantised scorer (``padim export --precision``) moved scores past its tolerance: nothing was written."""


class NonFiniteScoreError(PadimError, ArithmeticError):
    """A score or map that is NaN or infinite: no verdict may be given from it.

    Attributes:
        source: the picture it was computed from, where the caller knows it (``Detector.iter_predict``).
    """

    source: str | None = None


class VersionNotFound(UsageError):
    """A model version (or a model) the repository does not have."""


class UnservableModel(UsageError):
    """A model file or export that cannot be served: damaged, foreign, newer, or unfit for this service."""


class DigestMismatch(UsageError):
    """An upload whose body does not have the sha256 its ``X-Content-SHA256`` header says."""


class InsufficientMemory(UsageError):
    """Not enough free memory (or GPU memory) to hold another version beside the active ones."""


class DiskFull(PadimError, OSError):
    """The disk that would keep a file is full (or over its quota): nothing of it was kept, what was there is
    unchanged. :meth:`of` names the file of the operating system's error."""

    @classmethod
    def of(cls, error: OSError, advice: str = "free space and try again") -> DiskFull:
        where = f" ({error.filename})" if error.filename else ""
        return cls(f"the disk is full{where}: {error.strerror or error}; nothing of it was kept; {advice}")


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` is a full disk's (ENOSPC, or a quota's EDQUOT)."""
    return isinstance(error, DiskFull) or (isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS)


class Conflict(UsageError):
    """A change that the repository's current state does not allow; the message says what would."""


class NothingToRollBack(Conflict):
    """A rollback with no earlier activation to go back to."""


class VersionActive(Conflict):
    """Removing the active version."""


class ReadOnlyModels(Conflict):
    """Changing models served from PADIM_MODELS / PADIM_MODEL_DIR (a fixed set, not a repository)."""


class DefaultModel(Conflict):
    """Unloading the default model."""


class ModelBusy(Conflict):
    """Another change of the same model is under way."""


class NotUpdatable(UsageError):
    """A model that cannot learn from reviews: an export directory, or a file saved without statistics (--slim)."""


class NothingToUpdate(Conflict):
    """An update with no picture to add or take out."""


class UpdateGateFailed(Conflict):
    """Activating an updated version whose gate found recall fell by more than allowed (without ``force``)."""


class TooFewLinePictures(Conflict):
    """A threshold sized by the line asked for before the line has scored enough pictures to promise its rate."""


class LineChanged(Conflict):
    """Activating a threshold the line set while what the line scored since reads as drift (without ``force``)."""


class RecordNotFound(UsageError):
    """A record (or a job) the inspection record does not have."""


class RecordGone(UsageError):
    """What a record needs is gone for good: its picture was evicted, or the version that scored it was deleted."""


class RecordUnavailable(PadimError, RuntimeError):
    """A row that could not be made durable (the journal is full, or its disk failed) where one is required."""


@dataclass(frozen=True)
class Outcome:
    """What a case becomes: the command line's exit status, the service's HTTP status and error code."""

    exit_status: int
    http_status: int
    code: str


#: One row per case; a subclass without a row is answered as its nearest parent with one.
OUTCOMES: dict[type[PadimError], Outcome] = {
    PadimError: Outcome(1, 500, "error"),
    UsageError: Outcome(1, 422, "invalid_request"),
    ConfigError: Outcome(1, 422, "invalid_config"),
    ImageError: Outcome(1, 422, "invalid_image"),
    ImageTooLarge: Outcome(1, 413, "image_too_large"),
    ArtifactError: Outcome(1, 500, "invalid_model_file"),
    ExportError: Outcome(1, 500, "invalid_export"),
    AccuracyGateFailed: Outcome(4, 500, "accuracy_gate_failed"),
    WeightsError: Outcome(1, 500, "weights_unavailable"),
    CalibrationError: Outcome(1, 500, "calibration_failed"),
    NotPositiveDefiniteError: Outcome(1, 500, "not_positive_definite"),
    FitError: Outcome(1, 500, "fit_failed"),
    RankFailed: Outcome(1, 500, "rank_failed"),
    NonFiniteScoreError: Outcome(1, 500, "non_finite_score"),
    VersionNotFound: Outcome(1, 404, "version_not_found"),
    UnservableModel: Outcome(1, 422, "invalid_model"),
    DigestMismatch: Outcome(1, 400, "digest_mismatch"),
    InsufficientMemory: Outcome(1, 507, "insufficient_memory"),
    DiskFull: Outcome(1, 507, "insufficient_storage"),
    Conflict: Outcome(1, 409, "conflict"),
    NothingToRollBack: Outcome(1, 409, "nothing_to_roll_back"),
    VersionActive: Outcome(1, 409, "version_active"),
    ReadOnlyModels: Outcome(1, 409, "read_only_models"),
    DefaultModel: Outcome(1, 409, "default_model"),
    ModelBusy: Outcome(1, 409, "model_busy"),
    NotUpdatable: Outcome(1, 422, "not_updatable"),
    NothingToUpdate: Outcome(1, 409, "nothing_to_update"),
    UpdateGateFailed: Outcome(1, 409, "update_gate_failed"),
    TooFewLinePictures: Outcome(1, 409, "too_few_line_pictures"),
    LineChanged: Outcome(1, 409, "line_changed"),
    RecordNotFound: Outcome(1, 404, "record_not_found"),
    RecordGone: Outcome(1, 410, "gone"),
    RecordUnavailable: Outcome(1, 503, "record_unavailable"),
}


def outcome(error: PadimError) -> Outcome:
    """The row of ``error``'s class, or of its nearest parent that has one."""
    return next(OUTCOMES[cls] for cls in type(error).__mro__ if cls in OUTCOMES)
