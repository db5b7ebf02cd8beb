"""Statistics, scoring, calibration and the model file. Depends on torch alone.

Names are resolved on first use (PEP 562), so that ``padim.core.version`` and ``padim --help``
do not import torch.
"""

from .lazy import lazy_exports

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
