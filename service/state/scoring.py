"""Pictures to scores on the device (:class:`DeviceScoring`): decoded, queued on a version's batcher, scored on the
scheduler's thread, answered; the device's failures counted and its health probed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from padim.models.devices import is_cuda_error, probe
from padim.models.features.embedding import TRACING
from padim.models.scoring.model import ScoreOutput

from ..device.admission import Places
from ..device.answers import answered
from ..device.batching import Item, ScoredImage
from ..device.decoding import Decoded, Decoder
from ..device.device_decoding import jpeg_tensor
from ..edge.errors import ApiError
from ..metrics import Metrics
from .served import ServedModel
from .versions import LoadedVersions

log = logging.getLogger("padim.service")

#: Seconds /health/ready waits for its CUDA probe before it says not ready (a hung GPU).
PROBE_TIMEOUT_S = 5.0


class DeviceScoring:
    """Scoring on the device, for every loaded version.

    Args:
        metrics: where batches, waits and device errors are counted.
        versions: the loaded versions (whose devices :meth:`check_devices` probes).
        decoder: decodes pictures to model input (its pool draws heat maps too).
        places: the queue bound's counts.
        max_device_errors: failing batches in a row after which the device is given up.
        on_failure: told once the device is given up (the service turns unready for good; :attr:`failure` says why).
    """

    def __init__(
        self,
        metrics: Metrics,
        versions: LoadedVersions,
        decoder: Decoder,
        places: Places,
        max_device_errors: int,
        on_failure: Callable[[], None],
    ):
        self.metrics, self.versions, self.decoder, self.places = metrics, versions, decoder, places
        self.max_device_errors, self.on_failure = max_device_errors, on_failure
        self.device_errors = 0  # scoring batches failed in a row on the GPU
        self.failure: str | None = None  # why the device was given up (for good)

    def score(self, model: ServedModel, batch: torch.Tensor) -> ScoreOutput:
        """Runs on the scheduler's thread: one batch of ``model`` (a served version); counts the GPU's failures.

        A batch that is out of GPU memory even in two halves answers 503 (retry); after
        ``max_device_errors`` failing batches in a row the service turns unready.
        """
        name = model.name
        try:
            with TRACING.shared():  # not while another version's backbone is traced on the loader thread
                out = model.score_batch(batch, on_split=lambda: self.metrics.device_errors.labels(name, "split").inc())
        except Exception as error:
            if not is_cuda_error(error):
                raise
            oom = isinstance(error, torch.OutOfMemoryError)
            self.metrics.device_errors.labels(name, "out_of_memory" if oom else "error").inc()
            self._device_failed(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            if oom:
                raise ApiError(
                    "device_out_of_memory",
                    "the GPU ran out of memory scoring this batch, even split in two; retry shortly",
                    headers={"Retry-After": "1"},
                ) from None
            raise
        self.device_errors = 0
        return out

    def _device_failed(self, what: str) -> None:
        self.device_errors += 1
        log.error("device error", extra={"error": what, "in_a_row": self.device_errors})
        if self.device_errors >= self.max_device_errors and self.failure is None:
            self._give_up(
                f"{self.device_errors} scoring batches in a row failed on the GPU (last: {what}); restart the service"
            )

    def _give_up(self, why: str) -> None:
        self.failure = why
        self.on_failure()

    async def check_devices(self) -> str | None:
        """Why the GPU cannot serve now (a tiny operation on a CUDA device in use fails or hangs); ``None`` if it can.

        A failed operation (the GPU in an error state) turns the service unready for good; a probe
        that times out is reported but not kept (the GPU may be busy).
        """
        devices = {
            m.scorer.device for m in self.versions.all() if m.scorer is not None and m.scorer.device.type == "cuda"
        }
        for device in devices:
            try:
                await asyncio.wait_for(asyncio.to_thread(probe, device), PROBE_TIMEOUT_S)
            except TimeoutError:
                return f"the CUDA probe on {device} took over {PROBE_TIMEOUT_S:g} s"
            except Exception as error:  # a sticky CUDA error: nothing on this GPU will work again
                why = f"the CUDA probe on {device} failed ({type(error).__name__}: {error}); restart the service"
                log.error("device probe failed", extra={"device": str(device), "error": str(error)})
                self._give_up(why)
                return why
        return None

    def record_batch(self, name: str, size: int, waits: list[float]) -> None:
        """A batch of ``name`` left for the device: its size, and how long each of its pictures waited."""
        self.metrics.batch_size.labels(name).observe(size)
        for wait in waits:
            self.metrics.queue_wait.labels(name).observe(wait)

    async def scored(
        self, served: ServedModel, decoded: list[Decoded], raw_threshold: float, keep_map: bool
    ) -> list[ScoredImage]:
        """Queue decoded pictures on ``served``'s batcher and wait for their scores. Cancelled (the request gave up),
        the images still queued are skipped when batches form."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in decoded]
        items = [
            Item(
                image.tensor,
                raw_threshold,
                keep_map,
                _delivery(loop, future),
                jpeg=None if image.jpeg is None else jpeg_tensor(image.jpeg),
            )
            for image, future in zip(decoded, futures, strict=True)
        ]
        served.batcher.put(items)
        try:
            return await each(futures)
        finally:
            for item in items:
                item.cancelled = True  # nothing left for the scheduler to do for this request

    async def score_pictures(
        self,
        served: ServedModel,
        datas: list[bytes],
        threshold: float | None,
        heatmap: bool,
        mask: bool,
        monitor: bool = True,
    ) -> tuple[list[ScoredImage], list[dict], list[tuple[int, int]]]:
        """Each picture as scored, its result, and its size as sent: decoded on the pool, scored by ``served``'s
        batcher, answered (heat maps and masks drawn on the pool). Places for the pictures are taken before decoding
        (503 when there are none) and given back when this returns or fails. With ``monitor``, the scores go to the
        model's monitor."""
        raw_threshold = served.scorer.calibration.raw_threshold(threshold)
        with self.places.admit(served.name, len(datas)) as admission:
            device = None if heatmap or mask else served.batcher.device
            decoded = await each(self.decoder.decoded(served.scorer, data, heatmap, device=device) for data in datas)
            admission.queued(len(decoded))
            scored = await self.scored(served, decoded, raw_threshold, heatmap or mask)
        pool = self.decoder.pool
        results = await answered(pool, served.name, served.scorer, decoded, scored, threshold, heatmap, mask)
        if monitor:
            served.monitor.record(
                [s.raw_score for s in scored], [s.input_distance for s in scored], threshold is not None
            )
        return scored, results, [image.picture for image in decoded]


async def each(awaitables) -> list:
    """What each of ``awaitables`` gives, in order: a lone one awaited as it is, several gathered."""
    awaitables = list(awaitables)
    if len(awaitables) == 1:
        return [await awaitables[0]]
    return list(await asyncio.gather(*awaitables))


def _delivery(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    """What the scheduler's thread calls with an image's result: ``future`` is resolved on ``loop``."""

    def resolve(result) -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def deliver(result) -> None:
        try:
            loop.call_soon_threadsafe(resolve, result)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass

    return deliver
