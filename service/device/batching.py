"""Dynamic micro-batching on one device, as Triton's dynamic batcher does.

Every served version has a :class:`Batcher`: a queue of images that are decoded and waiting for the device. One
:class:`Scheduler` per device owns one thread that forms batches from those queues, scores them and hands each
image its result; while a batch is being scored new images queue up, so under load batches fill themselves.

**When a batch leaves.** The device never waits for company that is not coming. When it is free, the oldest queue
is sent at once with what it holds (up to the preferred size), unless more images of that model are on their way
(admitted and being decoded: :meth:`padim.service.device.admission.Places.arriving`); then it waits for them, at most
``max_delay`` after the first image queued, or until the preferred size is reached. So a lone picture is scored as
soon as it is decoded, and a burst still forms one batch. This is Triton's queue delay applied only to a forming
batch, not to every first image.

Like Triton's ``preferred_batch_size``, a batch leaves as soon as it reaches the preferred size, even when more
images are queued (they form the next batch). On a CPU the cost per image stops falling at about 8 images (see
benchmarks/serve_load.py), and larger batches only make clients arrive in convoys.

What a batch gives back per image (:class:`ScoredImage`) is what a verdict needs: the raw score, the input distance,
and the anomalous area at the threshold the image's request asked for, counted on the device for the whole batch.
The map itself is copied back only for images whose request asked for a heat map or a mask.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from padim.models.features.embedding import stacked
from padim.models.scoring.model import ScoreOutput
from padim.models.scoring.verdicts import pixels_over

from ..edge.errors import ApiError
from .device_decoding import DeviceDecode

CPU = torch.device("cpu")

log = logging.getLogger("padim.service")


@dataclass(frozen=True)
class ScoredImage:
    """One image of a scored batch.

    Attributes:
        raw_score: the image score (Mahalanobis distance units).
        input_distance: the mean squared distance over the picture's feature pixels (input drift); ``None`` from
            exports that do not compute it.
        over: map pixels at or above the image's raw threshold (its request's), counted on the device.
        pixels: pixels of the map.
        finite: the score and every map pixel are finite (a verdict is refused otherwise).
        map: ``(H_in, W_in)`` anomaly map on the CPU, only where the request asked for a heat map or a mask.
    """

    raw_score: float
    input_distance: float | None
    over: int
    pixels: int
    finite: bool
    map: torch.Tensor | None = None


#: What an image's owner is told: its result, or why it has none.
Delivery = Callable[["ScoredImage | BaseException"], None]


@dataclass(eq=False)
class Item:
    """One image waiting for the device.

    Attributes:
        tensor: ``(3, H_in, W_in)`` model input; ``None`` for a JPEG the device decodes.
        raw_threshold: where its anomalous area is counted (its request's threshold, raw units).
        keep_map: its map is wanted back (a heat map or a mask was asked for).
        deliver: called once, on the scheduler's thread, with its :class:`ScoredImage` or an exception.
        jpeg: the JPEG's bytes (a 1-D uint8 tensor) for the device to decode (:mod:`.device_decoding`).
    """

    tensor: torch.Tensor | None
    raw_threshold: float
    keep_map: bool
    deliver: Delivery
    enqueued: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # its request gave up: skipped when batches form, and told so (set from any thread)
    jpeg: torch.Tensor | None = None


class Batcher:
    """The queue of one served version, scored by its device's :class:`Scheduler`.

    Args:
        scheduler: the device's.
        score_batch: ``(B, 3, H, W)`` -> :class:`ScoreOutput` (raised errors fail the batch's images).
        max_batch_size: largest batch.
        preferred_batch_size: a batch leaves once it has this many images.
        max_delay: seconds the first image may wait for images on their way.
        arriving: images of this model admitted and not yet queued (being decoded), to wait for.
        on_batch: ``(batch size, queue waits)`` after each batch, for metrics.
        name: the model's (logs).
        device: decodes the batch's JPEGs on the scorer's device (``None``: every picture comes decoded).
        target: the scorer's device (a batch for a GPU is stacked in page-locked memory).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        score_batch: Callable[[torch.Tensor], ScoreOutput],
        max_batch_size: int,
        preferred_batch_size: int | None = None,
        max_delay: float = 0.005,
        arriving: Callable[[], int] = lambda: 0,
        on_batch: Callable[[int, list[float]], None] | None = None,
        name: str = "",
        device: DeviceDecode | None = None,
        target: torch.device = CPU,
    ):
        self.scheduler, self.score_batch, self.name, self.device = scheduler, score_batch, name, device
        self.target = target
        self.max_batch_size = max_batch_size
        self.batch_limit = min(preferred_batch_size or max_batch_size, max_batch_size)
        self.max_delay, self.arriving, self.on_batch = max_delay, arriving, on_batch
        self.queue: deque[Item] = deque()
        self.closed = False

    def put(self, items: Sequence[Item]) -> None:
        """Queue ``items`` (any thread); they are scored in order. A closed batcher fails them at once."""
        with self.scheduler.changed:
            if not self.closed:
                self.queue.extend(items)
                self.scheduler.add(self)
                self.scheduler.changed.notify()
                return
        for item in items:
            item.deliver(ApiError("shutting_down", "the server is shutting down"))

    def __len__(self) -> int:
        return len(self.queue)

    def close(self) -> None:
        """Take no more images; those still queued are answered 503 ``shutting_down``."""
        with self.scheduler.changed:
            self.closed = True
            left = list(self.queue)
            self.queue.clear()
            self.scheduler.remove(self)
        for item in left:
            item.deliver(ApiError("shutting_down", "the server is shutting down"))


class Scheduler:
    """The thread that forms batches and scores them, one batch at a time, for every batcher of one device."""

    def __init__(self, name: str = "scoring"):
        self.changed = threading.Condition()
        self._batchers: list[Batcher] = []
        self._calls: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._stop = False
        self.busy = False  # a batch is on the device
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- batchers (under ``changed``)
    def add(self, batcher: Batcher) -> None:
        if batcher not in self._batchers:
            self._batchers.append(batcher)

    def remove(self, batcher: Batcher) -> None:
        if batcher in self._batchers:
            self._batchers.remove(batcher)

    def call(self, function: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``function`` on the scheduler's thread between two batches (a warm-up, a side score, a test's hold)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.changed:
            self._calls.append((function, future))
            self.changed.notify()
        return future

    def stop(self, timeout: float = 30.0) -> None:
        with self.changed:
            self._stop = True
            self.changed.notify()
        self._thread.join(timeout)

    # ----------------------------------------------------------------- the thread
    def _next(self) -> tuple | None:
        """Under ``changed``: ``("call", function, future)`` or ``("batch", batcher, items)``, waiting as the module
        says; ``None`` to stop."""
        while True:
            if self._calls:
                return ("call", *self._calls.popleft())
            if self._stop:
                return None
            waiting = [b for b in self._batchers if b.queue]
            if not waiting:
                self.changed.wait()
                continue
            batcher = min(waiting, key=lambda b: b.queue[0].enqueued)  # the oldest image first, across models
            deadline = batcher.queue[0].enqueued + batcher.max_delay
            while (
                len(batcher.queue) < batcher.batch_limit
                and not self._calls
                and not self._stop
                and batcher.arriving() > 0
                and (remaining := deadline - time.perf_counter()) > 0
            ):
                self.changed.wait(remaining)
            items: list[Item] = []
            skipped: list[Item] = []
            while batcher.queue and len(items) < batcher.batch_limit:
                item = batcher.queue.popleft()
                (skipped if item.cancelled else items).append(item)
            return ("batch", batcher, items, skipped)

    def _run(self) -> None:
        while True:
            with self.changed:
                work = self._next()
                self.busy = work is not None and work[0] == "batch"
            if work is None:
                return
            if work[0] == "call":
                _, function, future = work
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(function())
                    except BaseException as error:  # handed to the caller
                        future.set_exception(error)
                continue
            _, batcher, items, skipped = work
            for item in skipped:  # its owner gave up; told, so that it knows the device is done with it
                _deliver(item, ApiError("client_disconnected", "the request was given up before it was scored"))
            try:
                if items:
                    self._score(batcher, items)
            finally:
                self.busy = False

    def _score(self, batcher: Batcher, items: list[Item]) -> None:
        started = time.perf_counter()
        try:
            scored = score_items(batcher.score_batch, items, batcher.device, batcher.target)
        except Exception as error:  # a failed batch fails its images, not the scheduler
            if isinstance(error, ApiError):  # an answer chosen by score_batch (503 out of GPU memory)
                log.warning("a batch of %d answered %d: %s", len(items), error.status, error.code)
                answer: BaseException = error
            else:
                log.exception("scoring a batch of %d failed", len(items), extra={"model": batcher.name})
                answer = ApiError("scoring_failed", f"scoring failed: {type(error).__name__}")
            for item in items:
                _deliver(item, answer)
            return
        if batcher.on_batch is not None:
            batcher.on_batch(len(items), [started - item.enqueued for item in items])
        for item, result in zip(items, scored, strict=True):
            _deliver(item, result)


def _deliver(item: Item, result: ScoredImage | BaseException) -> None:
    try:
        item.deliver(result)
    except Exception:  # an owner's failure is its own: the batch's other images still get theirs
        log.exception("delivering a scored image failed")


def _given(tensor: torch.Tensor | None, why: str) -> torch.Tensor:
    """``tensor``, which the batch's own invariant (``why``) says is there."""
    assert tensor is not None, why
    return tensor


def score_items(
    score_batch: Callable[[torch.Tensor], ScoreOutput],
    items: Sequence[Item],
    device: DeviceDecode | None = None,
    target: torch.device = CPU,
) -> list[ScoredImage]:
    """Score ``items`` as one batch: what each image's verdict needs, counted on the scorer's device (``target``).
    Their JPEGs are decoded on ``device`` first, together; the others' pixels cross to it as one 8-bit batch."""
    jpegs = [i for i, item in enumerate(items) if item.tensor is None]
    if jpegs:
        assert device is not None, "a JPEG came for a device that does not decode"
        tensors = [item.tensor for item in items]
        sent = [_given(items[i].jpeg, "an item without pixels carries its JPEG") for i in jpegs]
        for i, jpeg, tensor in zip(jpegs, sent, device.decode(sent), strict=True):
            tensors[i] = tensor if tensor is not None else device.on_cpu(jpeg)
        batch = torch.stack([_given(t, "every JPEG decoded").to(device.device) for t in tensors])
    else:
        batch = stacked([_given(item.tensor, "no JPEG: every item has pixels") for item in items], target)
    out = score_batch(batch)
    return scored_images(out, [item.raw_threshold for item in items], [item.keep_map for item in items])


def scored_images(out: ScoreOutput, raw_thresholds: Sequence[float], keep_maps: Sequence[bool]) -> list[ScoredImage]:
    """Per image of ``out``: raw score, input distance, the map pixels at or above its raw threshold, whether all is
    finite, and its map where ``keep_maps`` says so.

    The pixels over are counted by :func:`~padim.models.scoring.verdicts.pixels_over`, as ``padim predict`` counts
    them. On a GPU the counting is done there, with one transfer back; on a CPU in NumPy, whose one thread leaves the
    cores to the scorer (a torch op would start an OpenMP team that keeps spinning beside it).
    """
    size = len(raw_thresholds)
    if out.maps.device.type == "cpu":
        maps = out.maps.detach().numpy().reshape(size, -1)
        raws = out.raw_scores.detach().numpy().astype(np.float64)
        overs = pixels_over(maps, raw_thresholds).tolist()
        finites = (np.isfinite(maps).all(axis=1) & np.isfinite(raws)).tolist()
        raw_list = raws.tolist()
    else:
        maps_on = out.maps.flatten(1)
        raw = out.raw_scores.to(torch.float64)
        numbers = torch.stack(
            [
                raw,
                pixels_over(maps_on, raw_thresholds).to(torch.float64),
                (torch.isfinite(maps_on).all(1) & torch.isfinite(raw)).to(torch.float64),
            ]
        ).cpu()
        raw_list, over_list, finite_list = numbers.tolist()
        overs = [int(v) for v in over_list]
        finites = [bool(v) for v in finite_list]
    inputs = out.input_distances.to(torch.float64).cpu().tolist() if out.input_distances is not None else None
    kept = [i for i, keep in enumerate(keep_maps) if keep]
    maps_back = dict(zip(kept, out.maps[kept].cpu(), strict=True)) if kept else {}
    pixels = out.maps[0].numel() if size else 0
    return [
        ScoredImage(
            raw_list[i],
            None if inputs is None else inputs[i],
            int(overs[i]),
            pixels,
            bool(finites[i]),
            maps_back.get(i),
        )
        for i in range(size)
    ]
