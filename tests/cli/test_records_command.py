"""``padim records export``: the rows and pictures a filter selects, bytes as sent, on a real record."""

import csv
import hashlib
import json

from helpers import run_cli

from padim.service.record.recorder import Recorder
from padim.service.record.rows import make_row
from padim.service.record.store import RecordStore, database_url


def test_export_writes_the_selected_rows_and_their_pictures(dataset, tmp_path):
    folder = tmp_path / "record"
    folder.mkdir()
    store = RecordStore(database_url(None, folder))
    store.migrate()
    recorder = Recorder(folder, store, 10**7, 10**9, 30, 90)
    recorder.start()
    paths = sorted(dataset.glob("test/*/*.png"))[:6]
    rows = []
    for i, path in enumerate(paths + paths[:2]):  # two pictures scored twice: exported once
        data = path.read_bytes()
        result = {
            "raw_score": 1.0 + i,
            "score": 0.1 * i,
            "threshold": 0.5,
            "raw_threshold": 4.0,
            "is_anomaly": i >= 4,
            "anomalous_area": 0.0,
        }
        rows.append(
            make_row(
                "weave",
                1,
                result,
                2.0,
                (96, 96),
                hashlib.sha256(data).hexdigest(),
                len(data),
                {"part": f"P{i}"},
                sample=0.0,
            )
        )
        recorder.submit(rows[-1], data).result(10)
    assert recorder.flushed(30)
    store.review(rows[1]["id"], "normal", None, "ok", "ana")
    store.review(rows[2]["id"], "normal", None, None, None)
    recorder.close()

    out = tmp_path / "normal"
    summary = json.loads(run_cli("-q", "records", "export", "--record", folder, "--label", "normal", "-o", out).stdout)
    assert summary == {"output": str(out), "rows": 2, "pictures": 2, "evicted": 0}
    exported = sorted(out.glob("pictures/*.png"))
    assert sorted(p.read_bytes() for p in exported) == sorted(paths[i].read_bytes() for i in (1, 2))
    lines = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert {r["id"] for r in lines} == {rows[1]["id"], rows[2]["id"]}
    assert [r["note"] for r in next(x for x in lines if x["id"] == rows[1]["id"])["reviews"]] == ["ok"]
    table = list(csv.DictReader(open(out / "rows.csv")))
    assert {json.loads(r["fields"])["part"] for r in table} == {"P1", "P2"} and all(r["picture"] for r in table)

    every = json.loads(run_cli("-q", "records", "export", "--record", folder, "-o", tmp_path / "all").stdout)
    assert every["rows"] == 8 and every["pictures"] == 6
    again = run_cli("records", "export", "--record", folder, "-o", out, check=False)
    assert again.returncode == 1 and "already exists" in again.stderr
    missing = run_cli("records", "export", "--record", tmp_path / "nowhere", "-o", tmp_path / "x", check=False)
    assert missing.returncode == 1 and "no such record folder" in missing.stderr
