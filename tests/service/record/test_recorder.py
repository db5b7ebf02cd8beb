"""The recorder's count of rows waiting for the database (``GET /records/storage``'s ``rows_waiting``)."""

import hashlib
import time

from padim.service.record.recorder import Recorder
from padim.service.record.rows import make_row
from padim.service.record.store import Filters, RecordStore, database_url


def row() -> dict:
    verdict = {"raw_score": 5.0, "score": 0.1, "threshold": 0.5, "raw_threshold": 12.0}
    verdict |= {"is_anomaly": False, "anomalous_area": 0.0}
    return make_row("weave", 1, verdict, 3.5, (96, 64), hashlib.sha256(b"picture").hexdigest(), 7, {}, sample=0.0)


def test_rows_the_database_takes_at_once_are_not_left_counted_as_waiting(tmp_path, monkeypatch):
    """The database writer may read rows the moment they are in the journal, before the journal writer has counted
    them: the count must still come down to 0 (it once stayed at the rows read early, for good)."""
    store = RecordStore(database_url(None, tmp_path))
    store.migrate()
    recorder = Recorder(tmp_path, store, 10**7, 10**9, 30, 90)
    append = recorder.journal.append

    def append_then_let_the_database_read(lines):  # the interleaving a busy machine gives now and then
        append(lines)
        deadline = time.time() + 10
        while store.count(Filters()) < len(lines) and time.time() < deadline:
            time.sleep(0.01)
        assert store.count(Filters()) == len(lines), "the database writer did not read the rows"

    monkeypatch.setattr(recorder.journal, "append", append_then_let_the_database_read)
    recorder.start()
    try:
        first = row()
        assert recorder.submit(first, b"picture").result(timeout=20) == first["id"]
        assert recorder.flushed(timeout=5), f"{recorder.waiting} row(s) counted as waiting after the database has them"
        assert recorder.waiting_everywhere() == (0, 0)
    finally:
        recorder.close()
