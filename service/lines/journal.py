"""A line's journal: one verdict per picture across restarts, and each sink's outbox (SQLite, WAL, fsync).

Scoring and journaling cannot be one atomic step, so a picture may be scored twice (a crash after scoring and
before the commit); the journal is what makes it count once. A picture's **key** is its source (the file's path in
the folder, or the stream and frame number) and its content's sha256. :meth:`LineJournal.add` stores the verdict
and puts one message in each sink's outbox **in one transaction**: a verdict is in every outbox or in none, and a
key that is in the journal is never given a second verdict. Delivery is then at-least-once: a message leaves its
outbox only once its sink confirmed it, and carries the key as its idempotency id, so a consumer drops repeats.

``synchronous=FULL``: a commit returns once it is on disk, so a kill -9 (or a power cut) after it loses nothing.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
create table if not exists pictures (
    key text primary key,
    message text not null,         -- the verdict as delivered (JSON)
    row text,                      -- the record's row (JSON), when the record is on
    created real not null,
    recorded integer not null default 0
);
create table if not exists outbox (
    id integer primary key autoincrement,
    sink text not null,
    key text not null,
    message text not null,
    created real not null,
    attempts integer not null default 0,
    next_try real not null default 0,
    unique (sink, key)
);
create index if not exists outbox_due on outbox (sink, next_try, id);
"""


class OutboxFull(Exception):
    """A sink's outbox is at its bound and the line's policy is ``block``."""


@dataclass(frozen=True)
class Entry:
    key: str
    message: dict
    row: dict | None
    recorded: bool


@dataclass(frozen=True)
class Pending:
    id: int
    key: str
    message: dict
    attempts: int


class LineJournal:
    """The journal and outboxes of one line; safe to call from several threads (one connection, one lock)."""

    def __init__(self, path: Path, sinks: list[str], max_messages: int, when_full: str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks, self.max_messages, self.when_full = list(sinks), max_messages, when_full
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("pragma journal_mode=wal")
        self._db.execute("pragma synchronous=full")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()
        self.dropped = dict.fromkeys(self.sinks, 0)
        found = dict(self._db.execute("select sink, count(*) from outbox group by sink").fetchall())
        self._depths = {sink: int(found.get(sink, 0)) for sink in self.sinks}  # kept as messages come and go

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def get(self, key: str) -> Entry | None:
        with self._lock:
            found = self._db.execute("select message, row, recorded from pictures where key = ?", (key,)).fetchone()
        if found is None:
            return None
        return Entry(key, json.loads(found[0]), json.loads(found[1]) if found[1] else None, bool(found[2]))

    def room(self) -> bool:
        """Whether every outbox can take one more message (always, under ``drop_oldest``)."""
        if self.when_full != "block":
            return True
        return all(depth < self.max_messages for depth in self.depths().values())

    def add(self, key: str, message: dict, row: dict | None) -> Entry:
        """Journal a picture's verdict and queue it for every sink, atomically; the entry already there if the key
        was journaled before (by a run that crashed before the picture was finished).

        Raises:
            OutboxFull: under ``block``, an outbox has no room (nothing is written).
        """
        now = time.time()
        text = json.dumps(message)
        with self._lock:
            known = self._db.execute("select 1 from pictures where key = ?", (key,)).fetchone() is not None
            if not known:
                self._db.execute("begin immediate")
                try:
                    depths = dict(self._depths)
                    for sink in self.sinks:
                        depths[sink] = self._make_room(sink, depths[sink]) + 1
                        self._db.execute(
                            "insert into outbox (sink, key, message, created) values (?, ?, ?, ?)",
                            (sink, key, text, now),
                        )
                    self._db.execute(
                        "insert into pictures (key, message, row, created) values (?, ?, ?, ?)",
                        (key, text, json.dumps(row) if row is not None else None, now),
                    )
                    self._db.execute("commit")
                    self._depths = depths
                except BaseException:
                    if self._db.in_transaction:  # a commit that failed on a full disk has rolled back already
                        self._db.execute("rollback")
                    raise
        if not known:
            return Entry(key, message, row, recorded=False)
        entry = self.get(key)
        assert entry is not None
        return entry

    def _make_room(self, sink: str, depth: int) -> int:
        """Under ``drop_oldest``, delete what a full outbox must lose for one more; the depth left."""
        if depth < self.max_messages:
            return depth
        if self.when_full == "block":
            raise OutboxFull(f"the {sink} outbox holds {depth} verdicts (outbox.max_messages)")
        over = depth - self.max_messages + 1
        self._db.execute(
            "delete from outbox where id in (select id from outbox where sink = ? order by id limit ?)", (sink, over)
        )
        self.dropped[sink] += over
        return depth - over

    def recorded(self, key: str) -> None:
        with self._lock:
            self._db.execute("update pictures set recorded = 1 where key = ?", (key,))

    # ------------------------------------------------------------------ outboxes
    def due(self, sink: str, limit: int, now: float | None = None) -> list[Pending]:
        now = time.time() if now is None else now
        with self._lock:
            found = self._db.execute(
                "select id, key, message, attempts from outbox where sink = ? and next_try <= ? order by id limit ?",
                (sink, now, limit),
            ).fetchall()
        return [Pending(i, k, json.loads(m), a) for i, k, m, a in found]

    def delivered(self, sink: str, ids: list[int]) -> None:
        if not ids:
            return
        with self._lock:
            gone = self._db.execute(f"delete from outbox where id in ({','.join('?' * len(ids))})", ids).rowcount
            self._depths[sink] -= gone

    def failed(self, ids: list[int], delay_s: float) -> None:
        if not ids:
            return
        with self._lock:
            self._db.execute(
                f"update outbox set attempts = attempts + 1, next_try = ? where id in ({','.join('?' * len(ids))})",
                [time.time() + delay_s, *ids],
            )

    def depths(self) -> dict[str, int]:
        with self._lock:
            return dict(self._depths)

    def oldest(self) -> dict[str, float | None]:
        """Each outbox's oldest message's age in seconds (``None`` when empty)."""
        now = time.time()
        with self._lock:
            found = dict(self._db.execute("select sink, min(created) from outbox group by sink").fetchall())
        return {sink: (now - found[sink]) if found.get(sink) is not None else None for sink in self.sinks}
