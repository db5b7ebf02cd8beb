"""A hot folder on a real `padim serve --lines`, a real mosquitto and a webhook receiver: every picture gets exactly
one verdict and one record row across a kill -9 and a broker outage, equal to `padim predict`'s."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import signal
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from helpers import assert_same_verdict, free_port, metric, run_cli, running_server, wait_until
from mosquitto import Broker, Subscriber

pytestmark = pytest.mark.mosquitto

SECRET = "line-secret"
BURST = 200
FAIL_FIRST = 5  # the webhook receiver answers 503 to its first calls


class Receiver:
    """A webhook receiver on 127.0.0.1 that fails its first ``fail_first`` calls."""

    def __init__(self, fail_first: int):
        self.calls, self.bodies, self.bad_signatures = 0, [], 0
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                with lock:
                    receiver.calls += 1
                    failing = receiver.calls <= fail_first
                    expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
                    if not hmac.compare_digest(expected, self.headers.get("x-padim-signature", "")):
                        receiver.bad_signatures += 1
                    elif not failing:
                        assert json.loads(body)["id"] == self.headers["x-padim-id"]
                        receiver.bodies.append(json.loads(body))
                self.send_response(503 if failing else 204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def ids(self) -> set[str]:
        return {b["id"] for b in self.bodies}


def slow_copy(source: Path, target: Path, pause: float) -> None:
    """Write a picture in three pieces with pauses (a camera PC on a slow share), closing between them."""
    data = source.read_bytes()
    third = len(data) // 3
    for start in (0, third, 2 * third):
        with open(target, "ab") as file:
            file.write(data[start : start + third] if start < 2 * third else data[start:])
        time.sleep(pause)


def mqtt_outbox(server) -> float:
    return metric(server.url, "padim_line_outbox_depth", line="press", sink="mqtt")


def test_hot_folder_one_verdict_each_across_kill_and_broker_outage(model_file, dataset, tmp_path):
    pool = sorted((dataset / "test").rglob("*.png")) + sorted((dataset / "train" / "good").glob("*.png"))[:12]
    run_cli("-q", "predict", model_file, *pool, "--output", tmp_path / "predicted", "--no-maps", "--no-heatmaps")
    results = (tmp_path / "predicted" / "results.jsonl").read_text().splitlines()
    predicted = {Path(r["path"]).resolve(): r for r in map(json.loads, results)}
    incoming = tmp_path / "in"
    incoming.mkdir()
    broker = Broker(tmp_path / "broker")
    broker.start()
    receiver = Receiver(FAIL_FIRST)
    subscriber = Subscriber(broker.port, "padim/press/verdicts")
    lines = tmp_path / "lines.yaml"
    lines.write_text(
        f"""
lines:
  - name: press
    station: "3"
    latency_budget_ms: 5000
    source: {{type: folder, path: in, settle_s: 0.4, poll_s: 0.2}}
    sinks:
      - {{type: mqtt, host: 127.0.0.1, port: {broker.port}}}
      - {{type: webhook, url: "{receiver.url}", secret_env: PADIM_TEST_HOOK_SECRET}}
"""
    )
    env = {"PADIM_LINES": str(lines), "PADIM_TEST_HOOK_SECRET": SECRET, "PADIM_RECORD_DIR": str(tmp_path / "record")}
    written: dict[str, Path] = {}  # file name -> the picture it is a copy of
    try:
        with running_server(tmp_path, [model_file], env=env) as server:
            # pictures written slowly, in pieces, and one that is not a picture at all
            for i, source in enumerate(pool[:3]):
                slow_copy(source, incoming / f"slow-{i}.png", pause=0.1)
                written[f"slow-{i}.png"] = source
            (incoming / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
            wait_until(lambda: len(subscriber.ids()) == 3, 30, "the slow pictures' verdicts")
            # the broker goes down; a burst arrives; the service is killed in the middle of it
            broker.stop()
            down = time.time()
            for i in range(BURST):
                name = f"part-{i:03d}.png"
                shutil.copyfile(pool[i % len(pool)], incoming / name)
                written[name] = pool[i % len(pool)]
            done = incoming / "done", incoming / "flagged"
            wait_until(lambda: sum(len(list(d.iterdir())) for d in done) >= 60, 60, "part of the burst")
            # the outbox metric is scraped from the server: it may lag the folders' moves by a moment
            wait_until(lambda: mqtt_outbox(server) >= 60, 10, "the moved pictures' messages in the MQTT outbox")
            outbox = mqtt_outbox(server)
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(10)
        assert outbox >= 60
        assert list(incoming.glob("part-*")), "the kill came after the burst: it tests nothing"
        with running_server(tmp_path, [model_file], env=env) as server:
            wait_until(lambda: not list(incoming.glob("part-*")), 60, "the rest of the burst")
            wait_until(
                lambda: metric(server.url, "padim_line_outbox_depth", line="press", sink="mqtt") > 0, 10, "depth"
            )
            time.sleep(max(0.0, 20 - (time.time() - down)))  # the broker is down for 20 s in all
            broker.start()
            ids = subscriber.wait_for(len(written), 60)
            wait_until(lambda: len(receiver.ids()) >= len(written), 30, "the webhook's deliveries")
            wait_until(
                lambda: metric(server.url, "padim_line_outbox_depth", line="press", sink="mqtt") == 0,
                10,
                "empty outbox",
            )
            assert metric(server.url, "padim_line_delivered_total", line="press", sink="mqtt") > 0
            state = httpx.get(server.url + "/health/ready").json()
            assert state["lines"]["press"]["sinks"]["mqtt"] == {"connected": True, "outbox": 0}
    finally:
        subscriber.close()
        broker.stop()
        receiver.server.shutdown()

    # exactly one verdict per picture (an id delivered twice is the same verdict: at-least-once, de-duplicated)
    by_name: dict[str, dict] = {}
    for message in subscriber.messages:
        earlier = by_name.setdefault(message["source"], message)
        assert earlier["id"] == message["id"] and earlier["score"] == message["score"], (earlier, message)
    assert set(by_name) == set(written)
    assert ids == {m["id"] for m in by_name.values()}
    assert receiver.ids() == ids and receiver.bad_signatures == 0 and receiver.calls >= len(written) + FAIL_FIRST
    # verdicts equal padim predict's; files moved by verdict
    for name, message in by_name.items():
        expected = predicted[written[name].resolve()]
        assert_same_verdict(message, expected)
        assert message["part"] == Path(name).stem and message["line"] == "press" and message["station"] == "3"
        folder = "flagged" if message["is_anomaly"] else "done"
        assert (incoming / folder / name).is_file(), name
    assert (incoming / "rejected" / "broken.png").is_file()
    assert "not a readable image" in (incoming / "rejected" / "broken.png.reason.txt").read_text()
    # one record row per picture, with the line's fields
    with sqlite3.connect(tmp_path / "record" / "record.sqlite") as db:
        rows = db.execute("select id, source, fields from records").fetchall()
    assert len(rows) == len(written)
    assert {r[0] for r in rows} == {m["record_id"] for m in by_name.values()}
    assert all(r[1] == "line" and json.loads(r[2])["line"] == "press" for r in rows)
