"""The versions a service has loaded (:class:`LoadedVersions`): the active one of each model and the retired ones
still answering, by name and by serial; a version is closed once its last request is answered."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager

from ..device.decoding import release_memory
from ..metrics import Metrics
from .served import ServedModel, release_device_memory

log = logging.getLogger("padim.service")


class LoadedVersions:
    """Every loaded version, and which one of each model new requests go to.

    Args:
        metrics: where loads and changes are counted.
        collector: the thread a closed version's memory is handed back on (the loader's, beside scoring).
    """

    def __init__(self, metrics: Metrics, collector: Executor):
        self.metrics, self.collector = metrics, collector
        self.models: dict[str, ServedModel] = {}  # the active version of each model
        self.retired: list[ServedModel] = []  # replaced versions still answering requests they admitted
        self.by_serial: dict[int, ServedModel] = {}  # every loaded version (active and retired), by serial
        self.default_name: str | None = None
        self.unloaded: set[str] = set()  # models taken off (DELETE /models/{name}); the poll leaves them be
        self.serials = 0  # the last serial given (the scoring process of a service starts past its predecessor's)
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop the service runs on (set by its load)
        self.on_change: Callable[[], None] | None = None  # told after every change of what is served
        self._tasks: set[asyncio.Task] = set()  # closings and update jobs, cancelled when the service stops

    def next_serial(self) -> int:
        self.serials += 1
        return self.serials

    def all(self) -> list[ServedModel]:
        """The active versions, then the retired ones."""
        return [*self.models.values(), *self.retired]

    def find(self, name: str, version: int) -> ServedModel | None:
        """Version ``version`` of ``name`` where it is loaded and not yet closed."""
        return next((m for m in self.all() if m.name == name and m.version == version and m.scorer is not None), None)

    def track(self, task: asyncio.Task) -> None:
        """Keep ``task`` until it is done; :meth:`close` cancels it."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def install(self, name: str, served: ServedModel, change: str | None = None) -> None:
        """Make ``served`` the active version of ``name`` at once, retiring the one it replaces; ``change``
        (activate, rollback) is counted, none at start-up. The first model served is the default one."""
        old = self.models.get(name)
        self.by_serial[served.serial] = served
        self.models[name] = served  # from here on, new requests go to the new version
        self.unloaded.discard(name)
        if self.default_name is None:
            self.default_name = name
        self.metrics.model_load.labels(name).set(served.load_seconds)
        self.metrics.model_version.labels(name).set(served.version)
        if change is not None:
            self.metrics.model_changes.labels(name, change).inc()
        log.info(
            "model ready",
            extra={
                "model": name,
                "version": served.version,
                "load_seconds": round(served.load_seconds, 3),
                "weights": served.scorer.weights.label,
            },
        )
        if old is not None:
            self.retire(old)
        else:
            self.changed()

    def take_off(self, name: str) -> None:
        """Stop serving ``name`` (DELETE /models/{name}): its version retires, and the poll leaves the model be."""
        self.retire(self.models.pop(name))
        self.unloaded.add(name)

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def retire(self, old: ServedModel) -> None:
        with old.lock:
            old.retired = True
            idle = old.in_flight == 0
        self.retired.append(old)
        if idle:
            self._close_later(old)
        self.changed()  # an unloaded model leaves the table at once, not when its version closes

    def _close_later(self, old: ServedModel) -> None:
        close = self._close_version(old)
        self.track(asyncio.get_running_loop().create_task(close, name=f"close-{old.name}-{old.version}"))

    async def _close_version(self, old: ServedModel) -> None:
        """A retired version with no request left: close its batcher and hand its memory back."""
        old.batcher.close()
        self.by_serial.pop(old.serial, None)
        if old in self.retired:
            self.retired.remove(old)
        old.scorer = None  # type: ignore[assignment]  # the last reference to the tensors (batcher and monitor hold none)
        self.changed()
        await asyncio.get_running_loop().run_in_executor(self.collector, collect)
        log.info("version retired", extra={"model": old.name, "version": old.version})

    def hold(self, served: ServedModel) -> bool:
        """Count one more request on ``served`` (any thread); ``False`` when it is retired and idle, closing."""
        with served.lock:
            if served.retired and served.in_flight == 0:
                return False
            served.in_flight += 1
            return True

    def let_go(self, served: ServedModel) -> None:
        """One request of ``served`` is answered (any thread); the last of a retired version closes it."""
        with served.lock:
            served.in_flight -= 1
            closing = served.retired and served.in_flight == 0
        if closing and self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the process is stopping
                self.loop.call_soon_threadsafe(self._close_later, served)

    @contextmanager
    def using(self, served: ServedModel) -> Iterator[ServedModel]:
        """Hold ``served`` for one request (on the event loop): it is not closed before the request is answered."""
        with served.lock:
            served.in_flight += 1
        try:
            yield served
        finally:
            with served.lock:
                served.in_flight -= 1
                closing = served.retired and served.in_flight == 0
            if closing:
                self._close_later(served)

    def close(self) -> None:
        """The service stops: every batcher closes, and what was to close them later is cancelled."""
        for model in self.all():
            model.batcher.close()
        for task in list(self._tasks):
            task.cancel()


def collect() -> None:
    """Free what a dropped version held, and hand it back to the system (and the GPU)."""
    gc.collect()
    release_memory()
    release_device_memory()
