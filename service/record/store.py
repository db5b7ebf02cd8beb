"""The record's database: rows, reviews and what stored pictures hold, for SQLite and PostgreSQL alike (its update
jobs: :mod:`padim.service.record.jobs`).

SQLite (the embedded default, ``record.sqlite`` in the record's folder) runs in WAL mode with
``synchronous=FULL``: a commit is on disk when it returns. PostgreSQL is reached by URL
(``postgresql+psycopg://...``; ``postgresql://`` is read as that). The schema is brought up to date at start
by Alembic (:func:`migrate`).
"""

from __future__ import annotations

import builtins  # `list` in the class is its method: the type is spelled builtins.list there
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy import Engine, and_, create_engine, event, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from padim.models.errors import RecordNotFound

from .jobs import JobStore
from .tables import metadata, new_id, pictures, records, reviews

MIGRATIONS = Path(__file__).parent / "migrations"
LABELS = ("normal", "defect")


def database_url(url: str | None, folder: Path | None) -> str:
    """The SQLAlchemy URL: ``url`` (PostgreSQL; ``postgresql://`` means psycopg 3), else SQLite in ``folder``."""
    if url:
        if url.startswith("postgresql://") or url.startswith("postgres://"):
            return "postgresql+psycopg://" + url.split("://", 1)[1]
        return url
    assert folder is not None
    return f"sqlite:///{Path(folder) / 'record.sqlite'}"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, pool_size=8)

        @event.listens_for(engine, "connect")
        def _pragmas(connection, _record) -> None:
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=8, connect_args={"connect_timeout": 5})


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the database's schema to ``revision`` (every migration from the first schema up)."""
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its INFO lines would bypass the service's JSON log
    # imported here: a service without a record never loads alembic (which logs as it is imported)
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext  # alembic's runtime, only for this question

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


@dataclass(frozen=True)
class Filters:
    """What ``GET /records`` and ``padim records export`` select."""

    model: str | None = None
    version: int | None = None
    verdict: str | None = None  # anomalous or normal
    label: str | None = None  # normal, defect, or none (not reviewed)
    since: float | None = None
    until: float | None = None
    part: str | None = None
    queue: bool = False  # waiting for review: flagged or sampled, not reviewed

    def where(self):
        clauses = []
        if self.model is not None:
            clauses.append(records.c.model == self.model)
        if self.version is not None:
            clauses.append(records.c.version == self.version)
        if self.verdict is not None:
            clauses.append(records.c.is_anomaly == (self.verdict == "anomalous"))
        if self.label == "none":
            clauses.append(records.c.label.is_(None))
        elif self.label is not None:
            clauses.append(records.c.label == self.label)
        if self.since is not None:
            clauses.append(records.c.time >= self.since)
        if self.until is not None:
            clauses.append(records.c.time < self.until)
        if self.part is not None:
            clauses.append(records.c.part == self.part)
        if self.queue:
            clauses.append(and_(records.c.label.is_(None), or_(records.c.is_anomaly, records.c.sampled)))
        return and_(*clauses) if clauses else None


class RecordStore:
    """The database of one record (every method is blocking: call it off the event loop)."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self.kind: Literal["sqlite", "postgresql"] = "sqlite" if url.startswith("sqlite") else "postgresql"
        self.jobs = JobStore(self.engine, self.kind)  # the update jobs' table

    def migrate(self) -> None:
        migrate(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def _insert(self, table):
        return (sqlite.insert if self.kind == "sqlite" else postgresql.insert)(table)

    # ---------------------------------------------------------------- rows
    def insert(self, rows: list[dict]) -> None:
        """Insert rows from the journal in one transaction; a row already there (a replay) is left as it is.
        What each picture holds is updated with them."""
        if not rows:
            return
        values = [
            {c.name: row.get(c.name) for c in records.columns if c.name not in ("label", "reviewed_at")} for row in rows
        ]
        seen: dict[str, dict] = {}
        for row in rows:
            entry = seen.setdefault(
                row["sha256"],
                {
                    "sha256": row["sha256"],
                    "bytes": row["picture_bytes"],
                    "first_seen": row["time"],
                    "last_seen": row["time"],
                    "flagged": False,
                    "pinned": False,
                    "evicted": None,
                },
            )
            entry["first_seen"] = min(entry["first_seen"], row["time"])
            entry["last_seen"] = max(entry["last_seen"], row["time"])
            entry["flagged"] = entry["flagged"] or bool(row["is_anomaly"])
        upsert = self._insert(pictures)
        greatest = func.max if self.kind == "sqlite" else func.greatest
        upsert = upsert.on_conflict_do_update(
            index_elements=["sha256"],
            set_={
                "last_seen": greatest(pictures.c.last_seen, upsert.excluded.last_seen),
                "flagged": or_(pictures.c.flagged, upsert.excluded.flagged),
                "evicted": None,  # stored again by the journal writer
            },
        )
        # executemany of statements compiled once (a VALUES list of every row would be compiled again each time)
        with self.engine.begin() as connection:
            connection.execute(self._insert(records).on_conflict_do_nothing(index_elements=["id"]), values)
            connection.execute(upsert, sorted(seen.values(), key=lambda e: e["sha256"]))

    def get(self, record_id: str) -> dict:
        with self.engine.connect() as connection:
            row = connection.execute(select(records).where(records.c.id == record_id)).mappings().first()
            if row is None:
                raise RecordNotFound(f"no record {record_id!r}")
            history = (
                connection.execute(select(reviews).where(reviews.c.record_id == record_id).order_by(reviews.c.id))
                .mappings()
                .all()
            )
            picture = connection.execute(
                select(pictures.c.evicted, pictures.c.pinned).where(pictures.c.sha256 == row["sha256"])
            ).first()
        return {
            **dict(row),
            "reviews": [dict(r) for r in history],
            "picture_kept": picture is not None and picture.evicted is None,
            "picture_pinned": bool(picture is not None and picture.pinned),
        }

    def list(self, filters: Filters, limit: int, before: str | None = None) -> list[dict]:
        """Newest first; ``before``: the cursor, an id (rows older than it)."""
        query = select(records)
        where = filters.where()
        if where is not None:
            query = query.where(where)
        if before is not None:
            query = query.where(records.c.id < before)
        query = query.order_by(records.c.id.desc()).limit(limit)
        with self.engine.connect() as connection:
            return [dict(r) for r in connection.execute(query).mappings().all()]

    def iterate(self, filters: Filters, batch: int = 1000) -> Iterable[dict]:
        """Every row ``filters`` selects, newest first, a batch at a time (exports)."""
        before = None
        while True:
            rows = self.list(filters, batch, before)
            yield from rows
            if len(rows) < batch:
                return
            before = rows[-1]["id"]

    def count(self, filters: Filters) -> int:
        query = select(func.count()).select_from(records)
        where = filters.where()
        if where is not None:
            query = query.where(where)
        with self.engine.connect() as connection:
            return int(connection.execute(query).scalar_one())

    # ---------------------------------------------------------------- reviews
    def review(
        self,
        record_id: str,
        label: str,
        defect_type: str | None,
        note: str | None,
        reviewer: str | None,
        now: float | None = None,
    ) -> dict:
        """Add a review (the audit trail keeps every one; the latest is the record's label) and pin the picture."""
        now = time.time() if now is None else now
        with self.engine.begin() as connection:
            row = connection.execute(select(records.c.sha256).where(records.c.id == record_id)).first()
            if row is None:
                raise RecordNotFound(
                    f"no record {record_id!r} (a row still in the journal reaches the database within seconds; retry)"
                )
            connection.execute(
                reviews.insert().values(
                    record_id=record_id, time=now, label=label, defect_type=defect_type, note=note, reviewer=reviewer
                )
            )
            connection.execute(update(records).where(records.c.id == record_id).values(label=label, reviewed_at=now))
            connection.execute(update(pictures).where(pictures.c.sha256 == row.sha256).values(pinned=True))
        return self.get(record_id)

    def pin(self, sha256s: Iterable[str]) -> None:
        with self.engine.begin() as connection:
            connection.execute(update(pictures).where(pictures.c.sha256.in_(list(sha256s))).values(pinned=True))

    def labelled(self, model: str, label: str) -> builtins.list[dict]:
        """The latest row of each picture of ``model`` whose latest review says ``label``, with a kept picture."""
        query = (
            select(records)
            .join(pictures, pictures.c.sha256 == records.c.sha256)
            .where(records.c.model == model, records.c.label == label, pictures.c.evicted.is_(None))
            .order_by(records.c.id)
        )
        with self.engine.connect() as connection:
            rows = [dict(r) for r in connection.execute(query).mappings().all()]
        latest: dict[str, dict] = {}
        for row in rows:
            latest[row["sha256"]] = row
        return list(latest.values())

    def rows(self, ids: builtins.list[str]) -> builtins.list[dict]:
        with self.engine.connect() as connection:
            found = {
                r["id"]: dict(r)
                for r in connection.execute(select(records).where(records.c.id.in_(ids))).mappings().all()
            }
        missing = [i for i in ids if i not in found]
        if missing:
            raise RecordNotFound(
                f"no record {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        return [found[i] for i in ids]

    # ---------------------------------------------------------------- pictures
    def storage(self) -> dict:
        """What the stored pictures hold: in all, pinned (never evicted), flagged and passed, and evicted."""
        kept = pictures.c.evicted.is_(None)
        with self.engine.connect() as connection:

            def total(*where):
                return connection.execute(
                    select(func.count(), func.coalesce(func.sum(pictures.c.bytes), 0)).where(*where)
                ).one()

            every = total(kept)
            pinned = total(kept, pictures.c.pinned)
            flagged = total(kept, ~pictures.c.pinned, pictures.c.flagged)
            passed = total(kept, ~pictures.c.pinned, ~pictures.c.flagged)
            evicted = connection.execute(select(func.count()).where(~kept)).scalar_one()
        return {
            "pictures": int(every[0]),
            "bytes": int(every[1]),
            "pinned_pictures": int(pinned[0]),
            "pinned_bytes": int(pinned[1]),
            "flagged_pictures": int(flagged[0]),
            "flagged_bytes": int(flagged[1]),
            "passed_pictures": int(passed[0]),
            "passed_bytes": int(passed[1]),
            "evicted_pictures": int(evicted),
        }

    def evictable(
        self, max_bytes: int, passed_before: float, flagged_before: float, spare_after: float, limit: int = 1000
    ) -> builtins.list[tuple[str, int]]:
        """Pictures to evict, in order: past their retention, then (while the kept bytes are over ``max_bytes``)
        passed ones oldest first, then flagged ones oldest first; never pinned ones, nor any seen after
        ``spare_after`` (being stored again). ``(sha256, bytes)``."""
        kept = and_(pictures.c.evicted.is_(None), ~pictures.c.pinned, pictures.c.last_seen < spare_after)
        with self.engine.connect() as connection:
            expired = connection.execute(
                select(pictures.c.sha256, pictures.c.bytes)
                .where(
                    kept,
                    or_(
                        and_(~pictures.c.flagged, pictures.c.last_seen < passed_before),
                        and_(pictures.c.flagged, pictures.c.last_seen < flagged_before),
                    ),
                )
                .limit(limit)
            ).all()
            held = connection.execute(
                select(func.coalesce(func.sum(pictures.c.bytes), 0)).where(pictures.c.evicted.is_(None))
            ).scalar_one()
            over = int(held) - sum(b for _, b in expired) - max_bytes
            chosen = [(s, int(b)) for s, b in expired]
            if over > 0:
                taken = {s for s, _ in chosen}
                candidates = connection.execute(
                    select(pictures.c.sha256, pictures.c.bytes)
                    .where(kept)
                    .order_by(pictures.c.flagged, pictures.c.last_seen)
                    .limit(limit)
                ).all()
                for sha256, size in candidates:
                    if over <= 0:
                        break
                    if sha256 in taken:
                        continue
                    chosen.append((sha256, int(size)))
                    over -= int(size)
        return chosen

    def evicted(self, sha256s: builtins.list[str], now: float | None = None) -> None:
        with self.engine.begin() as connection:
            connection.execute(
                update(pictures)
                .where(pictures.c.sha256.in_(sha256s), ~pictures.c.pinned)
                .values(evicted=time.time() if now is None else now)
            )


__all__ = ["LABELS", "Filters", "RecordStore", "current_revision", "database_url", "metadata", "migrate", "new_id"]
