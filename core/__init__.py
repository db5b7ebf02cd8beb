"""Statistics, scoring, calibration and the model file. Depends on torch alone.

What this package's top holds, importable without torch (``padim --help``, ``padim health`` and the configuration's
declarations read it before any tensor exists): the distribution's name and version, the bounds and choices the
statistics, the scoring and the calibration accept, and :func:`lazy_exports`, by which this package and those above
it resolve their names on first use (PEP 562).

Example:
    >>> from importlib.metadata import version
    >>> DISTRIBUTION, __version__ == version("padim-inspect")
    ('padim-inspect', True)
    >>> low, high = FALSE_ALARM_RATE_RANGE
    >>> low <= 0.01 <= high
    True
    >>> names, get, _ = lazy_exports("padim.core", {"calibration": ("fold_of",)})
    >>> names
    ['fold_of']
    >>> get("fold_of").__module__
    'padim.core.calibration'
"""

import importlib
from importlib.metadata import PackageNotFoundError, version

# ------------------------------------------------------------------------------------------ the distribution
#: The distribution name on the package index ("padim" there is an unrelated project).
DISTRIBUTION = "padim-inspect"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# ------------------------------------------------------------------------------------------ what core accepts
#: Allowed range of the requested false-alarm rate (:mod:`padim.core.calibration`).
FALSE_ALARM_RATE_RANGE = (1e-6, 0.5)
#: ``--shrinkage auto``: the weight of the pooled covariance estimated from the statistics
#: (:func:`padim.core.statistics.shrinkage_intensity`).
SHRINKAGE_AUTO = "auto"
#: The largest shrinkage weight, given or estimated.
SHRINKAGE_MAX = 0.95
#: How an image score is read from its maps (:func:`padim.core.scoring.image_scores`, ``PadimConfig.image_score``):
#: the maximum of the smoothed map (the paper), the maximum of the unsmoothed feature-grid distances, or the mean of
#: the top ``top_fraction`` of the smoothed map's pixels.
IMAGE_SCORES = ("map_max", "patch_max", "top_mean")


# ------------------------------------------------------------------------------------------ names on first use
def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """``(__all__, __getattr__, __dir__)`` for a package whose ``exports`` maps submodule -> names."""
    module_of = {name: module for module, names in exports.items() for name in names}
    names = sorted(module_of)

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{module_of[name]}", package), name)

    return names, __getattr__, lambda: names


EXPORTS = {
    "errors": ("ArtifactError", "CalibrationError", "NotPositiveDefiniteError", "PadimError"),
    "artifact": ("load_artifact", "read_header", "save_artifact"),
    "calibration": ("Calibration", "fold_of"),
    "scoring": ("anomaly_maps", "image_scores", "squared_mahalanobis"),
    "statistics": (
        "GaussianAccumulator",
        "GaussianState",
        "covariance",
        "merge_states",
        "precision",
        "precision_factor",
    ),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
