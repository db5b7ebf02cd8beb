"""`padim serve --workers 2` as real processes: a supervisor, a scoring process and two API processes on 127.0.0.1.

What one process does is tested on both layouts where the tests share the ``server`` fixture (tests/conftest.py),
and the swap under load, the drain and the record's kill -9 are parametrised by the number of workers where they
live. Here: what only several processes have. An API process or the scoring process killed with SIGKILL, the queue
bound shared by the API processes, a line run once, and one /metrics for all of them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import SCORE_RTOL, Receiver, large_png, metric, roles, running_server, wait_until

pytestmark = pytest.mark.load_sensitive

PNG = {"content-type": "image/png"}


def probe(dataset) -> bytes:
    return (dataset / "test" / "good" / "000.png").read_bytes()


def ready(url: str) -> httpx.Response:
    return httpx.get(url + "/health/ready", timeout=10)


def listening_socket(port: int) -> str:
    """The inode of the socket listening on 127.0.0.1:``port``, as a process's /proc/PID/fd links name it."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
            return f"socket:[{fields[9]}]"
    raise AssertionError(f"nothing listens on port {port}")


def holds(pid: int, link: str) -> bool:
    return any(os.readlink(fd) == link for fd in Path(f"/proc/{pid}/fd").iterdir())


def test_an_api_process_killed_is_replaced_and_the_other_keeps_serving(model_file, dataset, tmp_path):
    with running_server(tmp_path, [model_file], args=("--workers", "2")) as server:
        before = roles(server.process.pid)
        assert set(before) == {"scoring", "api-1", "api-2"}
        # forked from the supervisor, each holds what it needs of its sockets: the API processes accept, the scoring
        # process does not keep the port open once the supervisor closes it to drain
        listening = listening_socket(int(server.url.rsplit(":", 1)[1]))
        held = {role: holds(pid, listening) for role, pid in before.items()}
        assert held == {"scoring": False, "api-1": True, "api-2": True}
        reference = httpx.post(server.url + "/score", content=probe(dataset), headers=PNG).json()["raw_score"]
        statuses: list[int] = []
        stop = threading.Event()

        def load() -> None:  # a new connection a request: each goes to whichever API process accepts it
            # paced (50 a second at most a client): enough to see who serves, while the CPU goes to the replacement
            while not stop.wait(0.02):
                try:
                    answer = httpx.post(
                        server.url + "/score", content=probe(dataset), headers={**PNG, "connection": "close"}
                    )
                    statuses.append(answer.status_code)
                    assert answer.status_code != 200 or answer.json()["raw_score"] == pytest.approx(
                        reference, rel=SCORE_RTOL
                    )
                except httpx.TransportError:
                    statuses.append(0)

        threads = [threading.Thread(target=load) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        killed = before["api-1"]
        os.kill(killed, signal.SIGKILL)
        deadline = time.time() + 5
        while (during := ready(server.url)).status_code == 200 and time.time() < deadline:
            time.sleep(0.01)
        count = len(statuses)
        wait_until(lambda: len(statuses) >= count + 20, 60, "requests served by the other API process")
        wait_until(lambda: ready(server.url).status_code == 200, 90, "the replacement to be ready")
        stop.set()
        for thread in threads:
            thread.join(60)
        after = roles(server.process.pid)
        served = metric(server.url, "padim_requests_total", route="/score", status="200")
        logs = server.logs()
    assert during.status_code == 503 and "API process 1" in during.json()["reason"], during.text
    assert after["api-1"] != killed and after["scoring"] == before["scoring"] and after["api-2"] == before["api-2"]
    # only requests on the killed process's connections may have failed (a client has one at a time, and its failure
    # may be counted after another client's success: the order of the list is not the order of the kill); after
    # it, fresh connections are served
    assert statuses[count:].count(200) >= 20 and statuses.count(0) <= len(threads), statuses[count:][:20]
    # no connection refused or reset after that, and no 503: a replacement takes connections off the shared socket
    # only once its link to the scoring process is up (until then the other API process serves them)
    assert 0 not in statuses[-20:] and set(statuses) <= {200, 0}, [s for s in statuses if s not in (200, 0)]
    assert served >= statuses.count(200) + 1  # one /metrics adds up every process, the dead one's counts included
    assert "API process 1 stopped (signal SIGKILL); starting it again" in logs


def test_the_scoring_process_killed_fails_readiness_at_once_and_is_started_again(model_file, dataset, tmp_path):
    with running_server(tmp_path, [model_file], args=("--workers", "2")) as server:
        reference = httpx.post(server.url + "/score", content=probe(dataset), headers=PNG).json()
        scoring = roles(server.process.pid)["scoring"]
        os.kill(scoring, signal.SIGKILL)
        deadline = time.time() + 5
        # the first answer that is not 200 says why: a second one may already find the new scoring process
        # loading (it starts in about half a second; a CI run read "loading" there)
        while (unready := ready(server.url)).status_code == 200 and time.time() < deadline:
            time.sleep(0.01)
        refused = httpx.post(server.url + "/score", content=probe(dataset), headers=PNG)
        wait_until(lambda: ready(server.url).status_code == 200, 120, "the scoring process to be back")
        again = httpx.post(server.url + "/score", content=probe(dataset), headers=PNG)
        assert roles(server.process.pid)["scoring"] != scoring
    assert unready.status_code == 503 and "scoring process" in unready.json()["reason"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
    assert again.status_code == 200 and again.json()["raw_score"] == pytest.approx(
        reference["raw_score"], rel=SCORE_RTOL
    )


def test_the_queue_bound_holds_across_api_processes(model_file, tmp_path):
    """Places taken by one API process's request (four large pictures decoding, one at a time) are taken for every
    API process: requests on new connections, whichever process accepts them, are refused with 503."""
    big = large_png()
    env = {"PADIM_MAX_QUEUE": "4", "PADIM_DECODE_PIXEL_BUDGET": "40000000", "PADIM_API_KEY": "the-key"}
    key = {"x-api-key": "the-key"}
    with running_server(tmp_path, [model_file], env=env, args=("--workers", "2")) as server:
        # the key is asked for by the API processes (scoring) and by the scoring process (the routes passed on)
        assert httpx.post(server.url + "/score", content=b"x", headers=PNG).status_code == 401
        assert httpx.get(server.url + "/models").status_code == 401
        assert httpx.get(server.url + "/models", headers=key).json()["default"] == "weave"
        holder: dict = {}
        thread = threading.Thread(
            target=lambda: holder.update(
                r=httpx.post(
                    server.url + "/score/batch", files=[("file", ("a.png", big))] * 4, headers=key, timeout=300
                )
            )
        )
        thread.start()
        wait_until(lambda: metric(server.url, "padim_queue_depth", model="weave") == 4, 60, "4 places taken")
        # the kernel gives each new connection to either process, not in turn: ask until both have refused one
        # (bounded), while the four places are still taken
        refused, answered_by = [], set()
        while answered_by != {"api-1", "api-2"} and len(refused) < 64 and thread.is_alive():
            refused.append(
                httpx.post(server.url + "/score", content=b"x", headers={**PNG, **key, "connection": "close"})
            )
            answered_by = {
                e.get("process") for e in _logs(server) if e.get("route") == "/score" and e.get("status") == 503
            }
        thread.join(300)
        monitor = httpx.get(server.url + "/models/weave/monitor", headers=key).json()
    assert all(r.status_code == 503 and r.json()["error"]["code"] == "overloaded" for r in refused)
    assert holder["r"].status_code == 200 and len(holder["r"].json()["results"]) == 4
    assert monitor["recorded"] == 4  # the scoring process's window: every API process's pictures
    assert answered_by == {"api-1", "api-2"}, answered_by  # both API processes refused: one bound for both


def _logs(server) -> list[dict]:
    """The server's JSON log lines written so far (a line still being written is left for the next read)."""
    whole = server.logs().rpartition("\n")[0]
    return [json.loads(line) for line in whole.splitlines() if line.startswith("{")]


def test_a_line_runs_once_in_the_scoring_process_and_jpegs_go_there_as_bytes(model_file, dataset, tmp_path):
    """The line runs in the scoring process only; and with ``PADIM_DEVICE_DECODE=on`` a JPEG crosses the shared memory
    as its bytes, decoded by the scoring thread: the same verdict as the API process's decode (a heat map's)."""
    import io

    from PIL import Image

    frame = io.BytesIO()
    Image.open(dataset / "test" / "hole" / "000.png").convert("RGB").resize((160, 120)).save(frame, format="JPEG")
    incoming = tmp_path / "in"
    incoming.mkdir()
    receiver = Receiver()
    lines = tmp_path / "lines.yaml"
    lines.write_text(
        f"""
lines:
  - name: press
    source: {{type: folder, path: in, settle_s: 0.2, poll_s: 0.1}}
    sinks:
      - {{type: webhook, url: "{receiver.url}"}}
"""
    )
    pictures = sorted((dataset / "test").rglob("*.png"))
    try:
        with running_server(tmp_path, [model_file], env={"PADIM_LINES": str(lines)}, args=("--workers", "2")) as server:
            for i, picture in enumerate(pictures):
                (incoming / f"part-{i:02d}.png").write_bytes(picture.read_bytes())
            wait_until(lambda: len(receiver.bodies) >= len(pictures), 60, "every picture's verdict")
            time.sleep(1.0)  # a second delivery, were there one, would come now
            state = ready(server.url).json()
            listed = httpx.get(server.url + "/lines").json()
            scored = metric(server.url, "padim_line_pictures_total", line="press", outcome="scored")
            jpeg = {"content-type": "image/jpeg"}
            there = httpx.post(server.url + "/score", content=frame.getvalue(), headers=jpeg).json()
            on_cpu = httpx.post(server.url + "/score?heatmap=true", content=frame.getvalue(), headers=jpeg).json()
    finally:
        receiver.server.shutdown()
    assert state["status"] == "ready" and "press" in state["lines"]
    assert "press" in json.dumps(listed)
    assert scored == len(pictures)  # once each: the line runs in the scoring process only
    assert sorted(b["source"] for b in receiver.bodies) == sorted(f"part-{i:02d}.png" for i in range(len(pictures)))
    assert there["raw_score"] == pytest.approx(on_cpu["raw_score"], rel=1e-2)
    assert there["is_anomaly"] == on_cpu["is_anomaly"] and "heatmap" in on_cpu


def test_the_keys_are_in_no_file_and_a_supervisor_killed_leaves_a_folder_the_next_start_sweeps(
    model_file, dataset, tmp_path
):
    """The keys reach each child through a pipe, also a replaced one, and never wait in the run folder (tmpfs); a
    supervisor killed with SIGKILL cannot remove its folder, and the next start removes it, saying so."""
    from padim.service.processes.shared import shared_memory_root

    key = f"key-{os.urandom(8).hex()}"
    env = {"PADIM_API_KEY": key}

    def holding_the_key(folder: Path) -> list[Path]:
        return [p for p in folder.rglob("*") if p.is_file() and not p.is_socket() and key.encode() in p.read_bytes()]

    with running_server(tmp_path, [model_file], env=env, args=("--workers", "2")) as server:
        supervisor = server.process.pid
        (folder,) = shared_memory_root().glob(f"padim-*-{supervisor}-*")
        assert holding_the_key(folder) == []
        killed = roles(supervisor)["api-1"]
        os.kill(killed, signal.SIGKILL)
        wait_until(lambda: roles(supervisor).get("api-1") not in (None, killed), 60, "a new API process 1")
        wait_until(lambda: ready(server.url).status_code == 200, 90, "the replacement to be ready")
        # new connections, each to whichever API process accepts it: the replaced one too knows the key it was handed
        sent = [key] * 8 + ["wrong"] * 2
        statuses = [
            httpx.post(
                server.url + "/score", content=probe(dataset), headers={**PNG, "x-api-key": k, "connection": "close"}
            ).status_code
            for k in sent
        ]
        assert statuses == [200] * 8 + [401] * 2 and holding_the_key(folder) == []
        children = list(roles(supervisor).values())
        os.kill(supervisor, signal.SIGKILL)
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 60, "the children to end")
        assert folder.is_dir()  # nobody was left to remove it
    with running_server(tmp_path, [model_file], env=env, args=("--workers", "2")) as again:
        logs = again.logs()
    assert not folder.exists() and "removed the run folders of 1 supervisor(s) that are gone" in logs
    assert folder.name in logs
