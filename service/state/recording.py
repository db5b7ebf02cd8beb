"""The service's side of the inspection record (:class:`Recording`): the record opened, each answer counted and
kept, and a recorded picture's heat map drawn again by the version that scored it."""

from __future__ import annotations

import asyncio
import logging

from padim.core.calibration import named_threshold
from padim.models.errors import RecordGone, UsageError, VersionNotFound
from padim.models.features.embedding import TRACING
from padim.models.repository import Repository
from padim.models.scorer import Scorer

from ..device.answers import answer, count_verdicts, keep_rows
from ..device.batching import Item, Scheduler, ScoredImage, score_items
from ..device.decoding import Decoder
from ..metrics import Metrics
from ..record.recorder import Recorder
from ..record.store import RecordStore, database_url
from ..settings import ServiceSettings
from .loading import Loader
from .scoring import DeviceScoring
from .served import ServedModel
from .versions import LoadedVersions

log = logging.getLogger("padim.service")


class Recording:
    """The record (``PADIM_RECORD_DIR`` / ``PADIM_RECORD_URL``) as the service writes and reads it.

    Args:
        settings: the service's (where the record is, what it keeps, how much is sampled for review).
        metrics: where verdicts and the record's own figures are counted.
        versions: the loaded versions (a heat map is drawn by the one that scored the picture, when loaded).
        loader: loads a version that is no longer served, to draw its heat maps.
        scoring: scores a recorded picture on a served version.
        repository: where a version no longer served is read from (``None``: a fixed set of models).
        decoder: decodes the recorded picture and draws its heat map.
        scheduler: the device's thread, on which a version not served scores between two batches.
    """

    def __init__(
        self,
        settings: ServiceSettings,
        metrics: Metrics,
        versions: LoadedVersions,
        loader: Loader,
        scoring: DeviceScoring,
        repository: Repository | None,
        decoder: Decoder,
        scheduler: Scheduler,
    ):
        self.settings, self.metrics, self.versions, self.loader = settings, metrics, versions, loader
        self.scoring, self.repository, self.decoder, self.scheduler = scoring, repository, decoder, scheduler
        self.record: Recorder | None = None
        self.siblings: tuple[str, ...] = ()  # the API processes' journals, in a service of several processes
        self.aside: dict[tuple[str, int], Scorer] = {}  # a version that is not served, loaded to draw a heat map

    def open(self) -> None:
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
            siblings=self.siblings,
        )
        self.record.start()
        log.info(
            "inspection record on",
            extra={"folder": str(folder), "database": store.kind, "required": settings.record_required},
        )

    def close(self) -> None:
        if self.record is not None:
            self.record.close()

    def observe(self, model: ServedModel, results: list[dict], own_threshold: bool) -> None:
        """What one request was answered, into the verdict metrics (its scores went to the monitor as they were
        scored: :meth:`DeviceScoring.score_pictures`)."""
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
        assert self.record is not None, "kept only while the record is on"
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
        loaded = self.versions.find(name, version)
        if loaded is not None:
            with self.versions.using(loaded) as served:
                return await self._draw(served, data, threshold)
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
        scorer = self.aside.get(key)
        if scorer is None:
            scorer = await self.loader.load_aside(path)
            self.aside = {key: scorer}  # one at a time: the last asked for
        # no batcher nor monitor: it draws one heat map, off the scheduler
        aside = ServedModel(name, path, "", scorer, None, 0.0, None, version=version)  # type: ignore[arg-type]
        return await self._draw(aside, data, threshold, served=False)

    async def _draw(self, model: ServedModel, data: bytes, threshold: float, served: bool = True) -> dict:
        loop = asyncio.get_running_loop()
        pool = self.decoder.pool
        own = named_threshold(threshold)
        decoded = await loop.run_in_executor(pool, self.decoder.decode, model.scorer, data, True)
        raw_threshold = model.scorer.calibration.raw_threshold(own)
        if served:
            (scored,) = await self.scoring.scored(model, [decoded], raw_threshold, True)
        else:  # not served: scored on the device's thread between two batches, by its own scorer
            item = Item(decoded.tensor, raw_threshold, True, lambda result: None)

            def draw():
                with TRACING.shared():  # as a served batch: not while a backbone is traced (a load, an update)
                    return score_items(model.score_batch, [item])[0]

            scored = await asyncio.wrap_future(self.scheduler.call(draw))
        return await loop.run_in_executor(pool, answer, model.name, model.scorer, decoded, scored, own, True, False)
