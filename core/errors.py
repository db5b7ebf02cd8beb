"""The error family: every error padim raises for a reason a user can act on is a :class:`PadimError`.

A caller catches ``PadimError`` once and still tells the cases apart by subclass; what each case
becomes (exit status, HTTP status, error code) is one table, :data:`padim.models.errors.OUTCOMES`.
The core's own cases are here; the rest are in :mod:`padim.models.errors`. Each keeps the
built-in base it had (``ValueError`` for bad values, ...), so ``except ValueError`` still works.

Example:
    >>> issubclass(CalibrationError, PadimError) and issubclass(CalibrationError, ValueError)
    True
"""


class PadimError(Exception):
    """An error whose message is one line meant for the user (no traceback needed)."""


class ArtifactError(PadimError):
    """A model file that cannot be used; the message is one line meant for the user."""


class CalibrationError(PadimError, ValueError):
    """Scores that cannot give a threshold; the message says why."""


class NotPositiveDefiniteError(PadimError, ValueError):
    """A regularised covariance matrix has no Cholesky factorisation."""
