"""The PaDiM detector: backbone features -> embedding -> per-pixel Gaussian -> anomaly map.

``fit_detector`` streams training images into a :class:`GaussianAccumulator`, derives the
precision factors, calibrates a threshold on held-out images and returns a
:class:`PadimDetector`; ``PadimDetector.save`` / ``load`` go through the model file of
:mod:`padim.core.artifact`, which also carries the backbone weights it used (the file is
self-contained: serving it needs no weights download).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torchvision
from tqdm.auto import tqdm

from padim import __version__
from padim.core.artifact import ArtifactError, load_artifact, pack_lower, save_artifact, unpack_lower
from padim.core.calibration import Calibration, split_holdout
from padim.core.scoring import anomaly_maps, image_scores, squared_mahalanobis
from padim.core.statistics import GaussianAccumulator, GaussianState, finalise

from .backbones import BACKBONES, IMAGENET_MEAN, IMAGENET_STD, WeightsInfo, build_backbone, weights_sha256
from .config import PadimConfig
from .features import Embedding, FeatureExtractor
from .images import iter_batches, to_model_input

log = logging.getLogger(__name__)

#: Largest relative change of image scores allowed when storing precision factors as float16.
FLOAT16_TOLERANCE = 1e-3


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


class PadimDetector:
    """A fitted detector, ready to score batches of model-input tensors.

    Attributes:
        config: what it was fitted with.
        weights: origin of the backbone weights.
        grid_shape: ``(H, W)`` of the feature grid (``P = H * W``).
        mean: ``(P, D)`` float32 per-pixel mean.
        precision_factor: ``(P, D, D)`` float32 lower-triangular ``W`` (precision ``W^T W``).
        calibration: normal-score distribution and threshold.
        state: the training accumulators (``None`` for a slim model file).
    """

    def __init__(
        self,
        config: PadimConfig,
        backbone_state: dict[str, torch.Tensor],
        weights: WeightsInfo,
        embedding: Embedding,
        mean: torch.Tensor,
        precision_factor: torch.Tensor,
        calibration: Calibration | None,
        state: GaussianState | None,
        device: torch.device,
        info: dict | None = None,
        storage_dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.weights = weights
        self.backbone_state = backbone_state
        self.device = device
        self.extractor = _extractor(config, backbone_state).to(device)
        self.embedding = embedding.to(device)
        self.grid_shape = _grid_shape(config)
        self.mean = mean.to(device, torch.float32)
        self.precision_factor = precision_factor.to(device, torch.float32)
        self.calibration = calibration
        self.state = state
        self.info = dict(info or {})
        self.storage_dtype = storage_dtype

    # ------------------------------------------------------------------ scoring
    @property
    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        return IMAGENET_MEAN, IMAGENET_STD

    def preprocess(self, images) -> torch.Tensor:
        """PIL images -> ``(B, 3, S, S)`` normalised model input."""
        return to_model_input(images, self.config.image_size, *self.normalisation)

    @torch.inference_mode()
    def embed(self, batch: torch.Tensor) -> torch.Tensor:
        """``(B, 3, S, S)`` model input -> ``(B, P, D)`` embeddings."""
        features = self.extractor(batch.to(self.device, non_blocking=True))
        embedding = self.embedding(features)  # (B, D, H, W)
        return embedding.permute(0, 2, 3, 1).reshape(batch.shape[0], -1, self.embedding.dim)

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

    def normalise(self, raw: torch.Tensor) -> torch.Tensor:
        return self._calibrated().normalise(raw)

    def _calibrated(self) -> Calibration:
        if self.calibration is None:
            raise ValueError("this model has no calibration (it was fitted without held-out images)")
        return self.calibration

    # ------------------------------------------------------------------ metadata
    def describe(self) -> dict:
        """Metadata a user sees (``padim info``, ``GET /models``, results files)."""
        cal = self.calibration
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
            "threshold_raw": None if cal is None else cal.threshold,
            "threshold_quantile": None if cal is None else cal.quantile,
            "training_image_count": self.info.get("training_image_count"),
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
        tensors = {
            "mean": self.mean,
            "precision_factor": pack_lower(self.precision_factor).to(dtype),
        }
        if self.embedding.channel_index is not None:
            tensors["embedding.channel_index"] = self.embedding.channel_index
        else:
            tensors["embedding.projection"] = self.embedding.projection
        if self.calibration is not None:
            tensors["calibration.normal_scores"] = torch.tensor(self.calibration.normal_scores, dtype=torch.float64)
        if include_state and self.state is not None:
            tensors["accumulator.count"] = self.state.count
            tensors["accumulator.mean"] = self.state.mean
            tensors["accumulator.comoment"] = pack_lower(self.state.comoment)
        for key, value in self.backbone_state.items():
            tensors[f"backbone.{key}"] = value
        header = {
            "kind": "padim-detector",
            "padim_version": __version__,
            "torch_version": torch.__version__,
            "torchvision_version": torchvision.__version__,
            "created": self.info.get("created") or _now(),
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.config.to_dict().items()},
            "weights": self.weights.to_header(),
            "normalisation": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
            "grid": list(self.grid_shape),
            "embedding_dim": self.embedding.dim,
            "precision_dtype": str(dtype).removeprefix("torch."),
            "calibration": None if self.calibration is None else self.calibration.to_header(),
            "has_accumulators": bool(include_state and self.state is not None),
            **{k: v for k, v in self.info.items() if k not in ("created", "padim_version")},
        }
        save_artifact(path, tensors, header)

    @classmethod
    def load(cls, path: str | Path, device: str = "auto") -> PadimDetector:
        """Read a model file. Raises :class:`ArtifactError` with a one-line message."""
        tensors, header = load_artifact(path)
        if header.get("kind") != "padim-detector":
            raise ArtifactError(f"{path}: a padim file, but not a detector (kind={header.get('kind')!r})")
        try:
            config = PadimConfig.from_mapping(header["config"], source=str(path))
            dim = int(header["embedding_dim"])
            embedding_kwargs = dict(
                channels=config.spec.channels_of(config.layers),
                strides=tuple(config.spec.stride_of(layer) for layer in config.layers),
            )
            if "embedding.channel_index" in tensors:
                embedding = Embedding(**embedding_kwargs, channel_index=tensors["embedding.channel_index"])
            else:
                embedding = Embedding(**embedding_kwargs, projection=tensors["embedding.projection"])
            factor = unpack_lower(tensors["precision_factor"].to(torch.float32), dim)
            calibration = None
            if header.get("calibration") is not None:
                calibration = Calibration.from_header(header["calibration"], tensors["calibration.normal_scores"])
            state = None
            if header.get("has_accumulators"):
                state = GaussianState(
                    tensors["accumulator.count"],
                    tensors["accumulator.mean"],
                    unpack_lower(tensors["accumulator.comoment"], dim, symmetric=True),
                )
            backbone_state = {k.removeprefix("backbone."): v for k, v in tensors.items() if k.startswith("backbone.")}
            weights = WeightsInfo(**header["weights"])
        except (KeyError, TypeError, ValueError) as error:
            raise ArtifactError(f"{path}: incomplete or inconsistent model file ({type(error).__name__}: {error})") from None
        info = {k: header[k] for k in ("created", "padim_version", "training_image_count",
                                        "fit_image_count", "holdout_image_count") if k in header}
        storage_dtype = getattr(torch, header.get("precision_dtype", "float32"))
        return cls(config, backbone_state, weights, embedding, tensors["mean"], factor,
                   calibration, state, resolve_device(device), info, storage_dtype)


# ---------------------------------------------------------------------- fitting
def fit_detector(
    config: PadimConfig,
    paths: Sequence[Path],
    names: Sequence[str],
    resume: PadimDetector | None = None,
    progress: bool = True,
) -> PadimDetector:
    """Fit (or continue fitting) a detector on normal images.

    Args:
        config: detector configuration (ignored in favour of ``resume.config`` when resuming,
            except for run-time options: batch size, device, workers).
        paths: image files.
        names: a stable name per image (path relative to the data directory); decides which
            images are held out for calibration.
        resume: a loaded detector with accumulators, to add ``paths`` to.
        progress: show progress bars (stderr).

    Returns:
        The fitted detector (not yet saved).
    """
    if len(paths) != len(names):
        raise ValueError("paths and names must have the same length")
    started = time.perf_counter()
    device = resolve_device(config.device)
    if resume is not None:
        if resume.state is None:
            raise ValueError("this model file has no accumulators (it was saved with --slim); it cannot be resumed")
        config = resume.config.replace(batch_size=config.batch_size, device=config.device, workers=config.workers)
        backbone_state, weights, embedding = resume.backbone_state, resume.weights, resume.embedding.cpu()
        minimum = 0
    else:
        backbone, weights = build_backbone(config.backbone, config.weights, config.seed)
        backbone_state = _used_state(backbone, config)
        weights = WeightsInfo(weights.source, weights.detail, weights_sha256(backbone_state))
        embedding = Embedding.create(config.spec, config.layers, config.embedding_dim, config.reduction, config.seed)
        minimum = config.min_holdout
    fit_idx, holdout_idx = split_holdout(list(names), config.holdout_fraction, minimum)
    if resume is None and len(fit_idx) < 2:
        raise ValueError(f"need at least 2 images to fit on besides the held-out ones, got {len(paths)} images in all")
    grid = _grid_shape(config)
    log.info("fitting %s (%s) on %d images, holding out %d", config.backbone, weights.label, len(fit_idx), len(holdout_idx))

    # mean and precision factor are set by finalise(); until then the detector only embeds
    detector = PadimDetector(config, backbone_state, weights, embedding, torch.empty(0), torch.empty(0),
                             None, None, device)
    accumulator = GaussianAccumulator(resume.state.to(device) if resume is not None else None)
    fit_paths = [paths[i] for i in fit_idx]
    with tqdm(total=len(fit_paths), desc="fit", unit="img", disable=not progress, leave=False) as bar:
        for _, images in iter_batches(fit_paths, config.batch_size, config.workers):
            accumulator.partial_fit(detector.embed(detector.preprocess(images)))
            bar.update(len(images))
    if accumulator.count < 2:
        raise ValueError(f"need at least 2 fitted images, have {accumulator.count}")

    state = accumulator.state
    detector.mean, detector.precision_factor = finalise(state, config.epsilon, grid)
    detector.state = state

    holdout_paths = [paths[i] for i in holdout_idx]
    scores, sample = [], None
    with tqdm(total=len(holdout_paths), desc="calibrate", unit="img", disable=not progress, leave=False) as bar:
        for _, images in iter_batches(holdout_paths, config.batch_size, config.workers):
            embedded = detector.embed(detector.preprocess(images))
            sample = embedded if sample is None else sample
            scores.append(detector.score_embeddings(embedded).raw_scores.cpu())
            bar.update(len(images))
    new_scores = torch.cat(scores) if scores else torch.zeros(0)
    previous = torch.tensor(resume.calibration.normal_scores) if resume is not None and resume.calibration else torch.zeros(0)
    normal_scores = torch.cat([previous.to(torch.float64), new_scores.to(torch.float64)])
    if normal_scores.numel() == 0:
        raise ValueError("no held-out images to calibrate on; raise holdout_fraction or min_holdout")
    detector.calibration = Calibration.from_normal_scores(normal_scores, config.threshold_quantile)
    detector.storage_dtype = _choose_precision_dtype(detector, sample, config.precision_dtype)

    previous_total = int(resume.info.get("training_image_count") or 0) if resume is not None else 0
    previous_holdout = int(resume.info.get("holdout_image_count") or 0) if resume is not None else 0
    detector.info = {
        "created": _now(),
        "padim_version": __version__,
        "training_image_count": previous_total + len(paths),
        "fit_image_count": accumulator.count,
        "holdout_image_count": previous_holdout + len(holdout_idx),
        "fit_seconds": round(time.perf_counter() - started, 3),
        "resumed": resume is not None,
    }
    return detector


def _choose_precision_dtype(detector: PadimDetector, sample: torch.Tensor | None, choice: str) -> torch.dtype:
    """float16 storage when it keeps image scores within ``FLOAT16_TOLERANCE`` of float32.

    Checked on a batch of held-out embeddings ``(B, P, D)``, rounding the factors a slice of
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
    log.info("float16 precision factors change held-out scores by at most %.2e (relative)", worst)
    return torch.float16 if worst <= FLOAT16_TOLERANCE else torch.float32


def _extractor(config: PadimConfig, backbone_state: dict[str, torch.Tensor]) -> FeatureExtractor:
    with torch.device("meta"):
        backbone = getattr(torchvision.models, config.backbone)(weights=None)
    missing = [k for k in _used_keys(backbone, config) if k not in backbone_state]
    if missing:
        raise ArtifactError(f"backbone weights incomplete: missing {missing[:3]}")
    backbone.load_state_dict(backbone_state, strict=False, assign=True)
    return FeatureExtractor(backbone, config.layers)


def _used_keys(backbone: torch.nn.Module, config: PadimConfig) -> list[str]:
    deepest = config.layers[-1]
    stages = list(BACKBONES[config.backbone].layers)
    unused = tuple(f"{s}." for s in stages[stages.index(deepest) + 1 :]) + ("fc.",)
    return [k for k in backbone.state_dict() if not k.startswith(unused)]


def _used_state(backbone: torch.nn.Module, config: PadimConfig) -> dict[str, torch.Tensor]:
    state = backbone.state_dict()
    return {k: state[k].detach().clone().contiguous() for k in _used_keys(backbone, config)}


def _grid_shape(config: PadimConfig) -> tuple[int, int]:
    side = config.image_size // config.spec.stride_of(config.layers[0])
    return side, side


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
