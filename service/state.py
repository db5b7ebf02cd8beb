"""What the running service holds: its models, their batchers, thread pools, readiness."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from padim.core.artifact import file_sha256
from padim.core.errors import ArtifactError
from padim.models.deploy.runtimes import DeployedDetector, load_scorer
from padim.models.devices import is_cuda_error, probe
from padim.models.errors import (
    DefaultModel,
    ExportError,
    InsufficientMemory,
    ModelBusy,
    ReadOnlyModels,
    RecordGone,
    UnservableModel,
    UpdateGateFailed,
    UsageError,
    VersionActive,
    VersionNotFound,
    WeightsError,
)
from padim.models.features.embedding import TRACING
from padim.models.fit.model_file import served_bytes
from padim.models.repository import Repository, Version, check_model, model_path_in, utc_now
from padim.models.scorer import Scorer
from padim.models.scoring.model import ScoreOutput

from .admission import LocalPlaces, Places
from .answers import answer, count_verdicts, keep_rows
from .batching import Batcher, Item, Scheduler, ScoredImage, score_items
from .decoding import Decoded, Decoder, release_memory
from .device_decoding import DeviceDecode, jpeg_tensor
from .errors import ApiError
from .metrics import Metrics
from .monitor import Monitor
from .record.recorder import Recorder
from .record.store import RecordStore, database_url
from .schemas import ModelDescription, ModelInfo
from .settings import ServiceSettings
from .updates import UpdateJobs

log = logging.getLogger("padim.service")

#: Seconds /health/ready waits for its CUDA probe before it says not ready (a hung GPU).
PROBE_TIMEOUT_S = 5.0

#: A version is loaded only where free memory holds this many times the bytes it will hold (its tensors, the
#: runtime's copy while it loads, the warm-up batch's activations).
LOAD_MEMORY_FACTOR = 1.5


@dataclass(eq=False)
class ServedModel:
    """One loaded version of a model, with its own batcher and monitor.

    A request holds the version it was admitted by (:meth:`ServiceState.using`) until it is answered:
    its images are scored by this version's batcher, which is bound to this scorer, and judged by
    this calibration, whatever is activated meanwhile. A replaced version is *retired*: it takes no new
    request and is closed once its last one is answered.

    ``serial`` names this load of a version among every version the process has loaded (the API processes of a
    service ask for it by that: :mod:`padim.service.processes`).
    """

    name: str
    path: Path
    sha256: str
    scorer: Scorer
    batcher: Batcher
    load_seconds: float
    monitor: Monitor
    version: int = 1
    serial: int = 0
    in_flight: int = 0  # requests admitted by this version and not yet answered
    retired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # in_flight, from any thread

    def info(self) -> ModelInfo:
        """Identity of the model, returned with every score."""
        return model_info(self.name, self.version, self.sha256, self.scorer)

    def identity(self) -> dict:
        """:meth:`info` as the JSON every answer carries, made once a version (it never changes)."""
        cached = self.__dict__.get("_identity")
        if cached is None or cached["version"] != self.version:
            cached = self.__dict__["_identity"] = self.info().model_dump()
        return cached

    def describe(self, versions: list | None = None) -> ModelDescription:
        """The model in full (``GET /models``); no server paths."""
        return ModelDescription(
            **{
                **self.scorer.describe(),
                **self.info().model_dump(),
                "threshold": 0.5,
                "load_seconds": round(self.load_seconds, 3),
                "versions": versions or [],
            }
        )

    def score_batch(self, batch: torch.Tensor, on_split=None) -> ScoreOutput:
        """Runs on the scheduler's thread: ``(B, 3, H, W)`` -> the scorer's output.

        Out of GPU memory, the cache is emptied and the batch scored again in two halves
        (``on_split`` is told); a half that still does not fit raises ``torch.OutOfMemoryError``.
        """
        try:
            return self.scorer.score(batch)
        except torch.OutOfMemoryError:
            release_device_memory()
            if batch.shape[0] == 1:
                raise
            log.warning(
                "out of GPU memory at batch %d; scoring it in two halves", batch.shape[0], extra={"model": self.name}
            )
            if on_split is not None:
                on_split()
            half = (batch.shape[0] + 1) // 2
            try:
                return joined(self.scorer.score(batch[:half]), self.scorer.score(batch[half:]))
            except torch.OutOfMemoryError:
                release_device_memory()
                raise


def model_info(name: str, version: int, sha256: str, scorer) -> ModelInfo:
    """Identity of a served version (``scorer``: the scorer or a view of it), returned with every score."""
    return ModelInfo(
        name=name,
        version=version,
        backbone=scorer.config.features.backbone,
        created=scorer.provenance.created,
        sha256=sha256,
        weights=scorer.weights.public_label,
    )  # no server paths for clients


def joined(first: ScoreOutput, second: ScoreOutput) -> ScoreOutput:
    """Two outputs of one scorer as one, in order."""
    inputs = (
        torch.cat([first.input_distances, second.input_distances])
        if first.input_distances is not None and second.input_distances is not None
        else None
    )
    return ScoreOutput(torch.cat([first.raw_scores, second.raw_scores]), torch.cat([first.maps, second.maps]), inputs)


def _size_on_disk(path: Path) -> int:
    """Bytes a served version reads: a model file's tensors but its statistics, or every file of an export."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    try:
        return served_bytes(path)
    except ArtifactError:
        return path.stat().st_size  # not readable: the load says why


def available_memory(device: str) -> tuple[int | None, str]:
    """Free memory where a version would be loaded: ``(bytes, where)``; ``None`` when it cannot be read.

    The GPU's free memory (``torch.cuda.mem_get_info``) when models go there, else the system's
    ``MemAvailable`` (``/proc/meminfo``, what the kernel can hand out without swapping).
    """
    if device != "cpu" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return free, "the GPU"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "this machine"
    except OSError:
        pass
    return None, "this machine"


def _unservable(error: Exception, path: Path) -> UnservableModel:
    """An uploaded model that cannot be served, said without the server's path to it."""
    message = str(error).replace(str(path), "the uploaded file")
    return UnservableModel(
        message if isinstance(error, UnservableModel) else f"the model cannot be served here: {message}"
    )


def _collect() -> None:
    """Free what a dropped version held, and hand it back to the system (and the GPU)."""
    gc.collect()
    release_memory()
    release_device_memory()


def release_device_memory() -> None:
    """Hand the blocks torch's CUDA allocator caches back to the GPU (nothing without CUDA)."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def model_name(path: Path) -> str:
    return path.name.removesuffix(".padim") if path.name.endswith(".padim") else path.stem


class ServiceState:
    """The service's state: models (and their versions), the device's scheduler, pools and readiness.

    Args:
        settings: the service's.
        metrics: where it counts (a new registry by default).
        places: the queue bound's counts (one process's by default; shared by the processes of
            :mod:`padim.service.processes`).
    """

    def __init__(self, settings: ServiceSettings, metrics: Metrics | None = None, places: Places | None = None):
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.models: dict[str, ServedModel] = {}  # the active version of each model
        self.retired: list[ServedModel] = []  # replaced versions still answering requests they admitted
        self.by_serial: dict[int, ServedModel] = {}  # every loaded version (active and retired), by serial
        self.default_name: str | None = None
        self.repository = Repository(settings.repository) if settings.repository is not None else None
        self.unloaded: set[str] = set()  # models taken off (DELETE /models/{name}); the poll leaves them be
        self.ready = False
        self.draining = False
        self.startup_error: str | None = None
        self.failure: str | None = None  # why a ready service became unready (its GPU failed)
        self.device_errors = 0  # scoring batches failed in a row on the GPU
        self.scheduler = Scheduler()  # the device's one thread: forms batches and scores them
        # versions are loaded and warmed up here, beside scoring, so that a swap does not stall the line
        self.loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")
        self.decoder = Decoder(
            settings.decode_workers, settings.pixel_budget(), settings.max_image_pixels, settings.heatmap_max_side
        )
        self.decode = self.decoder.pool
        self.places: Places = places or LocalPlaces(settings.max_queue)
        self._changing: dict[str, asyncio.Lock] = {}
        self._closing: set[asyncio.Task] = set()
        self.serials = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop it runs on (set by load)
        self.on_change: Callable[[], None] | None = None  # told after every change of what is served
        self.record: Recorder | None = None  # the inspection record (PADIM_RECORD_DIR / PADIM_RECORD_URL)
        self.record_siblings: tuple[str, ...] = ()  # the API processes' journals, in a service of several processes
        # model updates (POST /models/{name}/update): one thread, so one update runs at a time beside scoring
        self.updates = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-update")
        self.jobs = UpdateJobs(self)
        self.side: dict[
            tuple[str, int], Scorer
        ] = {}  # a version that is not served, loaded to draw a record's heat map

    def open_record(self) -> None:
        """Start the inspection record when it is on (its database is brought up to date by its writer thread)."""
        settings = self.settings
        if not settings.record_on:
            return
        folder = settings.record_folder()
        folder.mkdir(parents=True, exist_ok=True)
        url = settings.record_url.get_secret_value() if settings.record_url is not None else None
        store = RecordStore(database_url(url, folder))
        self.record = Recorder(  # JournalTaken (a UsageError): another process writes this journal
            folder,
            store,
            settings.record_journal_max_bytes,
            settings.record_max_bytes,
            settings.record_retention_days,
            settings.record_flagged_retention_days,
            self.metrics,
            settings.replica,
            siblings=self.record_siblings,
        )
        self.record.start()
        log.info(
            "inspection record on",
            extra={"folder": str(folder), "database": store.kind, "required": settings.record_required},
        )

    # ----------------------------------------------------------------- lifecycle
    async def load(self) -> None:
        """Load every model (each one's active version, from a repository), warm it up, start its batcher; ready."""
        self.loop = asyncio.get_running_loop()
        if self.repository is not None:
            names = self.repository.names()
            for name in names:
                number = self.repository.active(name)
                assert number is not None  # names() lists models with a version
                self._install(name, await self._prepare(self.repository.version(name, number)))
        else:
            files = self.settings.model_files()
            if not files:
                raise UsageError("no model to serve: pass --model FILE, set PADIM_MODEL_DIR or PADIM_REPOSITORY")
            names = [model_name(p) for p in files]
            if len(set(names)) != len(names):
                raise UsageError(
                    f"two model files have the same name: {sorted(n for n in names if names.count(n) > 1)[0]}"
                )
            for path, name in zip(files, names, strict=True):
                self._install(
                    name,
                    await self._prepare(
                        Version(name, 1, path, "", "", path.name, "export" if path.is_dir() else "model")
                    ),
                )
        if names:
            self.default_name = self.settings.default_model or names[0]
            if self.default_name not in self.models:
                raise UsageError(
                    f"default model {self.default_name!r} is not among the loaded ones: {', '.join(names)}"
                )
        self.ready = True

    async def _prepare(self, version: Version) -> ServedModel:
        """Load and warm up ``version`` on the loader thread, beside what is served; nothing is sent to it yet."""
        self._check_memory(version.path)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        cache = self.repository.cache_root(version.name) if self.repository is not None else None
        scorer, sha256 = await loop.run_in_executor(self.loader, self._load_one, version.path, cache)
        seconds = time.perf_counter() - started
        largest, preferred = self.settings.picture_batches(scorer.device.type, scorer.config.tile_count)
        self.serials += 1
        served = ServedModel(
            version.name,
            version.path,
            version.sha256 or sha256,
            scorer,
            None,  # type: ignore[arg-type]  # made next: it is bound to this version
            seconds,
            Monitor(
                scorer.calibration,
                self.settings.monitor_window,
                self.settings.monitor_level,
                self.settings.monitor_min_images,
            ),
            version=version.version,
            serial=self.serials,
        )
        name = version.name
        served.batcher = Batcher(
            self.scheduler,
            score_batch=functools.partial(self.score, served),  # bound to this version, never looked up by name
            max_batch_size=largest,
            preferred_batch_size=preferred,
            max_delay=self.settings.max_delay_ms / 1000,
            arriving=lambda: self.places.arriving(name),
            on_batch=lambda size, waits: self._record_batch(name, size, waits),
            name=name,
            device=self.device_decode(scorer),
            target=scorer.device,
        )
        return served

    def device_decode(self, scorer: Scorer) -> DeviceDecode | None:
        """Whether ``scorer``'s device decodes its JPEGs (``PADIM_DEVICE_DECODE``: auto on CUDA, on, off)."""
        mode = self.settings.device_decode
        if mode == "off" or (mode == "auto" and scorer.device.type != "cuda"):
            return None
        return DeviceDecode(scorer.device, scorer.framing)

    def _install(self, name: str, served: ServedModel, change: str | None = None) -> None:
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
            self._retire(old)
        else:
            self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _retire(self, old: ServedModel) -> None:
        with old.lock:
            old.retired = True
            idle = old.in_flight == 0
        self.retired.append(old)
        if idle:
            self._close_later(old)
        self._changed()  # an unloaded model leaves the table at once, not when its version closes

    def _close_later(self, old: ServedModel) -> None:
        task = asyncio.get_running_loop().create_task(self._close_version(old), name=f"close-{old.name}-{old.version}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_version(self, old: ServedModel) -> None:
        """A retired version with no request left: close its batcher and hand its memory back."""
        old.batcher.close()
        self.by_serial.pop(old.serial, None)
        if old in self.retired:
            self.retired.remove(old)
        old.scorer = None  # type: ignore[assignment]  # the last reference to the tensors (batcher and monitor hold none)
        self._changed()
        await asyncio.get_running_loop().run_in_executor(self.loader, _collect)
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

    def _check_memory(self, path: Path) -> None:
        """Refuse a load that would not fit beside what is loaded (the model's size against free memory)."""
        need = _size_on_disk(path)
        free, where = available_memory(self.settings.device)
        if free is not None and need * LOAD_MEMORY_FACTOR > free:
            raise InsufficientMemory(
                f"loading {path.name} needs about {need * LOAD_MEMORY_FACTOR / 2**20:,.0f} MiB and {where} has "
                f"{free / 2**20:,.0f} MiB free beside the {len(self.models) + len(self.retired)} version(s) loaded; "
                "unload a model (DELETE /models/{name}) or wait for a retired version to drain"
            )

    def _load_one(self, path: Path, cache: Path | None = None) -> tuple[Scorer, str]:
        try:
            scorer = load_scorer(path, self.settings.runtime, self.settings.device, cache=cache)
        except ExportError as error:
            raise ExportError(f"{path}: {error}") from None
        if scorer.device.type == "cuda" and self.settings.cuda_memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(self.settings.cuda_memory_fraction, scorer.device)
        tiles = scorer.config.tile_count
        _, largest = self.settings.picture_batches(scorer.device.type, tiles)  # the largest batch the batcher forms
        try:
            scorer.score(
                torch.zeros(largest, 3, *scorer.config.input_shape, dtype=torch.uint8)
            )  # warm-up (and cudnn's tuning) at that size
        except torch.OutOfMemoryError:
            release_device_memory()
            raise UsageError(
                f"{path}: a batch of {largest} images ({largest * tiles} tiles) does not fit in the GPU's memory; "
                "lower "
                "PADIM_MAX_BATCH_SIZE (or PADIM_PREFERRED_BATCH_SIZE), or serve fewer models per GPU"
            ) from None
        graphs = scorer.capture_graphs(largest) if self.settings.cuda_graphs else ()
        log.info(
            "warmed up",
            extra={
                "model": model_name(path),
                "batch": largest,
                "device": str(scorer.device),
                "runtime": scorer.runtime,
                "cuda_graphs": list(graphs),
            },
        )
        sha256 = scorer.metadata["model"]["sha256"] if isinstance(scorer, DeployedDetector) else file_sha256(path)
        return scorer, sha256

    async def close(self) -> None:
        self.ready = False
        for model in [*self.models.values(), *self.retired]:
            model.batcher.close()
        for task in list(self._closing):
            task.cancel()
        self.jobs.stopping.set()  # a running update writes no version now (its row says so at the next start)
        self.updates.shutdown(wait=True, cancel_futures=True)
        if self.record is not None:
            await asyncio.to_thread(self.record.close)
        await asyncio.to_thread(self.scheduler.stop)
        self.loader.shutdown(wait=True)
        self.decoder.shutdown()

    # ----------------------------------------------------------------- versions (the admin routes)
    def writable(self) -> Repository:
        """The repository; a fixed set of models (PADIM_MODELS / PADIM_MODEL_DIR) has none to change."""
        if self.repository is None:
            raise ReadOnlyModels(
                "the models are served from PADIM_MODELS / PADIM_MODEL_DIR, a fixed set; serve a "
                "repository (PADIM_REPOSITORY, padim serve --repository DIR) to change them while "
                "the service runs"
            )
        if not self.ready:
            raise ApiError("not_ready", "models are still loading; retry shortly", headers={"Retry-After": "2"})
        return self.repository

    def versions(self, name: str) -> list[dict]:
        """Every version of ``name``, the active one marked, with its calibration summary."""
        served = self.models.get(name)
        if self.repository is None:
            if served is None:
                raise VersionNotFound(f"no model named {name!r}")
            fixed = Version(
                name,
                1,
                served.path,
                served.sha256,
                served.scorer.provenance.created or "",
                "model set",  # PADIM_MODELS / PADIM_MODEL_DIR; no file names for clients
                "export" if served.path.is_dir() else "model",
            )
            return [
                {
                    **fixed.to_dict(),
                    "active": True,
                    "loaded": True,
                    "calibration": served.scorer.describe()["calibration"],
                }
            ]
        listed = self.repository.versions(name)
        if not listed:
            raise VersionNotFound(f"the repository has no model named {name!r}")
        loaded = {m.version for m in [served, *self.retired] if m is not None and m.name == name}
        return [
            {
                **v.to_dict(),
                "active": served is not None and served.version == v.version,
                "loaded": v.version in loaded,
                "calibration": v.calibration(),
            }
            for v in listed
        ]

    @contextlib.asynccontextmanager
    async def changing(self, name: str, wait: bool = False):
        """One change of a model at a time: a second one waits (``wait``) or is refused (409 model_busy)."""
        lock = self._changing.setdefault(name, asyncio.Lock())
        if lock.locked() and not wait:
            raise ModelBusy(f"another change of {name!r} is under way; retry when it has finished")
        async with lock:
            yield

    async def add_version(self, name: str, incoming: Path, sha256: str, activate: bool) -> dict:
        """An uploaded model in ``incoming``: checked, loaded and warmed up beside the active version, then
        committed as the next version; activated at once when asked. Nothing changes when it fails."""
        repository = self.writable()
        path, kind = model_path_in(incoming)
        try:
            check_model(path)
        except UnservableModel as error:
            raise _unservable(error, path) from None
        async with self.changing(name, wait=True):
            try:
                served = await self._prepare(Version(name, 0, path, sha256, "", "upload", kind))
            except (ArtifactError, ExportError, WeightsError, UsageError) as error:
                if isinstance(error, InsufficientMemory):
                    raise
                raise _unservable(error, path) from None
            committed = await asyncio.to_thread(repository.commit, name, incoming, sha256, "upload")
            served.version, served.path = committed.version, committed.path
            if activate:
                await asyncio.to_thread(repository.activate, name, committed.version)
                self._install(name, served, "activate")
            else:
                await asyncio.get_running_loop().run_in_executor(self.loader, _collect)  # the check's copy
            self.metrics.model_changes.labels(name, "upload").inc()
        return {**committed.to_dict(), "active": activate}

    async def activate(self, name: str, number: int, rollback: bool = False, force: bool = False) -> dict:
        """Load version ``number`` beside the active one, point the repository at it, then swap.

        With ``rollback``, the version is the one active before the current (409 when none). A version made by an
        update whose gate failed is refused (409 update_gate_failed) unless ``force``, which its ``version.json``
        then keeps."""
        repository = self.writable()
        async with self.changing(name):
            if rollback:
                number = repository.previous(name)
            version = repository.version(name, number)
            gate = (version.update or {}).get("gate") or {}
            if not rollback and gate.get("passed") is False:
                if not force:
                    raise UpdateGateFailed(
                        f"version {number} of {name!r} failed its update's gate: {gate.get('why')}; "
                        "activate it with force=true to override (it is kept in its version.json)"
                    )
                await asyncio.to_thread(
                    repository.note_forced, name, number, {"time": utc_now(), "gate": gate.get("why")}
                )
                log.warning("version activated past its gate", extra={"model": name, "version": number})
            current = self.models.get(name)
            if current is not None and current.version == number:
                await asyncio.to_thread(repository.activate, name, number)  # served already: the pointer only
            else:
                served = await self._prepare(version)
                if rollback:
                    await asyncio.to_thread(repository.rollback, name)
                else:
                    await asyncio.to_thread(repository.activate, name, number)
                self._install(name, served, "rollback" if rollback else "activate")
        return {**version.to_dict(), "active": True}

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` (its files stay); the default model cannot be unloaded."""
        self.writable()
        async with self.changing(name):
            if name not in self.models:
                raise VersionNotFound(f"no model named {name!r} is loaded")
            if name == self.default_name:
                raise DefaultModel(
                    f"{name!r} is the default model; start the service with another PADIM_DEFAULT_MODEL to unload it"
                )
            self._retire(self.models.pop(name))
            self.unloaded.add(name)
            self.metrics.model_changes.labels(name, "unload").inc()

    async def remove(self, name: str, number: int) -> None:
        repository = self.writable()
        async with self.changing(name):
            served = self.models.get(name)
            if served is not None and served.version == number:
                raise VersionActive(
                    f"version {number} of {name!r} is being served; activate another (or roll back) first"
                )
            await asyncio.to_thread(repository.remove, name, number)

    async def poll(self) -> None:
        """Serve what the repository says is active (a version or model copied in, ``ACTIVE`` edited by hand)."""
        assert self.repository is not None
        every_s = self.settings.repository_poll_s
        assert every_s is not None, "polled only with PADIM_REPOSITORY_POLL_S"
        failed: set[tuple[str, int]] = set()
        while True:
            await asyncio.sleep(every_s)
            if not self.ready:
                continue
            for name in await asyncio.to_thread(self.repository.names):
                number = self.repository.active(name)
                served = self.models.get(name)
                if (
                    number is None
                    or name in self.unloaded
                    or (served is not None and served.version == number)
                    or (name, number) in failed
                ):
                    continue
                try:
                    async with self.changing(name):
                        self._install(name, await self._prepare(self.repository.version(name, number)), "activate")
                except ModelBusy:  # an admin route is changing it: read it again at the next poll
                    continue
                except Exception as error:  # a bad copy is reported once, and the active version keeps serving
                    failed.add((name, number))
                    log.error(
                        "repository poll: version not served",
                        extra={"model": name, "version": number, "error": str(error)},
                    )

    def score(self, model: ServedModel, batch: torch.Tensor) -> ScoreOutput:
        """Runs on the scheduler's thread: one batch of ``model`` (a served version); counts the GPU's failures.

        A batch that is out of GPU memory even in two halves answers 503 (retry); after
        ``max_device_errors`` failing batches in a row the service turns unready.
        """
        name = model.name
        try:
            with TRACING:  # not while another version's backbone is traced on the loader thread
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
        if self.device_errors >= self.settings.max_device_errors and self.failure is None:
            self.failure = (
                f"{self.device_errors} scoring batches in a row failed on the GPU (last: {what}); restart the service"
            )
            self.ready = False

    async def check_devices(self) -> str | None:
        """Why the GPU cannot serve now (a tiny operation on a CUDA device in use fails or hangs); ``None`` if it can.

        A failed operation (the GPU in an error state) turns the service unready for good; a probe
        that times out is reported but not kept (the GPU may be busy).
        """
        devices = {
            m.scorer.device
            for m in [*self.models.values(), *self.retired]
            if m.scorer is not None and m.scorer.device.type == "cuda"
        }
        for device in devices:
            try:
                await asyncio.wait_for(asyncio.to_thread(probe, device), PROBE_TIMEOUT_S)
            except TimeoutError:
                return f"the CUDA probe on {device} took over {PROBE_TIMEOUT_S:g} s"
            except Exception as error:  # a sticky CUDA error: nothing on this GPU will work again
                self.failure = (
                    f"the CUDA probe on {device} failed ({type(error).__name__}: {error}); restart the service"
                )
                self.ready = False
                log.error("device probe failed", extra={"device": str(device), "error": str(error)})
                return self.failure
        return None

    def _record_batch(self, name: str, size: int, waits: list[float]) -> None:
        self.metrics.batch_size.labels(name).observe(size)
        for wait in waits:
            self.metrics.queue_wait.labels(name).observe(wait)

    def observe(self, model: ServedModel, results: list[dict], own_threshold: bool) -> None:
        """What one request was answered, into the verdict metrics (its scores went to the monitor as they were
        scored: :meth:`score_pictures`)."""
        count_verdicts(self.metrics, model.name, model.version, results, own_threshold)

    def keep(
        self,
        model: ServedModel,
        datas: list[bytes],
        digests: list[str],
        fields: list[dict],
        scored: list[ScoredImage],
        results: list[dict],
        pictures: list[tuple[int, int]],
    ) -> list:
        """Hand each answered picture's row and bytes to the record (never waits); each result gets its row's id.
        Returns the rows' futures, resolved once each row is durable."""
        assert self.record is not None
        return keep_rows(
            self.record,
            self.settings.review_sample,
            model.name,
            model.version,
            datas,
            digests,
            fields,
            scored,
            results,
            pictures,
        )

    async def heatmap_of(self, name: str, version: int, data: bytes, threshold: float) -> dict:
        """A recorded picture's result with its heat map, from the version that scored it: the served one when it is
        loaded, else that version read from the repository (the last one so read is kept for the next request).

        Raises:
            RecordGone: the version was deleted (or the model is no longer served from a fixed set).
        """
        loaded = next(
            (
                m
                for m in [*self.models.values(), *self.retired]
                if m.name == name and m.version == version and m.scorer is not None
            ),
            None,
        )
        loop = asyncio.get_running_loop()
        if loaded is not None:
            with self.using(loaded) as served:
                return await self._draw(served, data, threshold, loop)
        if self.repository is None:
            raise RecordGone(
                f"version {version} of {name!r} is not served any more (a fixed set of models); its "
                "heat maps cannot be drawn again"
            )
        try:
            path = (await asyncio.to_thread(self.repository.version, name, version)).path
        except (VersionNotFound, UsageError):
            raise RecordGone(
                f"version {version} of {name!r} was deleted from the repository, so its heat maps cannot "
                "be drawn again; the record keeps its row and picture"
            ) from None
        key = (name, version)
        scorer = self.side.get(key)
        if scorer is None:
            self._check_memory(path)
            scorer = await loop.run_in_executor(self.loader, load_scorer, path, "torch", self.settings.device)
            self.side = {key: scorer}  # one at a time: the last asked for
        # no batcher nor monitor: it draws one heat map, off the scheduler
        side = ServedModel(name, path, "", scorer, None, 0.0, None, version=version)  # type: ignore[arg-type]
        return await self._draw(side, data, threshold, loop, side=True)

    async def _draw(self, served: ServedModel, data: bytes, threshold: float, loop, side: bool = False) -> dict:
        own = None if abs(threshold - 0.5) < 1e-12 else threshold
        decoded = await loop.run_in_executor(self.decode, self.decoder.decode, served.scorer, data, True)
        raw_threshold = served.scorer.calibration.raw_threshold(0.5 if own is None else own)
        if side:  # not served: scored on the device's thread between two batches, by its own scorer
            item = Item(decoded.tensor, raw_threshold, True, lambda result: None)
            scored = await asyncio.wrap_future(self.scheduler.call(lambda: score_items(served.score_batch, [item])[0]))
        else:
            (scored,) = await self.scored(served, [decoded], raw_threshold, True)
        return await loop.run_in_executor(
            self.decode, answer, served.name, served.scorer, decoded, scored, own, True, False
        )

    # ----------------------------------------------------------------- requests
    def model(self, name: str | None) -> ServedModel:
        if not self.ready:
            if self.failure is not None:
                raise ApiError("not_ready", f"the service failed: {self.failure}", headers={"Retry-After": "30"})
            raise ApiError("not_ready", "models are still loading; retry shortly", headers={"Retry-After": "2"})
        key = name or self.default_name
        if key is None:
            raise ApiError("model_not_found", "no model is served yet: upload one (POST /models/{name}/versions)")
        if key not in self.models:
            raise ApiError("model_not_found", f"no model named {key!r}; served: {', '.join(self.models) or 'none'}")
        return self.models[key]

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
        loop = asyncio.get_running_loop()
        raw_threshold = served.scorer.calibration.raw_threshold(0.5 if threshold is None else threshold)
        with self.places.admit(served.name, len(datas)) as admission:
            device = None if heatmap or mask else served.batcher.device
            decoded = await each(self.decoder.decoded(served.scorer, data, heatmap, device=device) for data in datas)
            admission.queued(len(decoded))
            scored = await self.scored(served, decoded, raw_threshold, heatmap or mask)
        if heatmap or mask:
            results = await asyncio.gather(
                *[
                    loop.run_in_executor(
                        self.decode, answer, served.name, served.scorer, image, one, threshold, heatmap, mask
                    )
                    for image, one in zip(decoded, scored, strict=True)
                ]
            )
        else:
            results = [
                answer(served.name, served.scorer, image, one, threshold, False, False)
                for image, one in zip(decoded, scored, strict=True)
            ]
        if monitor:
            served.monitor.record(
                [s.raw_score for s in scored], [s.input_distance for s in scored], threshold is not None
            )
        return scored, list(results), [image.picture for image in decoded]


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
