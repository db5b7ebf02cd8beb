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
from padim.models.data.framing import PICTURE_SIZE
from padim.models.data.images import bounded_copy, bounded_size, decode_side, image_dimensions, open_image
from padim.models.deploy.runtimes import DeployedDetector, load_scorer
from padim.models.devices import is_cuda_error, probe
from padim.models.errors import ExportError, ImageError, NonFiniteScoreError, UsageError
from padim.models.heatmaps import mask_image, overlay
from padim.models.scorer import Scorer
from padim.models.verdicts import verdict

from .batching import MicroBatcher
from .errors import ApiError, api_error
from .metrics import Metrics
from .monitor import Monitor
from .schemas import ModelDescription, ModelInfo
from .settings import ServiceSettings

log = logging.getLogger("padim.service")

#: Seconds /health/ready waits for its CUDA probe before it says not ready (a hung GPU).
PROBE_TIMEOUT_S = 5.0

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
    picture: tuple[int, int] = (0, 0)  # (width, height) of the picture as sent (EXIF orientation applied)


@dataclass
class ServedModel:
    name: str
    path: Path
    sha256: str
    detector: Scorer
    batcher: MicroBatcher
    load_seconds: float
    monitor: Monitor

    def info(self) -> ModelInfo:
        """Identity of the model, returned with every score."""
        return ModelInfo(name=self.name, backbone=self.detector.config.backbone,
                         created=self.detector.provenance.created, sha256=self.sha256,
                         weights=self.detector.weights.public_label)  # no server paths for clients

    def describe(self) -> ModelDescription:
        """The model in full (``GET /models``); no server paths."""
        return ModelDescription(**{**self.detector.describe(), **self.info().model_dump(), "threshold": 0.5,
                                   "load_seconds": round(self.load_seconds, 3)})

    def score_batch(self, batch: torch.Tensor, on_split=None) -> list[tuple[float, torch.Tensor, float | None]]:
        """Runs on the inference thread: ``(B, 3, S, S)`` -> ``[(raw_score, map (S, S), input_distance)]``.

        Out of GPU memory, the cache is emptied and the batch scored again in two halves
        (``on_split`` is told); a half that still does not fit raises ``torch.OutOfMemoryError``.
        """
        try:
            return self._score(batch)
        except torch.OutOfMemoryError:
            release_device_memory()
            if batch.shape[0] == 1:
                raise
            log.warning("out of GPU memory at batch %d; scoring it in two halves", batch.shape[0],
                        extra={"model": self.name})
            if on_split is not None:
                on_split()
            half = (batch.shape[0] + 1) // 2
            try:
                return self._score(batch[:half]) + self._score(batch[half:])
            except torch.OutOfMemoryError:
                release_device_memory()
                raise

    def _score(self, batch: torch.Tensor) -> list[tuple[float, torch.Tensor, float | None]]:
        out = self.detector.score(batch)
        raw, maps = out.raw_scores.cpu(), out.maps.cpu()
        inputs = out.input_distances.cpu().tolist() if out.input_distances is not None else [None] * batch.shape[0]
        return [(float(raw[i]), maps[i], inputs[i]) for i in range(batch.shape[0])]


def release_device_memory() -> None:
    """Hand the blocks torch's CUDA allocator caches back to the GPU (nothing without CUDA)."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


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
        self.failure: str | None = None  # why a ready service became unready (its GPU failed)
        self.device_errors = 0  # scoring batches failed in a row on the GPU
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
            largest, preferred = self.settings.picture_batches(detector.device.type, detector.config.tile_count)
            batcher = MicroBatcher(
                score_batch=lambda batch, n=name: self.score(n, batch),
                executor=self.inference,
                max_batch_size=largest,
                max_delay=self.settings.max_delay_ms / 1000,
                max_queue=self.settings.max_queue,
                on_batch=lambda size, waits, n=name: self._record_batch(n, size, waits),
                preferred_batch_size=preferred,
            )
            monitor = Monitor(detector.calibration, self.settings.monitor_window, self.settings.monitor_level,
                              self.settings.monitor_min_images)
            self.models[name] = ServedModel(name, path, sha256, detector, batcher, seconds, monitor)
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
        if detector.device.type == "cuda" and self.settings.cuda_memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(self.settings.cuda_memory_fraction, detector.device)
        tiles = detector.config.tile_count
        _, largest = self.settings.picture_batches(detector.device.type, tiles)  # the largest batch the batcher forms
        try:
            detector.score(torch.zeros(largest, 3, *detector.config.input_shape))  # warm-up (and cudnn's tuning) at that size
        except torch.OutOfMemoryError:
            release_device_memory()
            raise UsageError(f"{path}: a batch of {largest} images ({largest * tiles} tiles) does not fit in the GPU's memory; lower "
                             "PADIM_MAX_BATCH_SIZE (or PADIM_PREFERRED_BATCH_SIZE), or serve fewer models per GPU") from None
        log.info("warmed up", extra={"model": model_name(path), "batch": largest, "device": str(detector.device),
                                     "runtime": detector.runtime})
        sha256 = detector.metadata["model"]["sha256"] if isinstance(detector, DeployedDetector) else file_sha256(path)
        return detector, sha256

    async def close(self) -> None:
        self.ready = False
        for model in self.models.values():
            await model.batcher.stop()
        self.inference.shutdown(wait=True)
        self.decode.shutdown(wait=True)

    def score(self, name: str, batch: torch.Tensor) -> list[tuple[float, torch.Tensor, float | None]]:
        """Runs on the inference thread: one batch of model ``name``; counts the GPU's failures.

        A batch that is out of GPU memory even in two halves answers 503 (retry); after
        ``max_device_errors`` failing batches in a row the service turns unready.
        """
        model = self.models[name]
        try:
            results = model.score_batch(batch, on_split=lambda: self.metrics.device_errors.labels(name, "split").inc())
        except Exception as error:
            if not is_cuda_error(error):
                raise
            oom = isinstance(error, torch.OutOfMemoryError)
            self.metrics.device_errors.labels(name, "out_of_memory" if oom else "error").inc()
            self._device_failed(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            if oom:
                raise ApiError(503, "device_out_of_memory", "the GPU ran out of memory scoring this batch, even split "
                               "in two; retry shortly", headers={"Retry-After": "1"}) from None
            raise
        self.device_errors = 0
        return results

    def _device_failed(self, what: str) -> None:
        self.device_errors += 1
        log.error("device error", extra={"error": what, "in_a_row": self.device_errors})
        if self.device_errors >= self.settings.max_device_errors and self.failure is None:
            self.failure = (f"{self.device_errors} scoring batches in a row failed on the GPU (last: {what}); "
                            "restart the service")
            self.ready = False

    async def check_devices(self) -> str | None:
        """Why the GPU cannot serve now (a tiny operation on every CUDA device in use fails or hangs); ``None`` if it can.

        A failed operation (the GPU in an error state) turns the service unready for good; a probe
        that times out is reported but not kept (the GPU may be busy).
        """
        devices = {m.detector.device for m in self.models.values() if m.detector.device.type == "cuda"}
        for device in devices:
            try:
                await asyncio.wait_for(asyncio.to_thread(probe, device), PROBE_TIMEOUT_S)
            except TimeoutError:
                return f"the CUDA probe on {device} took over {PROBE_TIMEOUT_S:g} s"
            except Exception as error:  # a sticky CUDA error: nothing on this GPU will work again
                self.failure = f"the CUDA probe on {device} failed ({type(error).__name__}: {error}); restart the service"
                self.ready = False
                log.error("device probe failed", extra={"device": str(device), "error": str(error)})
                return self.failure
        return None

    def _record_batch(self, name: str, size: int, waits: list[float]) -> None:
        self.metrics.batch_size.labels(name).observe(size)
        for wait in waits:
            self.metrics.queue_wait.labels(name).observe(wait)

    def observe(self, model: ServedModel, scored: list[tuple], results: list[dict], own_threshold: bool) -> None:
        """What one request was answered: into the model's monitor and the metrics."""
        model.monitor.record([raw for raw, _, _ in scored], [distance for _, _, distance in scored], own_threshold)
        for result in results:
            self.metrics.verdicts.labels(model.name, "anomalous" if result["is_anomaly"] else "normal").inc()
            self.metrics.scores.labels(model.name).observe(result["score"])
        if own_threshold:
            self.metrics.threshold_overrides.labels(model.name).inc(len(results))

    # ----------------------------------------------------------------- requests
    def model(self, name: str | None) -> ServedModel:
        if not self.ready:
            if self.failure is not None:
                raise ApiError(503, "not_ready", f"the service failed: {self.failure}", headers={"Retry-After": "30"})
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
                image = open_image(data, draft_to=decode_side(model.detector.config.input_shape),
                                   roi=model.detector.config.roi, **limits)
                picture = image.info.get(PICTURE_SIZE, image.size)
                tensor = model.detector.preprocess([image])[0]
                shown = bounded_copy(image, self.settings.heatmap_max_side) if keep_image else None
                shown_size = bounded_size(image.size, self.settings.heatmap_max_side)
                del image
        except ImageError as error:  # 413 when too large, 422 otherwise (padim.models.errors.OUTCOMES)
            raise api_error(error) from None
        large = width * height >= TRIM_AFTER_PIXELS
        if large:
            release_memory()
        return Decoded(tensor, shown, shown_size, large, picture)

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
            resized = model.detector.framing.to_picture(anomaly_map, width, height, decoded.picture)
            normalised_map = calibration.normalise(resized.double()).numpy()
            if heatmap:
                box = model.detector.framing.shown_box(width, height, decoded.picture)
                result["heatmap"] = _png_base64(overlay(decoded.shown, normalised_map, result["threshold"], scored=box))
            if mask:
                result["mask"] = _png_base64(mask_image(normalised_map, result["threshold"]))
            if decoded.large:
                release_memory()
        return result


def _png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
