"""Statistics, scoring, calibration and the model file. Depends on torch alone."""

from .artifact import ArtifactError, load_artifact, read_header, save_artifact
from .calibration import Calibration, CalibrationError, fold_of
from .scoring import anomaly_maps, image_scores, squared_mahalanobis
from .statistics import (
    GaussianAccumulator,
    GaussianState,
    NotPositiveDefiniteError,
    covariance,
    merge_states,
    precision,
    precision_factor,
    subtract_states,
)

__all__ = [
    "ArtifactError", "Calibration", "CalibrationError", "GaussianAccumulator", "GaussianState",
    "NotPositiveDefiniteError", "anomaly_maps", "covariance", "image_scores", "load_artifact",
    "merge_states", "precision", "precision_factor", "read_header", "save_artifact",
    "fold_of", "squared_mahalanobis", "subtract_states",
]
