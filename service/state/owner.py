"""The service's state (:class:`ServiceState`): its parts wired together, readiness, and the score routes' surface."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from sqlalchemy.exc import SQLAlchemyError

from padim.models.errors import UsageError
from padim.models.repository import Repository, Version

from ..device.admission import LocalPlaces, Places
from ..device.batching import Scheduler, ScoredImage
from ..device.decoding import Decoder
from ..edge.errors import ApiError
from ..metrics import Metrics
from ..record.recorder import Recorder
from ..settings import ServiceSettings
from ..updates import LINE, UpdateJobs, line_changed
from .changes import RepositoryChanges
from .loading import Loader
from .recording import Recording
from .scoring import DeviceScoring
from .served import ServedModel, model_name
from .surface import ScoreSurface
from .versions import LoadedVersions


class ServiceState(ScoreSurface[ServedModel]):
    """The service's state: its parts, the device's scheduler, pools and readiness.

    The parts, each with one job: :attr:`versions` (what is loaded and which version serves),
    :attr:`loader` (a version loaded and warmed up), :attr:`scoring` (batches on the device, its failures),
    :attr:`changes` (the repository's changes and poll), :attr:`recording` (the inspection record). The score
    routes call :meth:`model`, :meth:`using`, :meth:`score_pictures`, :meth:`observe` and :meth:`keep`, which an
    API process's :class:`~padim.service.processes.api.ApiState` offers too.

    Args:
        settings: the service's.
        metrics: where it counts (a new registry by default).
        places: the queue bound's counts (one process's by default; shared by the processes of
            :mod:`padim.service.processes`).
    """

    def __init__(self, settings: ServiceSettings, metrics: Metrics | None = None, places: Places | None = None):
        self.settings = settings
        self.metrics = metrics = metrics or Metrics()
        self.places: Places = places or LocalPlaces(settings.max_queue)
        self.repository = Repository(settings.repository) if settings.repository is not None else None
        self.ready = False
        self.draining = False
        self.startup_error: str | None = None
        self.scheduler = Scheduler()  # the device's one thread: forms batches and scores them
        self.decoder = Decoder(
            settings.decode_workers, settings.pixel_budget(), settings.max_image_pixels, settings.heatmap_max_side
        )
        self.decode = self.decoder.pool
        # versions are loaded and warmed up on their own thread, beside scoring, so that a swap does not stall the line
        loading = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")
        self.versions = LoadedVersions(metrics, loading)
        self.scoring = DeviceScoring(
            metrics, self.versions, self.decoder, self.places, settings.max_device_errors, self._failed
        )
        self.loader = Loader(
            settings, self.repository, self.versions, self.scoring, self.scheduler, self.places, loading
        )
        self.changes = RepositoryChanges(
            self.repository,
            self.versions,
            self.loader,
            metrics,
            lambda: self.ready,
            settings.repository_poll_s,
            self._line_changed,
        )
        self.recording = Recording(
            settings, metrics, self.versions, self.loader, self.scoring, self.repository, self.decoder, self.scheduler
        )
        # model updates (POST /models/{name}/update): one thread, so one update runs at a time beside scoring
        self.updates = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-update")
        self.jobs = UpdateJobs(self)

    # ----------------------------------------------------------------- what the rest of the service reads
    @property
    def models(self) -> dict[str, ServedModel]:
        """The active version of each model."""
        return self.versions.models

    @property
    def retired(self) -> list[ServedModel]:
        """Replaced versions still answering the requests they admitted."""
        return self.versions.retired

    @property
    def default_name(self) -> str | None:
        return self.versions.default_name

    @property
    def record(self) -> Recorder | None:
        """The inspection record, when it is on and open."""
        return self.recording.record

    def _line_changed(self, version: Version) -> str | None:
        """Why a version whose threshold the line set is stale (:func:`~padim.service.updates.line_changed`); a
        service without its record cannot tell, and says so."""
        if (version.update or {}).get("kind") != LINE:
            return None
        if self.record is None:
            return "the inspection record is off, so what the line scored since the proposal cannot be read"
        assert self.repository is not None, "a version the line tightened is a repository's"
        settings = self.settings
        try:
            return line_changed(
                self.record.store, version, settings.monitor_level, settings.monitor_min_images, self.repository
            )
        except SQLAlchemyError as error:  # refused rather than activated unread; force=true still can
            return f"the record's database does not answer ({str(error).splitlines()[0][:200]})"

    @property
    def failure(self) -> str | None:
        """Why a ready service became unready for good (its GPU failed); ``None`` while it has not."""
        return self.scoring.failure

    def _failed(self) -> None:
        """The device was given up: the service turns unready for good."""
        self.ready = False

    # ----------------------------------------------------------------- lifecycle
    def open_record(self) -> None:
        """Start the inspection record when it is on."""
        self.recording.open()

    async def load(self) -> None:
        """Load every model (each one's active version, from a repository), warm it up, start its batcher; ready."""
        self.versions.loop = asyncio.get_running_loop()
        if self.repository is not None:
            names = self.repository.names()
            for name in names:
                number = self.repository.active(name)
                assert number is not None  # names() lists models with a version
                self.versions.install(name, await self.loader.prepare(self.repository.version(name, number)))
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
                kind = "export" if path.is_dir() else "model"
                self.versions.install(name, await self.loader.prepare(Version(name, 1, path, "", "", path.name, kind)))
        if names:
            self.versions.default_name = self.settings.default_model or names[0]
            if self.default_name not in self.models:
                raise UsageError(
                    f"default model {self.default_name!r} is not among the loaded ones: {', '.join(names)}"
                )
        self.ready = True

    async def close(self) -> None:
        self.ready = False
        self.versions.close()
        self.jobs.stopping.set()  # a running update writes no version now (its row says so at the next start)
        self.updates.shutdown(wait=True, cancel_futures=True)
        await asyncio.to_thread(self.recording.close)
        await asyncio.to_thread(self.scheduler.stop)
        self.loader.pool.shutdown(wait=True)
        self.decoder.shutdown()

    # ----------------------------------------------------------------- the score routes' surface
    def model(self, name: str | None) -> ServedModel:
        """The active version of ``name`` (the default model's for ``None``); 503 while not ready, 404 if none."""
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

    @contextmanager
    def using(self, served: ServedModel) -> Iterator[ServedModel]:
        """Hold ``served`` for one request: it is not closed before the request is answered."""
        with self.versions.using(served) as held:
            yield held

    async def score_pictures(
        self,
        served: ServedModel,
        datas: list[bytes],
        threshold: float | None,
        heatmap: bool,
        mask: bool,
        monitor: bool = True,
    ) -> tuple[ServedModel, list[ScoredImage], list[dict], list[tuple[int, int]]]:
        """Pictures decoded, scored by ``served`` (held by :meth:`using`, so always it, first in what this returns as
        in an API process's :meth:`~padim.service.processes.api.ApiState.score_pictures`) and answered:
        :meth:`DeviceScoring.score_pictures`."""
        scored, results, pictures = await self.scoring.score_pictures(served, datas, threshold, heatmap, mask, monitor)
        return served, scored, results, pictures

    def observe(self, model: ServedModel, results: list[dict], own_threshold: bool) -> None:
        """What one request was answered, into the verdict metrics."""
        self.recording.observe(model, results, own_threshold)

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
        """The answered pictures into the record: :meth:`Recording.keep`."""
        return self.recording.keep(model, datas, digests, fields, scored, results, pictures)
