"""The fitted PaDiM detector: backbone features -> embedding -> per-pixel Gaussian -> anomaly map.

:class:`PadimDetector` scores batches; ``save`` / ``load`` go through the model file of
:mod:`padim.core.artifact`, which also carries the backbone weights it used (the file is
self-contained: serving it needs no weights download). Fitting lives in
:mod:`padim.models.fitting`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torchvision

from padim import __version__
from padim.core.artifact import ArtifactError, load_artifact, pack_lower, save_artifact, unpack_lower
from padim.core.calibration import Calibration
from padim.core.scoring import anomaly_maps, image_scores, squared_mahalanobis
from padim.core.statistics import GaussianState

from .backbones import WeightsInfo
from .config import RETIRED, PadimConfig
from .features import Embedding, FeatureEmbedder

log = logging.getLogger(__name__)

#: Largest relative change of image scores allowed when storing precision factors as float16.
FLOAT16_TOLERANCE = 1e-3


class NonFiniteScoreError(RuntimeError):
    """A score or map that is NaN or infinite: no verdict may be given from it."""


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "--device cuda was asked for, but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            "check the NVIDIA driver (nvidia-smi) and, in Docker, --gpus all; or use --device cpu"
        )
    return torch.device(device)


@dataclass
class ScoreOutput:
    """Scores of a batch.

    Attributes:
        raw_scores: ``(B,)`` maximum of each anomaly map (Mahalanobis distance units).
        maps: ``(B, S, S)`` anomaly maps at the model's input size.
    """

    raw_scores: torch.Tensor
    maps: torch.Tensor

    def non_finite(self) -> list[int]:
        """Indices of the images whose score or map holds a NaN or an infinity."""
        finite = torch.isfinite(self.maps).flatten(1).all(dim=1) & torch.isfinite(self.raw_scores)
        return torch.nonzero(~finite).flatten().tolist()


class PadimDetector:
    """A fitted detector, ready to score batches of model-input tensors.

    Attributes:
        config: what it was fitted with.
        weights: origin of the backbone weights.
        embedder: images -> ``(B, P, D)`` embeddings.
        grid_shape: ``(H, W)`` of the feature grid (``P = H * W``).
        mean: ``(P, D)`` float32 per-pixel mean.
        precision_factor: ``(P, D, D)`` float32 lower-triangular ``W`` (precision ``W^T W``).
        calibration: normal scores, threshold and what it promises.
        info: provenance (image counts, fits, creation time).
        state: the training accumulators, kept for ``--resume`` (``None`` when not loaded).
        image_digests: content digests of the fitted images (resume leaves them out).
        storage_dtype: dtype of the precision factors in the file.
    """

    def __init__(
        self,
        config: PadimConfig,
        backbone_state: dict[str, torch.Tensor],
        weights: WeightsInfo,
        embedding: Embedding,
        mean: torch.Tensor,
        precision_factor: torch.Tensor,
        calibration: Calibration,
        device: torch.device,
        info: dict | None = None,
        state: GaussianState | None = None,
        image_digests: torch.Tensor | None = None,
        storage_dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.weights = weights
        self.backbone_state = backbone_state
        self.device = device
        self.embedder = FeatureEmbedder(config, backbone_state, embedding).to(device)
        self.grid_shape = self.embedder.grid_shape
        self.mean = mean.to(device, torch.float32)
        self.precision_factor = precision_factor.to(device, torch.float32)
        self.calibration = calibration
        self.info = dict(info or {})
        self.state = state
        self.image_digests = torch.zeros(0, dtype=torch.int64) if image_digests is None else image_digests
        self.storage_dtype = storage_dtype

    @property
    def embedding(self) -> Embedding:
        return self.embedder.embedding

    # ------------------------------------------------------------------ scoring
    def preprocess(self, images) -> torch.Tensor:
        """PIL images -> ``(B, 3, S, S)`` normalised model input."""
        return self.embedder.preprocess(images)

    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        """``(B, 3, S, S)`` model input -> ``(B, P, D)`` embeddings."""
        return self.embedder(batch)

    @torch.inference_mode()
    def score_embeddings(self, embedding: torch.Tensor) -> ScoreOutput:
        """``(B, P, D)`` -> raw image scores and anomaly maps."""
        squared = squared_mahalanobis(embedding, self.mean, self.precision_factor)  # (B, P)
        maps = anomaly_maps(squared, self.grid_shape, self.config.image_size, self.config.blur_sigma)
        return ScoreOutput(image_scores(maps), maps)

    @torch.inference_mode()
    def score(self, batch: torch.Tensor) -> ScoreOutput:
        """``(B, 3, S, S)`` model input -> raw image scores ``(B,)`` and maps ``(B, S, S)``."""
        return self.score_embeddings(self.embed(batch))

    # ------------------------------------------------------------------ metadata
    def describe(self) -> dict:
        """Metadata a user sees (``padim info``, ``GET /models``, results files)."""
        return {
            "backbone": self.config.backbone,
            "weights": self.weights.label,
            "weights_source": self.weights.source,
            "layers": list(self.config.layers),
            "image_size": self.config.image_size,
            "embedding_dim": self.embedding.dim,
            "reduction": self.config.reduction,
            "grid": list(self.grid_shape),
            "epsilon": self.config.epsilon,
            "fit_image_count": self.info.get("fit_image_count"),
            "calibration": {**self.calibration.summary(), "source": self.info.get("calibration_source"),
                            "folds": self.config.calibration_folds},
            "verified": self.info.get("verified", True),
            "created": self.info.get("created"),
            "padim_version": self.info.get("padim_version", __version__),
        }

    # ------------------------------------------------------------------ file
    def save(self, path: str | Path, include_state: bool = True, precision_dtype: torch.dtype | None = None) -> None:
        """Write the model file atomically.

        Args:
            include_state: keep the accumulators (needed by ``--resume`` and ``merge``).
            precision_dtype: storage dtype of the precision factors; default: the one chosen
                at fit time.
        """
        dtype = precision_dtype or self.storage_dtype
        include_state = include_state and self.state is not None
        tensors = {
            "mean": self.mean,
            "precision_factor": pack_lower(self.precision_factor).to(dtype),
            "calibration.scores": torch.tensor(self.calibration.scores, dtype=torch.float64),
            "image_digests": self.image_digests,
            **embedding_tensors(self.embedding),
            **{f"backbone.{key}": value for key, value in self.backbone_state.items()},
        }
        if include_state:
            tensors["accumulator.count"] = self.state.count
            tensors["accumulator.mean"] = self.state.mean
            tensors["accumulator.comoment"] = pack_lower(self.state.comoment)
        header = {
            "kind": "padim-detector",
            **common_header(self.config, self.weights, self.embedding),
            "created": self.info.get("created") or _now(),
            "grid": list(self.grid_shape),
            "precision_dtype": str(dtype).removeprefix("torch."),
            "calibration": self.calibration.to_header(),
            "has_accumulators": include_state,
            **{k: v for k, v in self.info.items() if k not in ("created", "padim_version", "verified")},
        }
        save_artifact(path, tensors, header)

    @classmethod
    def load(cls, path: str | Path, device: str = "auto", with_state: bool = False) -> PadimDetector:
        """Read a model file, verified (digests) and checked (finite statistics).

        Args:
            with_state: also read the training accumulators (to save the model again with them).

        Raises:
            ArtifactError: missing, damaged, partial, foreign or newer-format file (one line).
        """
        tensors, header = load_artifact(path, skip_prefixes=() if with_state else ("accumulator.",))
        kind = header.get("kind")
        if kind == "padim-partial":
            raise ArtifactError(f"{path}: a partial fit (train --partial); combine the parts with `padim merge` first")
        if kind != "padim-detector":
            raise ArtifactError(f"{path}: a padim file, but not a detector (kind={kind!r})")
        config, embedding, backbone_state, weights = read_common(path, tensors, header)
        for name in ("mean", "precision_factor"):  # checked as stored: packed, and float16 where so saved
            if name in tensors and not bool(torch.isfinite(tensors[name]).all()):
                raise ArtifactError(f"{path}: tensor {name!r} holds NaN or infinite values; this model cannot score")
        try:
            factor = unpack_lower(tensors["precision_factor"].to(torch.float32), embedding.dim)
            calibration = read_calibration(header, tensors)
            state = None
            if header.get("has_accumulators") and with_state:
                state = GaussianState(tensors["accumulator.count"], tensors["accumulator.mean"],
                                      unpack_lower(tensors["accumulator.comoment"], embedding.dim, symmetric=True))
            mean = tensors["mean"]
        except (KeyError, TypeError, ValueError) as error:
            raise ArtifactError(f"{path}: incomplete or inconsistent model file ({type(error).__name__}: {error})") from None
        if not math.isfinite(calibration.threshold) or not math.isfinite(calibration.scale):
            raise ArtifactError(f"{path}: the calibration threshold is not finite; this model cannot score")
        info = {k: header[k] for k in ("created", "padim_version", "fit_image_count", "calibration_source",
                                        "unreadable_image_count", "fits", "merged_from", "fit_seconds",
                                        "verified") if k in header}
        if not header["verified"]:
            log.warning("%s: model format %s has no digests, so its integrity is not verified, and its threshold "
                        "comes from a few held-out images; train it again for an honest threshold",
                        path, header["format_version"])
            info.setdefault("fit_image_count", header.get("fit_image_count"))
            info["calibration_source"] = "held_out"
        storage_dtype = getattr(torch, header.get("precision_dtype", "float32"))
        return cls(config, backbone_state, weights, embedding, mean, factor, calibration, resolve_device(device), info,
                   state, tensors.get("image_digests"), storage_dtype)


# ---------------------------------------------------------------------- the file, shared with fitting
def read_common(path, tensors: dict[str, torch.Tensor], header: dict) -> tuple[PadimConfig, Embedding, dict, WeightsInfo]:
    """Configuration, embedding, backbone weights and their origin: what every model file holds."""
    try:
        values = dict(header["config"])
        if not header.get("verified", True):  # format 1: a held-out share instead of folds
            for key in RETIRED:
                values.pop(key, None)
        config = PadimConfig.from_mapping(values, source=str(path))
        kwargs = dict(channels=config.spec.channels_of(config.layers),
                      strides=tuple(config.spec.stride_of(layer) for layer in config.layers))
        if "embedding.channel_index" in tensors:
            embedding = Embedding(**kwargs, channel_index=tensors["embedding.channel_index"])
        else:
            embedding = Embedding(**kwargs, projection=tensors["embedding.projection"])
        if embedding.dim != int(header["embedding_dim"]):
            raise ValueError(f"embedding_dim {header['embedding_dim']} but {embedding.dim} channels stored")
        backbone_state = {k.removeprefix("backbone."): v for k, v in tensors.items() if k.startswith("backbone.")}
        weights = WeightsInfo(**header["weights"])
    except (KeyError, TypeError, ValueError) as error:
        raise ArtifactError(f"{path}: incomplete or inconsistent model file ({type(error).__name__}: {error})") from None
    return config, embedding, backbone_state, weights


def read_calibration(header: dict, tensors: dict[str, torch.Tensor]) -> Calibration:
    """The calibration of a model file; format 1 files keep their threshold and scale."""
    if header.get("verified", True):
        return Calibration.from_header(header["calibration"], tensors["calibration.scores"])
    old = header["calibration"]
    scores = tensors["calibration.normal_scores"].to(torch.float64).sort().values
    return Calibration(tuple(scores.tolist()), float(old["threshold"]), float(old["scale"]),
                       "manual" if old.get("quantile") is None else "quantile", None)


def embedding_tensors(embedding: Embedding) -> dict[str, torch.Tensor]:
    """The channel subset or the projection, as saved."""
    if embedding.channel_index is not None:
        return {"embedding.channel_index": embedding.channel_index}
    return {"embedding.projection": embedding.projection}


def common_header(config: PadimConfig, weights: WeightsInfo, embedding: Embedding) -> dict:
    """Header fields every model file has (detector or partial)."""
    return {
        "padim_version": __version__,
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.to_dict().items()},
        "weights": weights.to_header(),
        "embedding_dim": embedding.dim,
    }


def choose_precision_dtype(detector: PadimDetector, sample: torch.Tensor | None, choice: str) -> torch.dtype:
    """float16 storage when it keeps image scores within ``FLOAT16_TOLERANCE`` of float32.

    Checked on a batch of out-of-fold embeddings ``(B, P, D)``, rounding the factors a slice of
    pixels at a time so that no second full-size copy is made.
    """
    if choice != "auto":
        return getattr(torch, choice)
    if sample is None:
        return torch.float32
    mean, factor = detector.mean, detector.precision_factor
    exact = squared_mahalanobis(sample, mean, factor)  # (B, P)
    rounded = torch.cat([
        squared_mahalanobis(sample[:, i : i + 256], mean[i : i + 256], factor[i : i + 256].half().float())
        for i in range(0, factor.shape[0], 256)
    ], dim=1)
    config = detector.config
    scores = [image_scores(anomaly_maps(sq, detector.grid_shape, config.image_size, config.blur_sigma)) for sq in (exact, rounded)]
    worst = float(((scores[1] - scores[0]).abs() / scores[0].abs().clamp_min(1e-12)).max())
    log.info("float16 precision factors change out-of-fold scores by at most %.2e (relative)", worst)
    return torch.float16 if worst <= FLOAT16_TOLERANCE else torch.float32


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
