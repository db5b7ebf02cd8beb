"""The record's update jobs (:class:`JobStore`): a job's row, its progress, and the right to run an update of a
model across every replica writing the database (:meth:`JobStore.claim_updates`)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from typing import Literal

from sqlalchemy import Engine, select, text, update

from padim.models.errors import RecordNotFound

from .tables import jobs, new_id

#: Jobs not finished: a running process's, or one a stopped process left.
UNFINISHED = jobs.c.state.in_(("queued", "running"))


class JobStore:
    """The ``jobs`` table of one record's database (every method is blocking: call it off the event loop)."""

    def __init__(self, engine: Engine, kind: Literal["sqlite", "postgresql"]):
        self.engine, self.kind = engine, kind

    def add_job(self, model: str, base_version: int, request: dict) -> dict:
        job = {
            "id": new_id(),
            "model": model,
            "base_version": base_version,
            "state": "queued",
            "phase": "queued",
            "progress": 0.0,
            "created": time.time(),
            "started": None,
            "finished": None,
            "request": request,
            "result": None,
            "error": None,
        }
        with self.engine.begin() as connection:
            connection.execute(jobs.insert().values(**job))
        return job

    def set_job(self, job_id: str, **values) -> None:
        if "progress" in values and not math.isfinite(values["progress"]):
            values["progress"] = 0.0
        with self.engine.begin() as connection:
            connection.execute(update(jobs).where(jobs.c.id == job_id).values(**values))

    def job(self, job_id: str) -> dict:
        with self.engine.connect() as connection:
            row = connection.execute(select(jobs).where(jobs.c.id == job_id)).mappings().first()
        if row is None:
            raise RecordNotFound(f"no job {job_id!r}")
        return dict(row)

    def claim_updates(self, model: str) -> UpdateClaim | None:
        """The right to run an update of ``model``, across every replica writing this database; ``None`` when
        another replica holds it.

        On PostgreSQL a session-level advisory lock, held on a connection of its own for the job's length: the
        server lets go of it when that connection closes, so a replica that dies (kill -9, a node lost) frees it
        at once. Whoever wins it marks the jobs of ``model`` still queued or running as failed: their replica
        stopped. SQLite is one process's (jobs keep their own count there, and :meth:`interrupted_jobs` runs at
        start): a claim always succeeds.
        """
        if self.kind == "sqlite":
            return UpdateClaim(None)
        key = int.from_bytes(hashlib.sha256(f"padim update {model}".encode()).digest()[:8], "big", signed=True)
        connection = self.engine.connect()
        try:
            won = connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}).scalar()
            connection.commit()
            if not won:
                connection.close()
                return None
            self._fail_jobs(
                "its replica stopped before the update finished; no version was written", jobs.c.model == model
            )
        except BaseException:
            connection.close()
            raise
        return UpdateClaim(connection)

    def running_job(self, model: str) -> dict | None:
        """The latest job of ``model`` still queued or running."""
        with self.engine.connect() as connection:
            row = (
                connection.execute(
                    select(jobs).where(jobs.c.model == model, UNFINISHED).order_by(jobs.c.created.desc())
                )
                .mappings()
                .first()
            )
        return dict(row) if row is not None else None

    def interrupted_jobs(self) -> None:
        """Jobs left queued or running by a process that stopped: failed, saying so (no version was written).

        On PostgreSQL, only those whose replica no longer holds their model's lock (the others still run)."""
        if self.kind != "sqlite":
            with self.engine.connect() as connection:
                models = connection.execute(select(jobs.c.model).where(UNFINISHED).distinct()).scalars().all()
            for model in models:
                claim = self.claim_updates(model)  # won: their replica is gone, and they are marked failed
                if claim is not None:
                    claim.release()
            return
        self._fail_jobs("the service stopped before the update finished; no version was written; start it again")

    def _fail_jobs(self, error: str, *where) -> None:
        """Mark the unfinished jobs (of ``where``) failed, saying why."""
        with self.engine.begin() as connection:
            connection.execute(
                update(jobs).where(UNFINISHED, *where).values(state="failed", finished=time.time(), error=error)
            )


class UpdateClaim:
    """A held :meth:`JobStore.claim_updates`; :meth:`release` lets go of it."""

    def __init__(self, connection):
        self.connection = connection

    def release(self) -> None:
        if self.connection is not None:
            with contextlib.suppress(Exception):  # a database gone has let go of it already
                # let go at once: a closed connection's lock lasts until its server process has noticed and ended,
                # and a claim made meanwhile (the next update, on any replica) would find it still held
                self.connection.execute(text("SELECT pg_advisory_unlock_all()"))
                self.connection.commit()
            # the lock belongs to the server's session: the connection is closed, not handed back to the pool
            with contextlib.suppress(Exception):
                self.connection.invalidate()
                self.connection.close()
            self.connection = None
