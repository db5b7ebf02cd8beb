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
from padim.core.statistics import (
    GaussianAccumulator,
    GaussianState,
    all_reduce_state_,
    empty_state,
    finalise,
    merge_states_,
)

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

    @classmethod
    def unfinished(cls, config: PadimConfig, backbone_state: dict[str, torch.Tensor], weights: WeightsInfo,
                   embedding: Embedding, device: torch.device) -> PadimDetector:
        """A detector that can embed but has no statistics yet (set by :func:`finish`)."""
        return cls(config, backbone_state, weights, embedding, torch.empty(0), torch.empty(0), None, None, device)

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
    @property
    def is_partial(self) -> bool:
        """Accumulators only (``train --partial``): not scorable until merged and finished."""
        return self.precision_factor.numel() == 0

    def save(self, path: str | Path, include_state: bool = True, precision_dtype: torch.dtype | None = None) -> None:
        """Write the model file atomically (a partial one when the detector is unfinished).

        Args:
            include_state: keep the accumulators (needed by ``--resume`` and ``merge``).
            precision_dtype: storage dtype of the precision factors; default: the one chosen
                at fit time.
        """
        dtype = precision_dtype or self.storage_dtype
        if self.is_partial and (self.state is None or not include_state):
            raise ValueError("a partial fit is nothing but its accumulators; it cannot be saved without them")
        tensors = {} if self.is_partial else {
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
            "kind": "padim-partial" if self.is_partial else "padim-detector",
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
    def load_scorable(cls, path: str | Path, device: str = "auto", with_state: bool = False) -> PadimDetector:
        """:meth:`load`, refusing partial fits; by default without the training accumulators.

        Scoring does not need the accumulators (``P * D * D`` float64 once unpacked); pass
        ``with_state=True`` when the model will be saved again.
        """
        detector = cls.load(path, device, with_state=with_state)
        if detector.is_partial:
            raise ArtifactError(f"{path}: a partial fit (train --partial); combine the parts with `padim merge` first")
        return detector

    @classmethod
    def load(cls, path: str | Path, device: str = "auto", with_state: bool = True) -> PadimDetector:
        """Read a model file. Raises :class:`ArtifactError` with a one-line message.

        Args:
            with_state: also read the training accumulators (for resume and merge).
        """
        tensors, header = load_artifact(path, skip_prefixes=() if with_state else ("accumulator.",))
        if header.get("kind") not in ("padim-detector", "padim-partial"):
            raise ArtifactError(f"{path}: a padim file, but not a detector (kind={header.get('kind')!r})")
        partial = header["kind"] == "padim-partial"
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
            factor = torch.empty(0) if partial else unpack_lower(tensors["precision_factor"].to(torch.float32), dim)
            calibration = None
            if header.get("calibration") is not None:
                calibration = Calibration.from_header(header["calibration"], tensors["calibration.normal_scores"])
            state = None
            if header.get("has_accumulators") and with_state:
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
        return cls(config, backbone_state, weights, embedding, tensors.get("mean", torch.empty(0)), factor,
                   calibration, state, resolve_device(device), info, storage_dtype)


# ---------------------------------------------------------------------- fitting
def new_detector(config: PadimConfig) -> PadimDetector:
    """An unfitted detector: backbone with its weights, seeded channel reduction, no statistics."""
    backbone, weights = build_backbone(config.backbone, config.weights, config.seed)
    backbone_state = _used_state(backbone, config)
    weights = WeightsInfo(weights.source, weights.detail, weights_sha256(backbone_state))
    embedding = Embedding.create(config.spec, config.layers, config.embedding_dim, config.reduction, config.seed)
    return PadimDetector.unfinished(config, backbone_state, weights, embedding, resolve_device(config.device))


def accumulate(detector: PadimDetector, paths: Sequence[Path], state: GaussianState | None = None,
               progress: bool = True) -> GaussianState:
    """Stream ``paths`` through the backbone into per-pixel statistics (``state`` is extended)."""
    config = detector.config
    grid = detector.grid_shape
    accumulator = GaussianAccumulator(state.to(detector.device) if state is not None else None)
    with tqdm(total=len(paths), desc="fit", unit="img", disable=not progress, leave=False) as bar:
        for _, images in iter_batches(list(paths), config.batch_size, config.workers):
            accumulator.partial_fit(detector.embed(detector.preprocess(images)))
            bar.update(len(images))
    if accumulator.state is None:
        return empty_state(grid[0] * grid[1], detector.embedding.dim, detector.device)
    return accumulator.state


def finish(detector: PadimDetector, state: GaussianState, holdout_paths: Sequence[Path],
           previous_scores: Sequence[float] = (), progress: bool = True) -> PadimDetector:
    """Precision factors from ``state``, then the threshold from the held-out images' scores."""
    config = detector.config
    if int(state.count) < 2:
        raise ValueError(f"need at least 2 fitted images, have {int(state.count)}")
    detector.mean, detector.precision_factor = finalise(state, config.epsilon, detector.grid_shape)
    detector.state = state
    scores, sample = [], None
    with tqdm(total=len(holdout_paths), desc="calibrate", unit="img", disable=not progress, leave=False) as bar:
        for _, images in iter_batches(list(holdout_paths), config.batch_size, config.workers):
            embedded = detector.embed(detector.preprocess(images))
            sample = embedded if sample is None else sample
            scores.append(detector.score_embeddings(embedded).raw_scores.cpu().to(torch.float64))
            bar.update(len(images))
    normal_scores = torch.cat([torch.tensor(list(previous_scores), dtype=torch.float64), *scores])
    if normal_scores.numel() == 0:
        raise ValueError("no held-out images to calibrate on; raise holdout_fraction or min_holdout")
    detector.calibration = Calibration.from_normal_scores(normal_scores, config.threshold_quantile)
    detector.storage_dtype = _choose_precision_dtype(detector, sample, config.precision_dtype)
    return detector


def fit_detector(
    config: PadimConfig,
    paths: Sequence[Path],
    names: Sequence[str],
    resume: PadimDetector | None = None,
    progress: bool = True,
    shard: tuple[int, int] | None = None,
) -> PadimDetector | None:
    """Fit (or continue fitting) a detector on normal images.

    Args:
        config: detector configuration (ignored in favour of ``resume.config`` when resuming,
            except for run-time options: batch size, device, workers).
        paths: image files, every rank's (sorted).
        names: a stable name per image (path relative to the data directory); decides which
            images are held out for calibration.
        resume: a loaded detector with accumulators, to add ``paths`` to.
        progress: show progress bars (stderr).
        shard: ``(rank, world_size)`` inside an initialised ``torch.distributed`` group: this
            rank fits its contiguous share of the fit images, the statistics are all-reduced,
            and rank 0 alone finishes (the others get ``None``).

    Returns:
        The fitted detector (not yet saved), or ``None`` on ranks other than 0.
    """
    if len(paths) != len(names):
        raise ValueError("paths and names must have the same length")
    started = time.perf_counter()
    if resume is not None:
        if resume.state is None:
            raise ValueError("this model file has no accumulators (it was saved with --slim); it cannot be resumed")
        config = resume.config.replace(batch_size=config.batch_size, device=config.device, workers=config.workers)
        detector = PadimDetector.unfinished(config, resume.backbone_state, resume.weights, resume.embedding.cpu(),
                                            resolve_device(config.device))
        state, minimum = resume.state, 0
        previous_scores = resume.calibration.normal_scores if resume.calibration else ()
    else:
        detector, state, minimum, previous_scores = new_detector(config), None, config.min_holdout, ()
    fit_idx, holdout_idx = split_holdout(list(names), config.holdout_fraction, minimum)
    if resume is None and len(fit_idx) < 2:
        raise ValueError(f"need at least 2 images to fit on besides the held-out ones, got {len(paths)} images in all")
    rank, world = shard or (0, 1)
    mine = shard_of(fit_idx, shard)
    log.info("fitting %s (%s) on %d images (this rank: %d), holding out %d", config.backbone,
             detector.weights.label, len(fit_idx), len(mine), len(holdout_idx))
    state = accumulate_shard(detector, [paths[i] for i in mine], state if rank == 0 else None, progress, shard)
    if rank != 0:
        return None
    finish(detector, state, [paths[i] for i in holdout_idx], previous_scores, progress)
    previous_total = int(resume.info.get("training_image_count") or 0) if resume is not None else 0
    previous_holdout = int(resume.info.get("holdout_image_count") or 0) if resume is not None else 0
    detector.info = {
        "created": _now(),
        "padim_version": __version__,
        "training_image_count": previous_total + len(paths),
        "fit_image_count": int(state.count),
        "holdout_image_count": previous_holdout + len(holdout_idx),
        "fit_seconds": round(time.perf_counter() - started, 3),
        "resumed": resume is not None,
        "world_size": world,
    }
    return detector


def shard_of(items: Sequence, shard: tuple[int, int] | None) -> list:
    """This rank's contiguous share of ``items`` (all of them without a shard)."""
    rank, world = shard or (0, 1)
    return list(items[rank * len(items) // world : (rank + 1) * len(items) // world])


def accumulate_shard(detector: PadimDetector, paths: Sequence[Path], state: GaussianState | None,
                     progress: bool, shard: tuple[int, int] | None) -> GaussianState:
    """:func:`accumulate`, then (with a shard) every rank's statistics merged on every rank.

    A failure on any rank stops every rank: they agree on it before the collective, so none
    waits forever for a peer that has gone.
    """
    if shard is None:
        return accumulate(detector, paths, state, progress)
    import torch.distributed as dist

    error: Exception | None = None
    try:
        state = accumulate(detector, paths, state, progress)
    except Exception as caught:  # reported below, after every rank knows
        error = caught
    failed = torch.tensor([1.0 if error else 0.0], dtype=torch.float64, device=detector.device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if float(failed) > 0:
        raise RuntimeError(f"{int(failed)} other rank(s) failed; see their messages")
    return all_reduce_state_(state)


PARTIAL_CHECKS = ("backbone", "layers", "image_size", "reduction")


def merge_partials(parts: Sequence[PadimDetector], sources: Sequence[str],
                   config: PadimConfig | None = None) -> tuple[PadimDetector, GaussianState]:
    """An unfinished detector and the merged statistics of several partial fits.

    ``config`` (default: the first part's) sets the run-time options of the result, its
    device included; the checks below keep everything that shapes the statistics equal.

    Raises:
        ValueError: parts of different backbones, weights, layers, image sizes or channel
            selections (naming the first two that differ).
    """
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]
    for part, source in zip(parts, sources):
        if part.state is None:
            raise ValueError(f"{source}: has no accumulators (saved with --slim); it cannot be merged")
        for key in PARTIAL_CHECKS:
            if getattr(part.config, key) != getattr(first.config, key):
                raise ValueError(f"{source}: {key}={getattr(part.config, key)!r} but {sources[0]} has "
                                 f"{getattr(first.config, key)!r}; parts must come from the same configuration")
        if part.weights.sha256 != first.weights.sha256:
            raise ValueError(f"{source}: other backbone weights than {sources[0]} (sha256 {part.weights.sha256[:12]} vs "
                             f"{first.weights.sha256[:12]})")
        same = (torch.equal(part.embedding.channel_index, first.embedding.channel_index)
                if first.embedding.channel_index is not None and part.embedding.channel_index is not None
                else part.embedding.projection is not None and first.embedding.projection is not None
                and torch.equal(part.embedding.projection, first.embedding.projection))
        if not same:
            raise ValueError(f"{source}: another channel selection than {sources[0]} (different --seed or --features)")
    config = config or first.config
    device = resolve_device(config.device)
    state = first.state.clone().to(device)
    for part in parts[1:]:
        merge_states_(state, part.state.to(device))
    detector = PadimDetector.unfinished(config, first.backbone_state, first.weights, first.embedding.cpu(), device)
    return detector, state


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
