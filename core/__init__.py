"""Statistics, scoring, calibration and the model file. Depends on torch alone."""

from .artifact import ArtifactError, load_artifact, read_header, save_artifact
from .calibration import Calibration, split_holdout
from .scoring import anomaly_maps, image_scores, squared_mahalanobis
from .statistics import (
    GaussianAccumulator,
    GaussianState,
    NotPositiveDefiniteError,
    covariance,
    merge_states,
    precision,
    precision_factor,
)

__all__ = [
    "ArtifactError", "Calibration", "GaussianAccumulator", "GaussianState",
    "NotPositiveDefiniteError", "anomaly_maps", "covariance", "image_scores", "load_artifact",
    "merge_states", "precision", "precision_factor", "read_header", "save_artifact",
    "split_holdout", "squared_mahalanobis",
]
