"""The record's database on SQLite and a real PostgreSQL: migrations from the first schema up, idempotent replays,
filters and paging, the review trail, and the pictures' budget (oldest passed first, pinned never, rows stay)."""

import hashlib
import time

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from padim.models.errors import RecordNotFound
from padim.service.record.recorder import Recorder
from padim.service.record.rows import make_row
from padim.service.record.store import Filters, RecordStore, current_revision, database_url, metadata, migrate


def store_for(record_url, tmp_path) -> RecordStore:
    return RecordStore(database_url(record_url, tmp_path))


def row(model="weave", anomalous=False, data=b"picture", when=None, part=None, version=1):
    result = {
        "raw_score": 20.0 if anomalous else 5.0,
        "score": 0.9 if anomalous else 0.1,
        "threshold": 0.5,
        "raw_threshold": 12.0,
        "is_anomaly": anomalous,
        "anomalous_area": 0.1 if anomalous else 0.0,
    }
    return make_row(
        model,
        version,
        result,
        3.5,
        (96, 64),
        hashlib.sha256(data).hexdigest(),
        len(data),
        {"part": part} if part else {},
        sample=0.0,
        now=when,
    )


def test_migrations_go_from_the_first_schema_up_and_build_the_tables(record_url, tmp_path):
    store = store_for(record_url, tmp_path)
    migrate(store.engine, "0001")
    assert current_revision(store.engine) == "0001"
    first = row(part="A-1")
    with store.engine.begin() as connection:  # a row written by the first schema
        connection.execute(
            sa.text(
                "INSERT INTO records (id, time, model, version, raw_score, score, threshold, "
                "is_anomaly, anomalous_area, width, height, sha256, picture_bytes, fields, part, "
                "source, sampled) VALUES (:id, :time, 'weave', 1, 5.0, 0.1, 0.5, false, 0.0, 96, "
                "64, :sha256, 7, '{\"part\": \"A-1\"}', 'A-1', 'http', false)"
            ),
            {"id": first["id"], "time": first["time"], "sha256": first["sha256"]},
        )
    assert not sa.inspect(store.engine).has_table("jobs")
    store.migrate()
    assert current_revision(store.engine) == "0002" and sa.inspect(store.engine).has_table("jobs")
    assert store.get(first["id"])["fields"] == {"part": "A-1"}  # the row survived the migration
    with store.engine.connect() as connection:  # the migrations build exactly the tables the code uses
        assert compare_metadata(MigrationContext.configure(connection), metadata) == []
    store.migrate()  # a second start changes nothing
    store.close()


def test_replays_are_idempotent_and_rows_are_filtered_and_paged(record_url, tmp_path):
    store = store_for(record_url, tmp_path)
    store.migrate()
    now = time.time()
    rows = [row(anomalous=i % 3 == 0, data=f"p{i}".encode(), when=now - 100 + i, part=f"P{i % 4}") for i in range(30)]
    store.insert(rows)
    store.insert(rows[10:20])  # the same rows again: a replay after a crash
    assert store.count(Filters()) == 30
    assert store.count(Filters(verdict="anomalous")) == 10 and store.count(Filters(part="P1")) == 8
    assert store.count(Filters(since=now - 90, until=now - 80)) == 10
    pages, cursor = [], None
    while True:
        page = store.list(Filters(), 7, cursor)
        pages += page
        if len(page) < 7:
            break
        cursor = page[-1]["id"]
    assert [r["id"] for r in pages] == sorted((r["id"] for r in rows), reverse=True)
    assert store.count(Filters(queue=True)) == 10  # flagged, not reviewed (none sampled here)
    store.close()


def test_reviews_keep_a_trail_and_the_latest_counts(record_url, tmp_path):
    store = store_for(record_url, tmp_path)
    store.migrate()
    one = row(anomalous=True)
    store.insert([one])
    store.review(one["id"], "normal", None, "a lamp changed", "ana")
    after = store.review(one["id"], "defect", "scratch", "looked again", "ben")
    assert after["label"] == "defect" and [r["label"] for r in after["reviews"]] == ["normal", "defect"]
    assert [r["reviewer"] for r in after["reviews"]] == ["ana", "ben"] and after["picture_pinned"]
    assert store.count(Filters(queue=True)) == 0 and store.count(Filters(label="defect")) == 1
    with pytest.raises(RecordNotFound):
        store.review("0" * 32, "normal", None, None, None)
    store.close()


def test_the_budget_evicts_oldest_passed_pictures_first_never_pinned_ones_and_keeps_rows(record_url, tmp_path):
    store = store_for(record_url, tmp_path)
    store.migrate()
    recorder = Recorder(
        tmp_path, store, journal_max_bytes=10**7, max_bytes=3000, retention_days=30, flagged_retention_days=90
    )
    now = time.time() - 3600  # an hour ago: nothing is spared as being stored again
    pictures = [(f"passed {i}".encode() * 100, i >= 6, now + i) for i in range(10)]  # 6 passed, then 4 flagged
    rows = []
    for data, flagged, when in pictures:
        rows.append(row(anomalous=flagged, data=data, when=when))
        recorder.pictures.put(rows[-1]["sha256"], data)
    store.insert(rows)
    store.review(rows[0]["id"], "normal", None, None, None)  # the oldest passed picture is pinned
    assert store.storage()["bytes"] == sum(len(d) for d, _, _ in pictures)  # 8,990 bytes for a budget of 3,000
    recorder.upkeep.evict(time.time())
    report = store.storage()
    kept = {r["sha256"] for r in rows if recorder.pictures.has(r["sha256"])}
    # the pinned picture, and the newest flagged pictures within the budget; every passed one but the pinned went first
    assert rows[0]["sha256"] in kept and not any(rows[i]["sha256"] in kept for i in range(1, 6))
    assert report["bytes"] - report["pinned_bytes"] <= 3000 and report["pinned_bytes"] == len(pictures[0][0])
    assert rows[9]["sha256"] in kept and rows[6]["sha256"] not in kept  # flagged: the oldest went, the newest stayed
    assert store.count(Filters()) == 10  # every row stays
    assert store.get(rows[3]["id"])["picture_kept"] is False
    # retention: a passed picture older than its days goes whatever the budget
    old = row(data=b"old" * 10, when=time.time() - 40 * 86400)
    recorder.pictures.put(old["sha256"], b"old" * 10)
    store.insert([old])
    recorder.upkeep.max_bytes = 10**9
    recorder.upkeep.evict(time.time())
    assert not recorder.pictures.has(old["sha256"]) and rows[9]["sha256"] in kept
    recorder.close()


def test_one_update_of_a_model_at_a_time_across_replicas(postgres_cluster):
    url = postgres_cluster.new_database()
    first, second = RecordStore(url), RecordStore(url)  # two replicas' connections to one database
    first.migrate()
    claim = first.jobs.claim_updates("weave")
    assert claim is not None and second.jobs.claim_updates("weave") is None
    other = second.jobs.claim_updates("cable")  # another model: its own lock
    assert other is not None
    other.release()
    job = first.jobs.add_job("weave", 1, {})
    first.jobs.set_job(job["id"], state="running")
    assert second.jobs.running_job("weave")["id"] == job["id"]
    claim.connection.invalidate()  # the replica's connection is gone (it died): the server lets go of the lock
    again = second.jobs.claim_updates("weave")
    assert again is not None
    stopped = second.jobs.job(job["id"])  # its replica stopped: failed, saying so, and no longer running
    assert stopped["state"] == "failed" and "replica stopped" in stopped["error"]
    assert second.jobs.running_job("weave") is None
    again.release()
    assert first.jobs.claim_updates("weave") is not None
    first.close(), second.close()
