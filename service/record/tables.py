"""The record's schema: one set of tables for SQLite and PostgreSQL (SQLAlchemy 2 Core).

A schema change is a migration in :mod:`padim.service.record.migrations` (tests check that the migrations
build exactly these tables). Times are UTC seconds since the epoch (float), which both databases compare alike.
"""

from __future__ import annotations

import hashlib
import secrets
import time

from sqlalchemy import JSON, Boolean, Column, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text

metadata = MetaData()


def new_id(now: float | None = None, key: str | None = None) -> str:
    """32 hex digits: the time in milliseconds (12), then 20 random: ids sort by time across replicas.

    With ``key`` the 20 come from its sha256 instead: the same id on every attempt (a line picture scored again after
    a crash), which the record inserts once."""
    millis = int((time.time() if now is None else now) * 1000)
    tail = hashlib.sha256(key.encode()).hexdigest()[:20] if key is not None else secrets.token_hex(10)
    return f"{millis:012x}{tail}"


#: One row per scored picture. ``label`` is the latest review's (``reviews`` keeps every one).
records = Table(
    "records",
    metadata,
    Column("id", String(32), primary_key=True),  # 12 hex digits of milliseconds, then 20 random: sorts by time
    Column("time", Float, nullable=False, index=True),
    Column("model", String(64), nullable=False),
    Column("version", Integer, nullable=False),
    Column("raw_score", Float, nullable=False),
    Column("score", Float, nullable=False),
    Column("threshold", Float, nullable=False),  # on the 0..1 scale, as the request used it
    Column("raw_threshold", Float, nullable=True),
    Column("is_anomaly", Boolean, nullable=False),
    Column("anomalous_area", Float, nullable=False),
    Column("input_distance", Float, nullable=True),
    Column("width", Integer, nullable=False),
    Column("height", Integer, nullable=False),
    Column("sha256", String(64), nullable=False, index=True),
    Column("picture_bytes", Integer, nullable=False),
    Column("fields", JSON, nullable=False),  # the client's own: part, line, station, camera, ...
    Column("part", String(256), nullable=True, index=True),
    Column("source", String(32), nullable=False),  # http, or a line source
    Column("sampled", Boolean, nullable=False),  # a passed picture drawn for review (misses are found there)
    Column("label", String(16), nullable=True),
    Column("reviewed_at", Float, nullable=True),
    Index("ix_records_model_version", "model", "version"),
    Index("ix_records_label", "label"),
)

#: Every review, oldest first: a later one does not erase an earlier one (the latest counts).
reviews = Table(
    "reviews",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("record_id", String(32), ForeignKey("records.id", ondelete="CASCADE"), nullable=False, index=True),
    Column("time", Float, nullable=False),
    Column("label", String(16), nullable=False),
    Column("defect_type", String(64), nullable=True),
    Column("note", Text, nullable=True),
    Column("reviewer", String(128), nullable=True),
)

#: What each stored picture holds, for the byte budget and retention: the files are under the record's folder.
pictures = Table(
    "pictures",
    metadata,
    Column("sha256", String(64), primary_key=True),
    Column("bytes", Integer, nullable=False),
    Column("first_seen", Float, nullable=False),
    Column("last_seen", Float, nullable=False, index=True),
    Column("flagged", Boolean, nullable=False),  # some row of it was flagged: kept longer
    Column("pinned", Boolean, nullable=False),  # reviewed or learned from: never evicted
    Column("evicted", Float, nullable=True),  # when its file was removed (its rows stay)
)

#: Model updates (POST /models/{name}/update): their progress and result, readable from every replica.
jobs = Table(
    "jobs",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("model", String(64), nullable=False, index=True),
    Column("base_version", Integer, nullable=False),
    Column("state", String(16), nullable=False),  # queued, running, succeeded, failed
    Column("phase", String(32), nullable=False),
    Column("progress", Float, nullable=False),
    Column("created", Float, nullable=False),
    Column("started", Float, nullable=True),
    Column("finished", Float, nullable=True),
    Column("request", JSON, nullable=False),
    Column("result", JSON, nullable=True),
    Column("error", Text, nullable=True),
)
