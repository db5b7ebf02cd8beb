"""Changes of what a service serves from its repository (:class:`RepositoryChanges`): a version added, activated,
rolled back, removed, a model unloaded (the admin routes), and the poll that serves what the repository says."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from padim.core.errors import ArtifactError
from padim.models.errors import (
    DefaultModel,
    ExportError,
    InsufficientMemory,
    ModelBusy,
    ReadOnlyModels,
    UnservableModel,
    UpdateGateFailed,
    UsageError,
    VersionActive,
    VersionNotFound,
    WeightsError,
)
from padim.models.repository import Repository, Version, check_model, model_path_in, utc_now

from ..edge.errors import ApiError
from ..metrics import Metrics
from ..updates import activation_refused
from .loading import Loader
from .versions import LoadedVersions, collect

log = logging.getLogger("padim.service")


class RepositoryChanges:
    """One change of a model at a time, each loaded beside the active version and swapped in at once.

    Args:
        repository: the served repository; ``None`` for a fixed set of models, which cannot change.
        versions: the loaded versions.
        loader: loads a version beside what is served.
        metrics: where changes are counted.
        ready: whether the service has loaded its models (changes wait until it has).
        poll_s: seconds between two reads of the repository (``PADIM_REPOSITORY_POLL_S``).
        line_changed: why a version whose threshold the line set is stale now, or ``None`` (blocking; read before
            such a version is activated).
    """

    def __init__(
        self,
        repository: Repository | None,
        versions: LoadedVersions,
        loader: Loader,
        metrics: Metrics,
        ready: Callable[[], bool],
        poll_s: float | None,
        line_changed: Callable[[Version], str | None] = lambda version: None,
    ):
        self.repository, self.versions, self.loader, self.metrics = repository, versions, loader, metrics
        self.ready, self.poll_s, self.line_changed = ready, poll_s, line_changed
        self._changing: dict[str, asyncio.Lock] = {}

    def writable(self) -> Repository:
        """The repository; a fixed set of models (PADIM_MODELS / PADIM_MODEL_DIR) has none to change."""
        if self.repository is None:
            raise ReadOnlyModels(
                "the models are served from PADIM_MODELS / PADIM_MODEL_DIR, a fixed set; serve a "
                "repository (PADIM_REPOSITORY, padim serve --repository DIR) to change them while "
                "the service runs"
            )
        if not self.ready():
            raise ApiError("not_ready", "models are still loading; retry shortly", headers={"Retry-After": "2"})
        return self.repository

    def versions_of(self, name: str) -> list[dict]:
        """Every version of ``name``, the active one marked, with its calibration summary."""
        served = self.versions.models.get(name)
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
            calibration = served.scorer.describe()["calibration"]
            return [{**fixed.to_dict(), "active": True, "loaded": True, "calibration": calibration}]
        listed = self.repository.versions(name)
        if not listed:
            raise VersionNotFound(f"the repository has no model named {name!r}")
        loaded = {m.version for m in self.versions.all() if m.name == name}
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
    async def changing(self, name: str, wait: bool = False) -> AsyncIterator[None]:
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
                served = await self.loader.prepare(Version(name, 0, path, sha256, "", "upload", kind))
            except (ArtifactError, ExportError, WeightsError, UsageError) as error:
                if isinstance(error, InsufficientMemory):
                    raise
                raise _unservable(error, path) from None
            committed = await asyncio.to_thread(repository.commit, name, incoming, sha256, "upload")
            served.version, served.path = committed.version, committed.path
            if activate:
                await asyncio.to_thread(repository.activate, name, committed.version)
                self.versions.install(name, served, "activate")
            else:
                await asyncio.get_running_loop().run_in_executor(self.loader.pool, collect)  # the check's copy
            self.metrics.model_changes.labels(name, "upload").inc()
        return {**committed.to_dict(), "active": activate}

    async def activate(self, name: str, number: int, rollback: bool = False, force: bool = False) -> dict:
        """Load version ``number`` beside the active one, point the repository at it, then swap.

        With ``rollback``, the version is the one active before the current (409 when none). A version made by an
        update whose gate failed is refused (409 update_gate_failed), and one whose threshold the line set while
        the line has changed since (409 line_changed), unless ``force``, which its ``version.json`` then keeps."""
        repository = self.writable()
        async with self.changing(name):
            if rollback:
                number = repository.previous(name)
            version = repository.version(name, number)
            if not rollback:
                await self._past_gate(repository, version, force)
            current = self.versions.models.get(name)
            if current is not None and current.version == number:
                await asyncio.to_thread(repository.activate, name, number)  # served already: the pointer only
            else:
                served = await self.loader.prepare(version)
                if rollback:
                    await asyncio.to_thread(repository.rollback, name)
                else:
                    await asyncio.to_thread(repository.activate, name, number)
                self.versions.install(name, served, "rollback" if rollback else "activate")
        return {**version.to_dict(), "active": True}

    async def _past_gate(self, repository: Repository, version: Version, force: bool) -> None:
        """Refuse a version whose update's gate failed, or whose line threshold the line has moved away from (409),
        unless ``force``, which its ``version.json`` keeps."""
        stale = await asyncio.to_thread(self.line_changed, version)
        refused = activation_refused(version, stale)
        if refused is None:
            return
        if not force:
            raise refused
        name, number = version.name, version.version
        gate = (version.update or {}).get("gate") or {}
        why = gate.get("why") if isinstance(refused, UpdateGateFailed) else stale
        await asyncio.to_thread(repository.note_forced, name, number, {"time": utc_now(), "gate": why})
        log.warning("version activated past its gate", extra={"model": name, "version": number})

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` (its files stay); the default model cannot be unloaded."""
        self.writable()
        async with self.changing(name):
            if name not in self.versions.models:
                raise VersionNotFound(f"no model named {name!r} is loaded")
            if name == self.versions.default_name:
                raise DefaultModel(
                    f"{name!r} is the default model; start the service with another PADIM_DEFAULT_MODEL to unload it"
                )
            self.versions.take_off(name)
            self.metrics.model_changes.labels(name, "unload").inc()

    async def remove(self, name: str, number: int) -> None:
        """Delete version ``number`` of ``name`` from the repository; the one being served cannot be."""
        repository = self.writable()
        async with self.changing(name):
            served = self.versions.models.get(name)
            if served is not None and served.version == number:
                raise VersionActive(
                    f"version {number} of {name!r} is being served; activate another (or roll back) first"
                )
            await asyncio.to_thread(repository.remove, name, number)

    async def poll(self) -> None:
        """Serve what the repository says is active (a version or model copied in, ``ACTIVE`` edited by hand)."""
        repository = self.repository
        assert repository is not None, "polled only with PADIM_REPOSITORY"
        assert self.poll_s is not None, "polled only with PADIM_REPOSITORY_POLL_S"
        failed: set[tuple[str, int]] = set()
        while True:
            await asyncio.sleep(self.poll_s)
            if not self.ready():
                continue
            for name in await asyncio.to_thread(repository.names):
                number = repository.active(name)
                served = self.versions.models.get(name)
                if (
                    number is None
                    or name in self.versions.unloaded
                    or (served is not None and served.version == number)
                    or (name, number) in failed
                ):
                    continue
                try:
                    async with self.changing(name):
                        served = await self.loader.prepare(repository.version(name, number))
                        self.versions.install(name, served, "activate")
                except ModelBusy:  # an admin route is changing it: read it again at the next poll
                    continue
                except Exception as error:  # a bad copy is reported once, and the active version keeps serving
                    failed.add((name, number))
                    log.error(
                        "repository poll: version not served",
                        extra={"model": name, "version": number, "error": str(error)},
                    )


def _unservable(error: Exception, path: Path) -> UnservableModel:
    """An uploaded model that cannot be served, said without the server's path to it."""
    message = str(error).replace(str(path), "the uploaded file")
    return UnservableModel(
        message if isinstance(error, UnservableModel) else f"the model cannot be served here: {message}"
    )
