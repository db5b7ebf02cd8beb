"""Backbones, feature extraction and the detector built on :mod:`padim.core`."""

from .backbones import BACKBONES, BackboneSpec, WeightsError, WeightsInfo, build_backbone
from .config import ConfigError, PadimConfig
from .detector import PadimDetector, ScoreOutput, fit_detector, resolve_device
from .features import Embedding, FeatureExtractor
from .images import ImageError, list_images, open_image

__all__ = [
    "BACKBONES", "BackboneSpec", "ConfigError", "Embedding", "FeatureExtractor", "ImageError",
    "PadimConfig", "PadimDetector", "ScoreOutput", "WeightsError", "WeightsInfo",
    "build_backbone", "fit_detector", "list_images", "open_image", "resolve_device",
]
