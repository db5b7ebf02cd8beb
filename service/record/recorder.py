"""From scoring to the database without making scoring wait: the record's two writer threads.

1. **journal writer**: takes the rows scoring hands it (:meth:`Recorder.submit`, which never blocks), stores
   their pictures (once per content), and appends the rows to the journal in groups: one ``write`` and one
   ``fsync`` for every row that arrived meanwhile. A row is *durable* once that ``fsync`` returns; its future
   is then resolved (``PADIM_RECORD_REQUIRED`` waits for it).
2. **database writer**: reads the journal on from what the database has, inserts up to :data:`DB_BATCH` rows
   in one transaction (at most one every :data:`DB_INTERVAL_S` while rows trickle in: the rows are durable
   already, and each transaction costs CPU that scoring would otherwise have), and moves ``COMMITTED`` on. While the
   database is down or slow it retries with back-off; the rows wait in the journal (bounded:
   ``PADIM_RECORD_JOURNAL_MAX_BYTES``) and are replayed when it is back, and again after a restart. It also keeps
   the record within its bounds (:mod:`.upkeep`).

**What a kill -9 can lose**: rows handed to the journal writer and not yet fsynced: at most the rows of the
requests being answered at that moment (the journal writer's queue, bounded by :data:`QUEUE_ROWS`; it is
emptied every few milliseconds). Without ``PADIM_RECORD_REQUIRED`` those requests may already have their
answer; with it, no request is answered before its row is durable.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from .journal import Journal, JournalFull, waiting
from .pictures import PictureStore, sync_directories
from .store import RecordStore
from .upkeep import DB_BATCH, Upkeep

log = logging.getLogger("padim.record")

#: After a transaction of fewer than DB_BATCH rows, the database writer waits this long for more: a transaction
#: a row would cost about 3 ms of CPU each (SQLAlchemy and the commit), taken from scoring.
DB_INTERVAL_S = 1.0
#: Rows waiting for the journal writer; past this a row is refused at once (counted, or 503 when required).
QUEUE_ROWS = 10_000
#: Rows of one group commit at most.
GROUP_ROWS = 1000


@dataclass
class Entry:
    row: dict
    picture: bytes | None  # None: stored already (a re-score of the same content)
    future: concurrent.futures.Future


class Recorder:
    """The journal, the pictures and the database of one record, with the threads between them.

    Args:
        folder: the record's folder (``journal/``, ``pictures/``, and ``record.sqlite`` without a URL).
        store: the database.
        metrics: the service's :class:`~padim.service.metrics.Metrics` (or ``None``).
        replica: this replica's name when several share ``folder``: its journal is ``journal/NAME``, and the
            journals of replicas that stopped are adopted (:func:`~.journal.adopt`).
        upkeep: this recorder also keeps the record: marks the jobs a stopped process left, adopts stopped journals
            and evicts pictures. The API processes of a service (:mod:`padim.service.processes`) write their rows
            through recorders of their own without it; its scoring process keeps the record.
        siblings: the journals (names under ``journal/``) of the API processes beside this one, counted in
            :meth:`waiting_everywhere`.
    """

    def __init__(
        self,
        folder: Path,
        store: RecordStore,
        journal_max_bytes: int,
        max_bytes: int,
        retention_days: float,
        flagged_retention_days: float,
        metrics=None,
        replica: str | None = None,
        upkeep: bool = True,
        siblings: tuple[str, ...] = (),
    ):
        self.folder = Path(folder)
        self.siblings = siblings
        self.store = store
        self.journal = Journal(self.folder / "journal" / (replica or ""), journal_max_bytes)
        self.pictures = PictureStore(self.folder / "pictures")
        self.metrics = metrics
        self.upkeep = (  # None: another process keeps the record
            Upkeep(
                self.folder / "journal",
                self.journal.folder,
                store,
                self.pictures,
                max_bytes,
                retention_days,
                flagged_retention_days,
                metrics,
            )
            if upkeep
            else None
        )
        self.queue: queue.Queue[Entry] = queue.Queue(QUEUE_ROWS)
        self.database_up: bool | None = None
        self.waiting = self.journal.waiting_rows()  # rows in the journal the database does not have
        self.last_error: str | None = None
        self._stop = threading.Event()
        self.ready = threading.Event()  # the database's schema is up to date
        self._appended = threading.Event()
        self._lock = threading.Lock()
        self._pending = 0  # rows handed in and not yet journaled (or refused)
        self._threads = [
            threading.Thread(target=self._journal_loop, name="record-journal", daemon=True),
            threading.Thread(target=self._database_loop, name="record-database", daemon=True),
        ]
        self._show()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued to the journal, give the database a last chance, and stop."""
        self._stop.set()
        self._appended.set()
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(timeout)
        self.journal.close()
        self.store.close()

    # ---------------------------------------------------------------- scoring's side
    def submit(self, row: dict, picture: bytes) -> concurrent.futures.Future:
        """Hand a row (and its picture's bytes) to the journal writer; never blocks. The future is resolved once
        the row is durable, or fails with why it cannot be (:class:`JournalFull`, ``OSError``, ``queue.Full``)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            with self._lock:
                self._pending += 1
            self.queue.put_nowait(Entry(row, picture, future))
        except queue.Full:
            with self._lock:
                self._pending -= 1
            future.set_exception(
                JournalFull(f"{QUEUE_ROWS} rows are waiting for the journal writer: the disk is too slow for this load")
            )
            self._count("refused")
        return future

    # ---------------------------------------------------------------- the journal writer
    def _journal_loop(self) -> None:
        while True:
            try:
                first = self.queue.get(timeout=0.2)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            group = [first]
            while len(group) < GROUP_ROWS:
                try:
                    group.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write_group(group)
            except Exception as error:  # whatever it was, the writer goes on: these rows are refused, not lost
                self._failed([entry for entry in group if not entry.future.done()], error)
            finally:
                with self._lock:
                    self._pending -= len(group)

    def _write_group(self, group: list[Entry]) -> None:
        lines, folders, ok = [], [], []
        for entry in group:
            try:
                if entry.picture is not None:
                    written, folder = self.pictures.put(entry.row["sha256"], entry.picture)
                    if written:
                        folders.append(folder)
                entry.picture = None
                lines.append((json.dumps(entry.row, separators=(",", ":")) + "\n").encode())
                ok.append(entry)
            except OSError as error:
                self._failed([entry], error)
        if not ok:
            return
        # counted before the rows are in the journal: the database writer may read and subtract them as soon as they
        # are, and a count added after that would never come down
        with self._lock:
            self.waiting += len(ok)
        try:
            sync_directories(folders)
            self.journal.append(lines)
        except (JournalFull, OSError) as error:
            with self._lock:
                self.waiting = max(0, self.waiting - len(ok))
            self._failed(ok, error)
            return
        for entry in ok:
            entry.future.set_result(entry.row["id"])
        self._count("journaled", len(ok))
        self._show()
        self._appended.set()

    def _failed(self, entries: list[Entry], error: Exception) -> None:
        self.last_error = f"{type(error).__name__}: {error}"
        log.error("record: rows not journaled", extra={"rows": len(entries), "error": self.last_error})
        for entry in entries:
            entry.future.set_exception(error)
        self._count("refused", len(entries))

    # ---------------------------------------------------------------- the database writer
    def _database_loop(self) -> None:
        backoff = 0.5
        migrated = False
        while True:
            stopping = self._stop.is_set()
            try:
                if not migrated:  # a database down at start is waited for like one that goes away later
                    self.store.migrate()
                    if self.upkeep is not None:
                        self.store.jobs.interrupted_jobs()  # what a stopped process (or replica) left running
                    migrated = True
                    self.ready.set()
                rows, position = self.journal.read(self.journal.position, DB_BATCH)
                if rows:
                    self.store.insert(rows)
                    self.journal.commit(position)
                    with self._lock:
                        self.waiting = max(0, self.waiting - len(rows))
                    self._count("committed", len(rows))
                elif position != self.journal.position:  # a segment passed: remember it
                    self.journal.commit(position)
                self._up(True)
                backoff = 0.5
                if self.upkeep is not None:
                    self.upkeep.when_due()
                self._show()
                if len(rows) >= DB_BATCH:
                    continue
                if stopping and not rows:
                    return
                if rows:  # the rows are durable in the journal: let more gather for the next transaction
                    self._stop.wait(DB_INTERVAL_S)
                    continue
                self._appended.wait(0.5)
                self._appended.clear()
            except (SQLAlchemyError, OSError) as error:
                self._up(False, error)
                if stopping:
                    return
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _up(self, up: bool, error: Exception | None = None) -> None:
        if up and self.database_up is False:
            log.warning("record: the database is back; replaying the journal", extra={"rows": self.waiting})
        if not up and self.database_up is not False:
            log.error(
                "record: the database cannot be written; rows wait in the journal",
                extra={"error": str(error).splitlines()[0] if error else ""},
            )
        if not up:
            self.last_error = str(error).splitlines()[0] if error else None
        self.database_up = up
        if self.metrics is not None:
            self.metrics.record_database_up.set(1.0 if up else 0.0)

    # ---------------------------------------------------------------- metrics
    def _count(self, outcome: str, rows: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.record_rows.labels(outcome).inc(rows)

    def _show(self) -> None:
        if self.metrics is not None:
            self.metrics.record_rows_waiting.set(self.waiting)
            self.metrics.record_journal_bytes.set(self.journal.pending_bytes())

    def waiting_everywhere(self) -> tuple[int, int]:
        """Rows and bytes waiting for the database in this journal and its siblings'."""
        rows, size = self.waiting, self.journal.pending_bytes()
        for name in self.siblings:
            sibling = self.folder / "journal" / name
            if sibling.is_dir():
                more_rows, more_bytes = waiting(sibling)
                rows, size = rows + more_rows, size + more_bytes
        return rows, size

    def flushed(self, timeout: float = 30.0) -> bool:
        """Wait until every row handed in is in the database (tests, exports); ``False`` on time-out."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self._pending == 0 and self.waiting == 0:
                return True
            self._appended.set()
            time.sleep(0.05)
        return False
