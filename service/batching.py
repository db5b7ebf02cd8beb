"""Dynamic micro-batching, as Triton's dynamic batcher does.

Requests put one preprocessed image each on a bounded queue. A single task per model takes
what is queued, waits up to ``max_delay`` for more, scores the batch once on the inference
thread and answers every request. While a batch is being scored, new requests queue up and
form the next batch, so under load batches fill themselves and at low load an image waits at
most ``max_delay``.

Like Triton's ``preferred_batch_size``, a batch is sent as soon as it reaches the preferred
size, even when more images are queued (they form the next batch). On a CPU the cost per
image stops falling at about 8 images (see benchmarks/serve_load.py), and larger batches only
make clients arrive in convoys: one large batch, then stragglers scored almost alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from .errors import ApiError

log = logging.getLogger("padim.service")


@dataclass
class Item:
    tensor: torch.Tensor  # (3, S, S) model input
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


class MicroBatcher:
    """Gathers single images into device batches for one model.

    Args:
        score_batch: called on the inference executor with a ``(B, 3, S, S)`` tensor; returns
            one result per image, in order.
        executor: where ``score_batch`` runs (one thread: one batch at a time on the device).
        max_batch_size: largest batch.
        max_delay: seconds the first image of a batch may wait for company.
        preferred_batch_size: send a batch as soon as it has this many images (default: max).
        max_queue: images admitted and not yet taken into a batch; a request that would go
            over gets 503 from :meth:`admit`, before its images are decoded.
        on_batch: ``(batch_size, queue_waits)`` callback for metrics.
    """

    def __init__(
        self,
        score_batch: Callable[[torch.Tensor], Sequence],
        executor: Executor,
        max_batch_size: int,
        max_delay: float,
        max_queue: int,
        on_batch: Callable[[int, list[float]], None] | None = None,
        preferred_batch_size: int | None = None,
    ):
        self.score_batch = score_batch
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.batch_limit = min(preferred_batch_size or max_batch_size, max_batch_size)
        self.max_delay = max_delay
        self.max_queue = max_queue
        self.queue: asyncio.Queue[Item] = asyncio.Queue()  # bounded by admission, not here
        self.admitted = 0  # images admitted (reserved or queued) and not yet taken into a batch
        self.on_batch = on_batch
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        while not self.queue.empty():  # nothing should be left after a drain; fail loudly if so
            item = self.queue.get_nowait()
            self._taken(1)
            if not item.future.done():
                item.future.set_exception(ApiError("shutting_down", "the server is shutting down"))

    def admit(self, count: int) -> Admission:
        """Reserve queue places for ``count`` images, before they are decoded.

        Raises:
            ApiError: 503 ``overloaded`` (with ``Retry-After``) when the queue has no room now.
        """
        if self.admitted + count > self.max_queue:
            raise ApiError(
                "overloaded",
                f"the queue is full ({self.admitted} of {self.max_queue} places taken); retry shortly",
                headers={"Retry-After": "1"},
            )
        self.admitted += count
        return Admission(self, count)

    def submit(self, tensor: torch.Tensor, admission: Admission | None = None) -> asyncio.Future:
        """Queue one ``(3, S, S)`` image on a place ``admission`` reserved (or admit it now); the
        future resolves to its result."""
        admission = admission or self.admit(1)
        if admission.unused <= 0:
            raise RuntimeError("submit() beyond the places admitted")
        admission.unused -= 1
        future = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(Item(tensor, future))
        return future

    def _taken(self, count: int) -> None:
        self.admitted -= count

    async def _gather(self) -> list[Item]:
        batch = [await self.queue.get()]
        self._taken(1)
        deadline = time.perf_counter() + self.max_delay
        while len(batch) < self.batch_limit:
            if not self.queue.empty():
                batch.append(self.queue.get_nowait())
                self._taken(1)
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), remaining))
            except TimeoutError:
                break
            self._taken(1)
        return [item for item in batch if not item.future.done()]  # skip requests that gave up

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather()
            if not batch:
                continue
            started = time.perf_counter()
            try:
                stacked = torch.stack([item.tensor for item in batch])
                results = await loop.run_in_executor(self.executor, self.score_batch, stacked)
            except Exception as error:  # a failed batch fails its requests, not the server
                if isinstance(error, ApiError):  # an answer chosen by score_batch (503 out of GPU memory)
                    log.warning("a batch of %d answered %d: %s", len(batch), error.status, error.code)
                    answer = error
                else:
                    log.exception("scoring a batch of %d failed", len(batch))
                    answer = ApiError("scoring_failed", f"scoring failed: {type(error).__name__}")
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(answer)
                continue
            if self.on_batch is not None:
                self.on_batch(len(batch), [started - item.enqueued for item in batch])
            for item, result in zip(batch, results, strict=False):
                if not item.future.done():
                    item.future.set_result(result)


class Admission:
    """Queue places reserved for one request's images; :meth:`release` gives back the unused ones.

    Use as a context manager around decoding and submitting, so a request that fails before
    queueing all its images (a bad image, a disconnect) frees its places.
    """

    def __init__(self, batcher: MicroBatcher, count: int):
        self.batcher, self.unused = batcher, count

    def release(self) -> None:
        self.batcher._taken(self.unused)
        self.unused = 0

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
