"""What the running service holds: its models, their batchers, thread pools, readiness."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import io
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from padim.core.artifact import file_sha256
from padim.core.scoring import resize_map
from padim.models.data.images import bounded_copy, bounded_size, decode_side, image_dimensions, open_image
from padim.models.deploy.runtimes import DeployedDetector, load_scorer
from padim.models.errors import ExportError, ImageError, NonFiniteScoreError, UsageError
from padim.models.heatmaps import mask_image, overlay
from padim.models.scorer import Scorer
from padim.models.verdicts import verdict

from .batching import MicroBatcher
from .errors import ApiError, api_error
from .metrics import Metrics
from .schemas import ModelDescription, ModelInfo
from .settings import ServiceSettings

log = logging.getLogger("padim.service")

#: After decoding an image at least this large, freed memory is handed back to the system at once.
TRIM_AFTER_PIXELS = 4_000_000


class PixelBudget:
    """At most ``capacity`` decoded pixels in flight across the decode threads.

    A thread waits (outside the event loop) until its image fits; an image larger than the
    budget waits until it is alone. Decode memory is then about ``capacity`` x 4 bytes (Pillow
    keeps RGB as 4 bytes a pixel) plus one conversion copy, whatever the number of requests.
    """

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        pixels = min(pixels, self.capacity)
        with self._changed:
            self._changed.wait_for(lambda: self.used + pixels <= self.capacity)
            self.used += pixels
        try:
            yield
        finally:
            with self._changed:
                self.used -= pixels
                self._changed.notify_all()


def _find_malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; absent on musl and macOS
    except (AttributeError, OSError):
        return None


_MALLOC_TRIM = _find_malloc_trim()


def release_memory() -> None:
    """Give freed heap memory back to the system now (glibc ``malloc_trim``; a no-op elsewhere).

    glibc serves large blocks from its heaps once a block of that size has been freed, so the
    memory of decoded large images would otherwise stay with the process after a burst.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass
class Decoded:
    """One request image, decoded: its model input and, when asked for, a bounded copy to draw on."""

    tensor: torch.Tensor  # (3, S, S) model input
    shown: Image.Image | None  # at most heatmap_max_side a side; None unless a heat map was asked for
    shown_size: tuple[int, int]  # (width, height) of heat maps and masks
    large: bool  # decoded from at least TRIM_AFTER_PIXELS: hand freed memory back once done with it


@dataclass
class ServedModel:
    name: str
    path: Path
    sha256: str
    detector: Scorer
    batcher: MicroBatcher
    load_seconds: float

    def info(self) -> ModelInfo:
        """Identity of the model, returned with every score."""
        return ModelInfo(name=self.name, backbone=self.detector.config.backbone,
                         created=self.detector.provenance.created, sha256=self.sha256, weights=self.detector.weights.label)

    def describe(self) -> ModelDescription:
        """The model in full (``GET /models``); no server paths."""
        return ModelDescription(**{**self.detector.describe(), **self.info().model_dump(), "threshold": 0.5,
                                   "load_seconds": round(self.load_seconds, 3)})

    def score_batch(self, batch: torch.Tensor) -> list[tuple[float, torch.Tensor]]:
        """Runs on the inference thread: ``(B, 3, S, S)`` -> ``[(raw_score, map (S, S))]``."""
        out = self.detector.score(batch)
        raw, maps = out.raw_scores.cpu(), out.maps.cpu()
        return [(float(raw[i]), maps[i]) for i in range(batch.shape[0])]


def model_name(path: Path) -> str:
    return path.name.removesuffix(".padim") if path.name.endswith(".padim") else path.stem


class ServiceState:
    """The service's state: models, batchers, pools and readiness of one service process."""

    def __init__(self, settings: ServiceSettings, metrics: Metrics | None = None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.models: dict[str, ServedModel] = {}
        self.default_name: str | None = None
        self.ready = False
        self.draining = False
        self.startup_error: str | None = None
        self.inference = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
        self.decode = ThreadPoolExecutor(max_workers=settings.decode_workers, thread_name_prefix="decode")
        self.pixels = PixelBudget(settings.pixel_budget())

    # ----------------------------------------------------------------- lifecycle
    async def load(self) -> None:
        """Load every model, warm it up with one dummy batch, start its batcher; then ready."""
        files = self.settings.model_files()
        if not files:
            raise UsageError("no model to serve: pass --model FILE or set PADIM_MODEL_DIR")
        names = [model_name(p) for p in files]
        if len(set(names)) != len(names):
            raise UsageError(f"two model files have the same name: {sorted(n for n in names if names.count(n) > 1)[0]}")
        loop = asyncio.get_running_loop()
        for path, name in zip(files, names):
            started = time.perf_counter()
            detector, sha256 = await loop.run_in_executor(self.inference, self._load_one, path)
            seconds = time.perf_counter() - started
            batcher = MicroBatcher(
                score_batch=lambda batch, n=name: self.models[n].score_batch(batch),
                executor=self.inference,
                max_batch_size=self.settings.max_batch_size,
                max_delay=self.settings.max_delay_ms / 1000,
                max_queue=self.settings.max_queue,
                on_batch=lambda size, waits, n=name: self._record_batch(n, size, waits),
                preferred_batch_size=self.settings.batch_preference(detector.device.type),
            )
            self.models[name] = ServedModel(name, path, sha256, detector, batcher, seconds)
            batcher.start()
            self.metrics.model_load.labels(name).set(seconds)
            log.info("model ready", extra={"model": name, "load_seconds": round(seconds, 3), "weights": detector.weights.label})
        self.default_name = self.settings.default_model or names[0]
        if self.default_name not in self.models:
            raise UsageError(f"default model {self.default_name!r} is not among the loaded ones: {', '.join(names)}")
        self.ready = True

    def _load_one(self, path: Path) -> tuple[Scorer, str]:
        try:
            detector = load_scorer(path, self.settings.runtime, self.settings.device)
        except ExportError as error:
            raise ExportError(f"{path}: {error}") from None
        size = detector.config.image_size
        detector.score(torch.zeros(min(2, self.settings.max_batch_size), 3, size, size))  # warm-up
        sha256 = detector.metadata["model"]["sha256"] if isinstance(detector, DeployedDetector) else file_sha256(path)
        return detector, sha256

    async def close(self) -> None:
        self.ready = False
        for model in self.models.values():
            await model.batcher.stop()
        self.inference.shutdown(wait=True)
        self.decode.shutdown(wait=True)

    def _record_batch(self, name: str, size: int, waits: list[float]) -> None:
        self.metrics.batch_size.labels(name).observe(size)
        for wait in waits:
            self.metrics.queue_wait.labels(name).observe(wait)

    # ----------------------------------------------------------------- requests
    def model(self, name: str | None) -> ServedModel:
        if not self.ready:
            raise ApiError(503, "not_ready", "models are still loading; retry shortly", headers={"Retry-After": "2"})
        key = name or self.default_name
        if key not in self.models:
            raise ApiError(404, "model_not_found", f"no model named {key!r}; served: {', '.join(self.models)}")
        return self.models[key]

    def decode_image(self, model: ServedModel, data: bytes, keep_image: bool) -> Decoded:
        """Runs on the decode pool: bytes -> model input (and a bounded copy when ``keep_image``).

        The full-size image lives only inside this call, within the pixel budget.
        """
        limits = {"max_pixels": self.settings.max_image_pixels, "limit_name": "PADIM_MAX_IMAGE_PIXELS"}
        try:
            width, height = image_dimensions(data, **limits)
            with self.pixels.hold(width * height):
                image = open_image(data, draft_to=decode_side(model.detector.config.image_size), **limits)
                tensor = model.detector.preprocess([image])[0]
                shown = bounded_copy(image, self.settings.heatmap_max_side) if keep_image else None
                shown_size = bounded_size(image.size, self.settings.heatmap_max_side)
                del image
        except ImageError as error:  # 413 when too large, 422 otherwise (padim.models.errors.OUTCOMES)
            raise api_error(error) from None
        large = width * height >= TRIM_AFTER_PIXELS
        if large:
            release_memory()
        return Decoded(tensor, shown, shown_size, large)

    def build_result(self, model: ServedModel, decoded: Decoded, raw: float, anomaly_map: torch.Tensor,
                     threshold: float | None, heatmap: bool, mask: bool) -> dict:
        """Runs on the decode pool: the verdict (the same as ``padim predict``'s) and the requested images."""
        calibration = model.detector.calibration
        try:
            result = verdict(raw, anomaly_map, calibration, threshold).to_dict()
        except NonFiniteScoreError as error:  # fail closed: never a verdict from a NaN
            log.error("non-finite score", extra={"model": model.name, "raw_score": str(raw)})
            raise api_error(error, "the model gave a NaN or infinite score for this image, so no verdict is given; "
                            "the model file may be damaged (check it with `padim info --verify`)") from None
        if heatmap or mask:
            width, height = decoded.shown_size
            resized = resize_map(anomaly_map, height, width)
            normalised_map = calibration.normalise(resized.double()).numpy()
            if heatmap:
                result["heatmap"] = _png_base64(overlay(decoded.shown, normalised_map, result["threshold"]))
            if mask:
                result["mask"] = _png_base64(mask_image(normalised_map, result["threshold"]))
            if decoded.large:
                release_memory()
        return result


def _png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
