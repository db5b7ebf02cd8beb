"""The detector's configuration: a small frozen dataclass, validated on construction.

Built from YAML (``configs/*.yaml``) and CLI flags by the CLI; no I/O here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .backbones import BACKBONES

REDUCTIONS = ("random", "semi_orthogonal")
DEVICES = ("auto", "cpu", "cuda")
PRECISION_DTYPES = ("auto", "float16", "float32")
WEIGHT_KEYWORDS = ("imagenet", "random")


class ConfigError(ValueError):
    """A configuration value is not allowed; the message says which values are."""


@dataclass(frozen=True)
class PadimConfig:
    """Everything that decides what a fitted detector computes.

    Attributes:
        backbone: torchvision ResNet-family name (see ``BACKBONES``).
        weights: ``imagenet`` (torchvision's weights and cache), ``random`` (seeded; demos and
            tests only) or the path of a ``state_dict`` file of the same architecture.
        layers: backbone stages whose feature maps are concatenated.
        image_size: side of the square model input, a multiple of 16.
        reduction: ``random`` channel subset (the paper) or ``semi_orthogonal`` projection
            (Kim et al. 2021).
        features: embedding size ``D`` after reduction; ``None`` = the backbone's default
            (100 for resnet18, 550 for wide_resnet50_2).
        seed: seeds the channel subset / projection and ``random`` weights.
        epsilon: added to the covariance diagonal before the Cholesky factorisation.
        blur_sigma: Gaussian smoothing of the anomaly map, in input pixels.
        holdout_fraction: share of training images kept out of the fit, for calibration.
        min_holdout: at least this many held-out images.
        threshold_quantile: quantile of held-out normal scores used as the threshold.
        batch_size: images per forward pass.
        device: ``auto`` (cuda when available), ``cpu`` or ``cuda``.
        precision_dtype: storage of the precision factor in the model file: ``auto``
            (float16 when scores stay within 1e-3 relative of float32), ``float16``, ``float32``.
        workers: threads decoding images.
    """

    backbone: str = "resnet18"
    weights: str = "imagenet"
    layers: tuple[str, ...] = ("layer1", "layer2", "layer3")
    image_size: int = 224
    reduction: str = "random"
    features: int | None = None
    seed: int = 0
    epsilon: float = 0.01
    blur_sigma: float = 4.0
    holdout_fraction: float = 0.1
    min_holdout: int = 3
    threshold_quantile: float = 0.99
    batch_size: int = 16
    device: str = "auto"
    precision_dtype: str = "auto"
    workers: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        _validate(self)

    @property
    def spec(self):
        return BACKBONES[self.backbone]

    @property
    def embedding_dim(self) -> int:
        """``D``: the configured feature count, or the backbone's default."""
        return self.features if self.features is not None else self.spec.default_features

    @property
    def is_random_weights(self) -> bool:
        return self.weights == "random"

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "config") -> PadimConfig:
        """Build from a plain mapping (parsed YAML); unknown keys are an error."""
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: expected a mapping of option: value, got {type(values).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ConfigError(
                f"{source}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
            )
        return cls(**values)

    def replace(self, **changes: Any) -> PadimConfig:
        """A copy with ``changes`` applied (``None`` values are ignored), validated."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _validate(c: PadimConfig) -> None:
    def fail(name: str, value: Any, allowed: str) -> None:
        raise ConfigError(f"{name}: {value!r} is not allowed; {allowed}")

    if c.backbone not in BACKBONES:
        fail("backbone", c.backbone, "choose one of: " + ", ".join(BACKBONES))
    if not isinstance(c.weights, str) or not c.weights:
        fail("weights", c.weights, "use imagenet, random or the path of a state_dict file")
    spec = BACKBONES[c.backbone]
    if not c.layers or any(layer not in spec.layers for layer in c.layers):
        fail("layers", list(c.layers), "choose from: " + ", ".join(spec.layers))
    if list(c.layers) != sorted(c.layers, key=spec.layers.index) or len(set(c.layers)) != len(c.layers):
        fail("layers", list(c.layers), "list each layer once, shallowest first")
    if not isinstance(c.image_size, int) or c.image_size < 32 or c.image_size % 16 or c.image_size > 2048:
        fail("image_size", c.image_size, "use a multiple of 16 between 32 and 2048")
    if c.reduction not in REDUCTIONS:
        fail("reduction", c.reduction, "choose one of: " + ", ".join(REDUCTIONS))
    total = sum(spec.channels[spec.layers.index(layer)] for layer in c.layers)
    if c.features is not None and (not isinstance(c.features, int) or not 1 <= c.features <= total):
        fail("features", c.features, f"use an integer from 1 to {total} (the channels of {', '.join(c.layers)})")
    if c.features is None and spec.default_features > total:
        fail("features", None, f"set it: the default {spec.default_features} exceeds the {total} channels of {', '.join(c.layers)}")
    if not isinstance(c.seed, int):
        fail("seed", c.seed, "use an integer")
    if not c.epsilon >= 0:
        fail("epsilon", c.epsilon, "use a number >= 0 (the paper uses 0.01)")
    if not c.blur_sigma >= 0:
        fail("blur_sigma", c.blur_sigma, "use a number >= 0 (0 turns smoothing off)")
    if not 0.0 <= c.holdout_fraction < 1.0:
        fail("holdout_fraction", c.holdout_fraction, "use a number in [0, 1)")
    if not isinstance(c.min_holdout, int) or c.min_holdout < 1:
        fail("min_holdout", c.min_holdout, "use an integer >= 1")
    if not 0.0 < c.threshold_quantile <= 1.0:
        fail("threshold_quantile", c.threshold_quantile, "use a number in (0, 1]")
    if not isinstance(c.batch_size, int) or c.batch_size < 1:
        fail("batch_size", c.batch_size, "use an integer >= 1")
    if c.device not in DEVICES:
        fail("device", c.device, "choose one of: " + ", ".join(DEVICES))
    if c.precision_dtype not in PRECISION_DTYPES:
        fail("precision_dtype", c.precision_dtype, "choose one of: " + ", ".join(PRECISION_DTYPES))
    if not isinstance(c.workers, int) or c.workers < 0:
        fail("workers", c.workers, "use an integer >= 0")
