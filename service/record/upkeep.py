"""Keeping a record within its bounds (:class:`Upkeep`): the journals of replicas that stopped are adopted into the
database, and pictures past their retention or the record's byte budget are evicted (their rows stay)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from .journal import adopt, adoptable
from .pictures import PictureStore
from .store import RecordStore

log = logging.getLogger("padim.record")

#: Rows inserted in one database transaction (an adopted journal's too).
DB_BATCH = 500
#: Seconds between evictions (and after a start).
EVICT_EVERY_S = 30.0
#: A picture stored again (scored again) within this many seconds is not evicted meanwhile.
SPARE_RECENT_S = 600.0
DAY = 86400.0


class Upkeep:
    """The record's upkeep, run by the database writer of the process that keeps the record.

    Args:
        journals: the record's ``journal/`` folder; ``own``: this process's journal in it (not adopted).
        store, pictures: the record's database and pictures.
        max_bytes, retention_days, flagged_retention_days: the budget and the retentions.
        metrics: the service's :class:`~padim.service.metrics.Metrics` (or ``None``).
    """

    def __init__(
        self,
        journals: Path,
        own: Path,
        store: RecordStore,
        pictures: PictureStore,
        max_bytes: int,
        retention_days: float,
        flagged_retention_days: float,
        metrics=None,
    ):
        self.journals, self.own, self.store, self.pictures, self.metrics = journals, own, store, pictures, metrics
        self.max_bytes, self.retention_days, self.flagged_retention_days = (
            max_bytes,
            retention_days,
            flagged_retention_days,
        )
        self._next = 0.0

    def when_due(self) -> None:
        """Adopt and evict, at most every :data:`EVICT_EVERY_S`."""
        now = time.time()
        if now < self._next:
            return
        self._next = now + EVICT_EVERY_S
        self.adopt()
        self.evict(now)

    def adopt(self) -> int:
        """Send the rows of stopped replicas' journals to the database; returns how many."""
        total = 0
        for folder in adoptable(self.journals, self.own):
            adopted = adopt(folder, self.store.insert, DB_BATCH)
            if adopted is not None:
                total += adopted
                log.warning(
                    "record: a stopped replica's journal adopted", extra={"journal": folder.name, "rows": adopted}
                )
                if self.metrics is not None:
                    self.metrics.record_rows.labels("adopted").inc(adopted)
        return total

    def evict(self, now: float | None = None) -> int:
        """Remove pictures past their retention, then past the budget (passed ones first); rows stay. Returns
        the pictures removed."""
        now = time.time() if now is None else now
        removed = 0
        while True:
            chosen = self.store.evictable(
                self.max_bytes,
                now - self.retention_days * DAY,
                now - self.flagged_retention_days * DAY,
                now - SPARE_RECENT_S,
            )
            if not chosen:
                break
            for sha256, _ in chosen:
                self.pictures.remove(sha256)
            self.store.evicted([s for s, _ in chosen], now)
            removed += len(chosen)
            if len(chosen) < 1000:
                break
        if removed:
            log.info("record: pictures evicted", extra={"pictures": removed})
            if self.metrics is not None:
                self.metrics.record_evicted.inc(removed)
        if self.metrics is not None:
            report = self.store.storage()
            for kind in ("pinned", "flagged", "passed"):
                self.metrics.record_picture_bytes.labels(kind).set(report[f"{kind}_bytes"])
        return removed
