"""A version made ready to serve (:class:`Loader`): its memory checked, loaded and warmed up on the loader thread
beside what is served, and bound to a batcher of its own."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from padim.core.artifact import file_sha256
from padim.core.errors import ArtifactError
from padim.models.deploy.runtimes import DeployedDetector, load_scorer
from padim.models.errors import ExportError, InsufficientMemory, UsageError
from padim.models.fit.model_file import served_bytes
from padim.models.repository import Repository, Version
from padim.models.scorer import Scorer

from ..device.admission import Places
from ..device.batching import Batcher, Scheduler
from ..device.device_decoding import DeviceDecode
from ..monitor import Monitor
from ..settings import ServiceSettings
from .scoring import DeviceScoring
from .served import ServedModel, model_name, release_device_memory
from .versions import LoadedVersions

log = logging.getLogger("padim.service")

#: A version is loaded only where free memory holds this many times the bytes it will hold (its tensors, the
#: runtime's copy while it loads, the warm-up batch's activations).
LOAD_MEMORY_FACTOR = 1.5


class Loader:
    """Loads versions, one at a time on its own thread (``pool``), so that a swap does not stall the line.

    Args:
        settings: the service's (runtime, device, batch sizes, CUDA graphs, the monitor's window).
        repository: where versions are read from, when the service serves one (its compiled-runtime cache).
        versions: the loaded versions (serials; how many are loaded, for the memory check's message).
        scoring: scores each version's batches on the device.
        scheduler: the device's one thread, which every batcher sends its batches to.
        places: the queue bound's counts (a batcher waits for pictures still arriving).
        pool: the loader's one thread.
    """

    def __init__(
        self,
        settings: ServiceSettings,
        repository: Repository | None,
        versions: LoadedVersions,
        scoring: DeviceScoring,
        scheduler: Scheduler,
        places: Places,
        pool: ThreadPoolExecutor,
    ):
        self.settings, self.repository, self.versions, self.scoring = settings, repository, versions, scoring
        self.scheduler, self.places, self.pool = scheduler, places, pool

    async def prepare(self, version: Version) -> ServedModel:
        """Load and warm up ``version`` on the loader thread, beside what is served; nothing is sent to it yet."""
        self.check_memory(version.path)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        cache = self.repository.cache_root(version.name) if self.repository is not None else None
        scorer, sha256 = await loop.run_in_executor(self.pool, self.load_one, version.path, cache)
        seconds = time.perf_counter() - started
        settings = self.settings
        served = ServedModel(
            version.name,
            version.path,
            version.sha256 or sha256,
            scorer,
            None,  # type: ignore[arg-type]  # made next: it is bound to this version
            seconds,
            Monitor(scorer.calibration, settings.monitor_window, settings.monitor_level, settings.monitor_min_images),
            version=version.version,
            serial=self.versions.next_serial(),
        )
        served.batcher = self._batcher(served)
        return served

    def _batcher(self, served: ServedModel) -> Batcher:
        """``served``'s own batcher, bound to it (never looked up by name), at the batch sizes its device takes."""
        name, scorer = served.name, served.scorer
        largest, preferred = self.settings.picture_batches(scorer.device.type, scorer.config.tile_count)
        return Batcher(
            self.scheduler,
            score_batch=functools.partial(self.scoring.score, served),
            max_batch_size=largest,
            preferred_batch_size=preferred,
            max_delay=self.settings.max_delay_ms / 1000,
            arriving=lambda: self.places.arriving(name),
            on_batch=lambda size, waits: self.scoring.record_batch(name, size, waits),
            name=name,
            device=self.device_decode(scorer),
            target=scorer.device,
        )

    def device_decode(self, scorer: Scorer) -> DeviceDecode | None:
        """Whether ``scorer``'s device decodes its JPEGs (``PADIM_DEVICE_DECODE``: auto on CUDA, on, off)."""
        mode = self.settings.device_decode
        if mode == "off" or (mode == "auto" and scorer.device.type != "cuda"):
            return None
        return DeviceDecode(scorer.device, scorer.framing)

    def check_memory(self, path: Path) -> None:
        """Refuse a load that would not fit beside what is loaded (the model's size against free memory)."""
        need = _size_on_disk(path)
        free, where = available_memory(self.settings.device)
        if free is not None and need * LOAD_MEMORY_FACTOR > free:
            raise InsufficientMemory(
                f"loading {path.name} needs about {need * LOAD_MEMORY_FACTOR / 2**20:,.0f} MiB and {where} has "
                f"{free / 2**20:,.0f} MiB free beside the {len(self.versions.all())} version(s) loaded; "
                "unload a model (DELETE /models/{name}) or wait for a retired version to drain"
            )

    def load_one(self, path: Path, cache: Path | None = None) -> tuple[Scorer, str]:
        """On the loader thread: the scorer of ``path``, warmed up at the largest batch (CUDA graphs captured where
        asked), and the sha256 it is known by."""
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
                "lower PADIM_MAX_BATCH_SIZE (or PADIM_PREFERRED_BATCH_SIZE), or serve fewer models per GPU"
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

    async def load_aside(self, path: Path) -> Scorer:
        """``path``'s torch scorer, not served (a recorded picture's heat map from a version no longer loaded)."""
        self.check_memory(path)
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, load_scorer, path, "torch", self.settings.device
        )


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
