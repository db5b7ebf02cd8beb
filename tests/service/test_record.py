"""The inspection record on a real server: every answer has its row, nothing is lost while the database is away
or when the service is killed, PADIM_RECORD_REQUIRED withholds answers it cannot trace, and the routes' keys."""

import hashlib
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import metric, roles, running_server
from PIL import Image

SCORING, REVIEW, ADMIN = "scoring-key-1", "review-key-22", "admin-key-333"


def record_env(tmp_path, record_url, **more) -> dict:
    env = {"PADIM_RECORD_DIR": str(tmp_path / "record"), "PADIM_RUNTIME": "torch", **more}
    if record_url is not None:
        env["PADIM_RECORD_URL"] = record_url
    return env


def score(url: str, path, fields: dict | None = None, headers: dict | None = None) -> httpx.Response:
    data = {"fields": json.dumps(fields)} if fields else {}
    return httpx.post(
        url + "/score",
        files={"file": (path.name, path.read_bytes(), "image/png")},
        data=data,
        headers=headers,
        timeout=60,
    )


def wait_recorded(url: str, rows: int, headers: dict | None = None, timeout: float = 60) -> dict:
    """The storage report once the database holds ``rows`` rows and none waits in the journal."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        report = httpx.get(url + "/records/storage", headers=headers, timeout=10)
        if report.status_code == 200 and report.json()["rows"] >= rows and report.json()["rows_waiting"] == 0:
            return report.json()
        time.sleep(0.2)
    raise AssertionError(f"the record did not reach {rows} rows: {report.text}")


def assert_row_is_the_answer(url: str, answer: dict, path, fields: dict, headers: dict | None = None) -> None:
    row = httpx.get(url + f"/records/{answer['record_id']}", headers=headers, timeout=10).json()
    for key in ("score", "raw_score", "is_anomaly", "threshold", "anomalous_area"):
        assert row[key] == answer[key], key
    assert row["model"] == answer["model"]["name"] and row["version"] == answer["model"]["version"]
    assert row["fields"] == fields and row["part"] == fields.get("part")
    assert row["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (row["width"], row["height"]) == Image.open(path).size and row["label"] is None


@pytest.mark.load_sensitive
def test_every_answer_of_a_concurrent_load_has_its_row(model_file, dataset, record_url, tmp_path):
    pictures = sorted(dataset.glob("test/*/*.png"))
    with running_server(tmp_path, [model_file], env=record_env(tmp_path, record_url)) as server:

        def client(k: int) -> list:
            answers = []
            for i, path in enumerate(pictures):
                if i % 4 != k:
                    continue
                fields = {"part": f"{path.parent.name}-{path.stem}", "station": str(k)}
                if i % 3 == 0:  # a batch of two: fields as a list, one per file, in order
                    other = pictures[(i + 1) % len(pictures)]
                    both = [fields, {"part": "twin", "camera": "top"}]
                    answer = httpx.post(
                        server.url + "/score/batch",
                        data={"fields": json.dumps(both)},
                        timeout=60,
                        files=[("file", (p.name, p.read_bytes(), "image/png")) for p in (path, other)],
                    )
                    assert answer.status_code == 200, answer.text
                    body = answer.json()
                    answers += [
                        ({**a, "model": body["model"]}, p, f)
                        for a, p, f in zip(body["results"], (path, other), both, strict=True)
                    ]
                else:
                    answer = score(server.url, path, fields)
                    assert answer.status_code == 200, answer.text
                    answers.append((answer.json(), path, fields))
            return answers

        with ThreadPoolExecutor(4) as pool:
            answers = [a for part in pool.map(client, range(4)) for a in part]
        report = wait_recorded(server.url, len(answers))
        assert report["rows"] == len(answers) and report["database"] == (
            "sqlite" if record_url is None else "postgresql"
        )
        assert len({a["record_id"] for a, _, _ in answers}) == len(answers)
        for answer, path, fields in answers:
            assert_row_is_the_answer(server.url, answer, path, fields)
        image = httpx.get(server.url + f"/records/{answers[0][0]['record_id']}/image")
        assert image.content == answers[0][1].read_bytes() and image.headers["content-type"] == "image/png"
        heatmap = httpx.get(server.url + f"/records/{answers[0][0]['record_id']}/heatmap")
        assert heatmap.status_code == 200 and heatmap.content.startswith(b"\x89PNG")
        assert metric(server.url, "padim_record_rows_total", outcome="committed") == len(answers)
        assert report["pictures"] == len(pictures)  # each content once, however often it was scored


@pytest.mark.postgres
@pytest.mark.load_sensitive
def test_rows_wait_in_the_journal_while_postgres_is_down_and_none_is_lost(
    model_file, dataset, postgres_cluster, tmp_path
):
    pictures = sorted(dataset.glob("test/*/*.png"))
    env = record_env(tmp_path, postgres_cluster.new_database())
    with running_server(tmp_path, [model_file], env=env) as server:
        ids = [score(server.url, p).json()["record_id"] for p in pictures[:6]]
        wait_recorded(server.url, 6)
        postgres_cluster.stop()
        try:
            down = [score(server.url, p) for p in pictures * 2]  # scoring does not wait for the database
            assert all(a.status_code == 200 for a in down)
            ids += [a.json()["record_id"] for a in down]
            # without PADIM_RECORD_REQUIRED an answer does not wait for its row's journal line: the last rows may
            # still be on their way when the last answer comes, so the count is waited for (it must not pass it)
            deadline = time.time() + 20
            while time.time() < deadline and (
                metric(server.url, "padim_record_database_up") != 0
                or metric(server.url, "padim_record_rows_waiting") < len(down)
            ):
                time.sleep(0.2)
            assert metric(server.url, "padim_record_database_up") == 0
            assert metric(server.url, "padim_record_rows_waiting") == len(down)
            assert metric(server.url, "padim_record_journal_bytes") > 0
            assert httpx.get(server.url + "/records").status_code == 503  # reading needs the database
        finally:
            postgres_cluster.start()
        report = wait_recorded(server.url, len(ids))
        assert report["rows"] == len(ids) and report["database_up"]
        listed, cursor = [], None
        while True:
            page = httpx.get(
                server.url + "/records", params={"limit": 500, **({"cursor": cursor} if cursor else {})}
            ).json()
            listed += [r["id"] for r in page["records"]]
            if page["next"] is None:
                break
            cursor = page["next"]
        assert sorted(listed) == sorted(ids)  # zero rows lost, none twice


@pytest.mark.postgres
@pytest.mark.load_sensitive
def test_required_rows_answer_503_only_when_the_journal_cannot_take_them(
    model_file, dataset, postgres_cluster, tmp_path
):
    pictures = sorted(dataset.glob("test/*/*.png"))
    env = record_env(
        tmp_path, postgres_cluster.new_database(), PADIM_RECORD_REQUIRED="true", PADIM_RECORD_JOURNAL_MAX_BYTES="4000"
    )  # about six rows
    with running_server(tmp_path, [model_file], env=env) as server:
        wait_recorded(server.url, 0)
        postgres_cluster.stop()
        answered, refused = [], 0
        try:
            for path in pictures * 2:
                answer = score(server.url, path)
                if answer.status_code == 200:
                    answered.append(answer.json()["record_id"])
                else:
                    assert answer.status_code == 503 and answer.json()["error"]["code"] == "record_unavailable"
                    refused += 1
            assert 3 <= len(answered) < len(pictures) * 2 and refused > 0  # answered while the journal had room
        finally:
            postgres_cluster.start()
        report = wait_recorded(server.url, len(answered))
        assert report["rows"] == len(answered)  # every answer has its row; no row without an answer
        for record_id in answered:
            assert httpx.get(server.url + f"/records/{record_id}").status_code == 200
        assert score(server.url, pictures[0]).status_code == 200  # the journal drained: answers again


@pytest.mark.load_sensitive
@pytest.mark.parametrize("killed", ["the one process", "an API process of two"])
def test_a_kill_9_loses_no_answered_row_when_rows_are_required(model_file, dataset, tmp_path, killed):
    """Each API process writes its requests' rows through a journal of its own: one killed loses none of the rows it
    answered; its replacement (same row, same journal) sends them on."""
    import os

    pictures = sorted(dataset.glob("test/*/*.png"))
    env = record_env(tmp_path, None, PADIM_RECORD_REQUIRED="true")
    workers = "1" if killed == "the one process" else "2"
    answered: list[str] = []
    with running_server(tmp_path, [model_file], env=env, args=("--workers", workers)) as server:
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                for path in pictures:
                    try:
                        answer = score(server.url, path, headers={"connection": "close"})
                    except httpx.TransportError:
                        if workers == "1":
                            return
                        continue
                    if answer.status_code == 200:
                        answered.append(answer.json()["record_id"])

        threads = [threading.Thread(target=load) for _ in range(3)]
        for thread in threads:
            thread.start()
        deadline = time.time() + 60
        while len(answered) < 30 and time.time() < deadline:
            time.sleep(0.05)
        if workers == "1":
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()
        else:
            os.kill(roles(server.process.pid)["api-1"], signal.SIGKILL)
            count = len(answered)
            while len(answered) < count + 10 and time.time() < deadline + 60:
                time.sleep(0.05)
        stop.set()
        for thread in threads:
            thread.join()
        if workers == "2":
            wait_recorded(server.url, len(answered))
            for record_id in answered:
                assert httpx.get(server.url + f"/records/{record_id}").status_code == 200
    assert len(answered) >= 30
    if workers == "1":
        with running_server(tmp_path, [model_file], env=env) as again:
            wait_recorded(again.url, len(answered))
            for record_id in answered:
                assert httpx.get(again.url + f"/records/{record_id}").status_code == 200


def test_keys_reviews_and_bad_input(model_file, dataset, tmp_path):
    path = sorted(dataset.glob("test/hole/*.png"))[0]
    env = record_env(tmp_path, None, PADIM_API_KEY=SCORING, PADIM_REVIEW_KEY=REVIEW, PADIM_ADMIN_KEY=ADMIN)
    scoring, review, admin = ({"X-API-Key": k} for k in (SCORING, REVIEW, ADMIN))
    with running_server(tmp_path, [model_file], env=env) as server:
        answer = score(server.url, path, {"part": "A-1"}, headers=scoring).json()
        wait_recorded(server.url, 1, headers=scoring)
        record = f"{server.url}/records/{answer['record_id']}"
        assert httpx.get(server.url + "/records").status_code == 401
        assert httpx.get(record + "/image").status_code == 401
        assert httpx.get(server.url + "/records", headers=scoring).status_code == 200
        assert httpx.get(record, headers=review).status_code == 200
        said = {"label": "normal", "note": "the new lamp", "reviewer": "ana"}
        assert httpx.post(record + "/review", json=said).status_code == 401
        forbidden = httpx.post(record + "/review", json=said, headers=scoring)
        assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "forbidden"
        assert httpx.post(record + "/review", json=said, headers=review).status_code == 200
        again = httpx.post(record + "/review", json={"label": "defect", "defect_type": "hole"}, headers=admin).json()
        assert again["label"] == "defect" and [r["label"] for r in again["reviews"]] == ["normal", "defect"]
        assert (
            httpx.get(server.url + "/records", params={"label": "defect"}, headers=scoring).json()["records"][0]["id"]
            == answer["record_id"]
        )
        unknown = httpx.post(f"{server.url}/records/{'0' * 32}/review", json=said, headers=review)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "record_not_found"
        bad_label = httpx.post(record + "/review", json={"label": "maybe"}, headers=review)
        assert bad_label.status_code == 422 and bad_label.json()["error"]["code"] == "invalid_parameter"
        for fields in ('{"Part": "x"}', '{"part": 3}', "[1]", "not json"):
            bad = httpx.post(
                server.url + "/score",
                files={"file": (path.name, path.read_bytes(), "image/png")},
                data={"fields": fields},
                headers=scoring,
            )
            assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_fields", fields
        raw = httpx.post(
            server.url + "/score",
            content=path.read_bytes(),
            timeout=60,
            headers={**scoring, "Content-Type": "image/png", "X-Padim-Fields": '{"line": "7"}'},
        ).json()
        wait_recorded(server.url, 2, headers=scoring)
        assert httpx.get(f"{server.url}/records/{raw['record_id']}", headers=scoring).json()["fields"] == {"line": "7"}
        assert metric(server.url, "padim_reviews_total", model="weave", label="defect") == 1


def test_the_record_is_off_unless_asked_for(server, dataset):
    assert httpx.get(server.url + "/records").status_code == 404
    assert "record_id" not in score(server.url, sorted(dataset.glob("test/good/*.png"))[0]).json()
