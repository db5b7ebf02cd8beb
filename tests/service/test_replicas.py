"""Two replicas of the service on this machine behind a real load balancer (haproxy, tests/haproxy.py), sharing one
repository folder, one record folder and one real PostgreSQL, as the Helm chart runs them on a cluster.

Under a bounded load through the balancer: a version activated through one replica is served by both within the
poll and a load, with no failed request; an update job runs once across replicas and its state answers on each;
a replica killed with kill -9 costs at most the requests in flight on it (the balancer retries the rest), the
replica started in its place adopts its journal, and every answered picture is one row of the one record."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
import sqlalchemy as sa
from haproxy import Balancer
from helpers import closed_loop, free_port, metric, running_server, wait_until

from padim.models.repository import Repository
from padim.service.record.store import database_url

ADMIN = "admin-key"
CLIENTS = 3
pytestmark = [pytest.mark.postgres, pytest.mark.haproxy, pytest.mark.load_sensitive, pytest.mark.system]


def served_version(url: str, picture: bytes, scored: list[int]) -> int:
    scored.append(1)  # a row of the record too
    response = httpx.post(url + "/score", content=picture, headers={"content-type": "image/png"}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["model"]["version"]


def test_two_replicas_share_versions_jobs_and_one_record(model_file, second_model, dataset, postgres_cluster, tmp_path):
    root = tmp_path / "repository"
    repository = Repository(root)
    repository.activate("weave", repository.add("weave", model_file).version)
    repository.add("weave", second_model)  # version 2, not active
    record_dir, url = tmp_path / "record", postgres_cluster.new_database()
    pictures = [p.read_bytes() for p in sorted((dataset / "test" / "good").glob("*.png"))[:12]]
    ports = {name: free_port() for name in "abc"}  # c takes b's place after the kill

    def replica(name: str):
        env = {
            "PADIM_REPOSITORY": str(root),
            "PADIM_REPOSITORY_POLL_S": "0.5",
            "PADIM_RECORD_DIR": str(record_dir),
            "PADIM_RECORD_URL": url,
            "PADIM_REPLICA": name,
            "PADIM_RECORD_REQUIRED": "true",  # an answered picture has a durable row: the count below is exact
            "PADIM_ADMIN_KEY": ADMIN,
            "PADIM_RUNTIME": "torch",
            "PADIM_DEVICE": "cpu",
        }
        return running_server(tmp_path, [], env=env, port=ports[name])

    answers: list[tuple[float, int, int | None]] = []  # (answered, status or 0 for no answer, version)
    probes: list[int] = []  # pictures scored by the test itself
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(replica("a"))
        b = stack.enter_context(replica("b"))
        balancer = stack.enter_context(Balancer(tmp_path, ports))
        wait_until(lambda: served_version(balancer.url, pictures[0], probes) == 1, 10, "the balancer to pass requests")
        assert httpx.get(b.url + "/health/ready").json()["replica"] == "b"  # which replica answers
        threads = closed_loop(balancer.url, pictures, CLIENTS, 90, answers, stop, limit=1500)
        time.sleep(1.0)

        # an activation through a reaches b through the shared repository (b polls it), under load
        activated = httpx.post(a.url + "/models/weave/versions/2/activate", headers={"x-api-key": ADMIN}, timeout=120)
        assert activated.status_code == 200, activated.text
        asked = time.monotonic()
        wait_until(lambda: served_version(b.url, pictures[0], probes) == 2, 60, "b to serve version 2")
        reached = time.monotonic()
        print(f"activation through a reached b in {reached - asked:.2f} s")
        time.sleep(1.0)
        before_kill = len(answers)
        assert before_kill > 20 and all(status == 200 for _, status, _ in answers[:before_kill]), answers
        assert all(version == 2 for answered, _, version in answers[:before_kill] if answered > reached + 0.5)

        # an update job runs on one replica; the other refuses a second one and answers for the first
        with sa.create_engine(database_url(url, None)).connect() as connection:
            record_id = connection.execute(sa.text("SELECT id FROM records WHERE version = 2 LIMIT 1")).scalar()
        reviewed = httpx.post(
            f"{b.url}/records/{record_id}/review", json={"label": "normal"}, headers={"x-api-key": ADMIN}
        )
        assert reviewed.status_code == 200, reviewed.text
        started = httpx.post(a.url + "/models/weave/update", headers={"x-api-key": ADMIN}, timeout=60)
        assert started.status_code == 202, started.text
        second = httpx.post(b.url + "/models/weave/update", headers={"x-api-key": ADMIN}, timeout=60)
        job = started.json()["id"]
        assert second.status_code == 409 and second.json()["error"]["code"] == "model_busy", second.text
        assert "another replica" in second.json()["error"]["message"]
        answered = httpx.get(f"{b.url}/jobs/{job}", headers={"x-api-key": ADMIN})
        assert answered.status_code == 200 and answered.json()["model"] == "weave", answered.text
        committed_by_b = metric(b.url, "padim_record_rows_total", outcome="journaled")
        assert committed_by_b > 0

        # kill -9 b under load: the balancer takes it out and retries what it can; c starts in its place
        killed = time.monotonic()  # before the signal: b's connections close while its exit runs, before wait() returns
        b.process.kill()
        b.process.wait()
        c = stack.enter_context(replica("c"))
        wait_until(lambda: not (record_dir / "journal" / "b").exists(), 60, "b's journal to be adopted")
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(120)
        failed = [(t, status) for t, status, _ in answers if status != 200]
        print(f"{len(answers)} requests, {len(failed)} failed, all after the kill: {failed}")
        assert len(failed) <= CLIENTS and all(t >= killed for t, _ in failed), failed
        assert metric(c.url, "padim_record_rows_total", outcome="journaled") > 0
        answered_on_c = httpx.get(f"{c.url}/jobs/{job}", headers={"x-api-key": ADMIN})
        assert answered_on_c.status_code == 200, answered_on_c.text

        # every answered picture is a row of the one record (a request b had journaled when it died, and the
        # balancer then retried, may be there twice: at most one a client)
        successes = sum(status == 200 for _, status, _ in answers) + len(probes)
        engine = sa.create_engine(database_url(url, None))

        def rows() -> int:
            with engine.connect() as connection:
                return connection.execute(sa.text("SELECT count(*) FROM records")).scalar()

        wait_until(lambda: rows() >= successes, 30, "every answered picture's row in PostgreSQL")
        assert rows() <= successes + CLIENTS
        engine.dispose()
