"""Backbones, feature extraction, the detector and its fitting, built on :mod:`padim.core`."""

from .backbones import BACKBONES, BackboneSpec, WeightsError, WeightsInfo, build_backbone
from .config import ConfigError, PadimConfig
from .detector import NonFiniteScoreError, PadimDetector, ScoreOutput, resolve_device
from .features import Embedding, FeatureEmbedder, FeatureExtractor
from .fitting import Fit, FitError, FitReport, TrainingImage, fit_detector, fit_partial, merge_fits, training_images
from .images import ImageError, list_images, open_image

__all__ = [
    "BACKBONES", "BackboneSpec", "ConfigError", "Embedding", "FeatureEmbedder", "FeatureExtractor", "Fit",
    "FitError", "FitReport", "ImageError", "NonFiniteScoreError", "PadimConfig", "PadimDetector", "ScoreOutput",
    "TrainingImage", "WeightsError", "WeightsInfo", "build_backbone", "fit_detector", "fit_partial", "list_images",
    "merge_fits", "open_image", "resolve_device", "training_images",
]
