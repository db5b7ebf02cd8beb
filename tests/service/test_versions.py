"""Models that change while the line runs: upload, activate, roll back, remove and unload without a restart.

Real files in a real repository; the swap under load, the kill -9 cases and the memory check run a real
`padim serve` process on 127.0.0.1; the held-batch and refusal cases run in-process (TestClient), where a
batch can be held in the queue across a swap.
"""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers import IMAGE_SIZE, SCORE_RTOL, metric, run_cli, running_server, wait_until

from padim.models.fit.model_file import served_bytes
from padim.models.repository import Repository
from padim.service.app import create_app
from padim.service.settings import ServiceSettings

ADMIN, SCORING = "admin-key", "scoring-key"
OCTET = {"content-type": "application/octet-stream"}


@pytest.fixture(scope="module")
def predicted(model_file, second_model, dataset, tmp_path_factory) -> dict[str, dict]:
    """``padim predict``'s raw score of the probe image under each model file, on the runtime the servers here run
    (torch: the float32 scorer): the references."""
    references = {}
    for key, path in (("first", model_file), ("second", second_model)):
        out = tmp_path_factory.mktemp(f"predict-{key}")
        probe = dataset / "test" / "good" / "000.png"
        run_cli("-q", "predict", path, probe, "--output", out, "--device", "cpu", "--runtime", "torch")
        references[key] = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert abs(references["first"]["raw_score"] - references["second"]["raw_score"]) > 1e-3  # tell them apart
    return references


def repository_with(tmp_path: Path, *models: Path) -> Path:
    root = tmp_path / "repo"
    repository = Repository(root)
    for model in models:
        repository.activate("weave", repository.add("weave", model).version)
    return root


def probe(dataset) -> bytes:
    return (dataset / "test" / "good" / "000.png").read_bytes()


def score(client, dataset, key=SCORING) -> dict:
    response = client.post("/score", content=probe(dataset), headers={"content-type": "image/png", "x-api-key": key})
    assert response.status_code == 200, response.text
    return response.json()


def wait_ready(client) -> None:
    for _ in range(600):
        if client.get("/health/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("not ready")


def in_process(root: Path, **settings):
    settings = {
        "repository": root,
        "admin_key": ADMIN,
        "api_key": SCORING,
        "device": "cpu",
        "runtime": "torch",
        **settings,
    }
    return TestClient(create_app(ServiceSettings(**settings)))


# --------------------------------------------------------------------------- a real server under load
@pytest.mark.load_sensitive
@pytest.mark.parametrize("workers", [1, 2])
def test_upload_activate_and_roll_back_under_load_fail_no_request(
    model_file, second_model, predicted, dataset, tmp_path, workers
):
    """In one process, and with two API processes beside the scoring one: an activation is seen by every API
    process at once, and each answer is scored and judged by the version it names."""
    root = repository_with(tmp_path, model_file)
    env = {"PADIM_ADMIN_KEY": ADMIN, "PADIM_API_KEY": SCORING, "PADIM_RUNTIME": "torch"}
    answers: list[tuple[float, float, int, dict]] = []  # (sent, answered, status, body)
    stop = threading.Event()
    args = ("--repository", str(root), "--device", "cpu", "--workers", str(workers))
    with running_server(tmp_path, [], env=env, args=args) as server:

        def client() -> None:
            with httpx.Client(base_url=server.url, timeout=30, headers={"x-api-key": SCORING}) as http:
                deadline = time.monotonic() + 60  # bounded in time, whatever happens to the main thread
                while not stop.is_set() and time.monotonic() < deadline and len(answers) < 2000:
                    sent = time.monotonic()
                    response = http.post("/score", content=probe(dataset), headers={"content-type": "image/png"})
                    answers.append((sent, time.monotonic(), response.status_code, response.json()))

        threads = [threading.Thread(target=client) for _ in range(4)]
        for thread in threads:
            thread.start()
        admin = httpx.Client(base_url=server.url, timeout=120, headers={"x-api-key": ADMIN})
        time.sleep(1.0)
        activate_sent = time.monotonic()
        uploaded = admin.post(
            "/models/weave/versions",
            params={"activate": "true"},
            content=second_model.read_bytes(),
            headers={**OCTET, "x-content-sha256": hashlib.sha256(second_model.read_bytes()).hexdigest()},
        )
        activated = time.monotonic()
        assert uploaded.status_code == 201, uploaded.text
        assert uploaded.json()["version"] == 2 and uploaded.json()["active"]
        time.sleep(1.5)
        rollback_sent = time.monotonic()
        rolled = admin.post("/models/weave/rollback")
        rolled_back = time.monotonic()
        assert rolled.status_code == 200 and rolled.json()["version"] == 1, rolled.text
        time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(90)
        listed = admin.get("/models/weave/versions").json()["versions"]
        swaps = metric(server.url, "padim_model_changes_total", model="weave", change="activate")
        rollbacks = metric(server.url, "padim_model_changes_total", model="weave", change="rollback")
        by_version = {
            v: metric(server.url, "padim_verdicts_total", model="weave", version=str(v), verdict="normal")
            + metric(server.url, "padim_verdicts_total", model="weave", version=str(v), verdict="anomalous")
            for v in (1, 2)
        }
        logs = server.logs()
    assert answers and all(status == 200 for _, _, status, _ in answers), [a for a in answers if a[2] != 200][:3]
    reference = {1: predicted["first"]["raw_score"], 2: predicted["second"]["raw_score"]}
    seen = {1: 0, 2: 0}
    for sent, answered, _, body in answers:
        version = body["model"]["version"]
        assert body["raw_score"] == pytest.approx(reference[version], rel=SCORE_RTOL)  # scored by the version it names
        seen[version] += 1
        if answered < activate_sent or sent > rolled_back:
            assert version == 1, (sent, answered, body["model"])
        elif activated < sent and answered < rollback_sent:
            assert version == 2, (sent, answered, body["model"])
    assert seen[1] > 0 and seen[2] > 0
    assert [(v["version"], v["active"]) for v in listed] == [(1, True), (2, False)]
    assert (swaps, rollbacks) == (1, 1)
    assert by_version[1] + by_version[2] == len(answers) and by_version[2] == seen[2]
    assert "Traceback" not in logs


# --------------------------------------------------------------------------- inside the server
def test_a_batch_held_in_the_queue_across_a_swap_is_scored_and_judged_by_the_version_that_admitted_it(
    model_file, second_model, predicted, dataset, tmp_path
):
    root = repository_with(tmp_path, model_file)
    with in_process(root) as client:
        wait_ready(client)
        state = client.app.state.service
        release = threading.Event()
        held = state.scheduler.call(lambda: release.wait(30))  # the device's one thread is busy: batches wait
        result: dict = {}
        waiting = threading.Thread(target=lambda: result.update(score(client, dataset)))
        waiting.start()
        for _ in range(200):  # admitted by version 1 and waiting for the device
            if state.models["weave"].in_flight == 1:
                break
            time.sleep(0.02)
        first = state.models["weave"]
        assert first.in_flight == 1
        uploaded = client.post(
            "/models/weave/versions?activate=true",
            content=second_model.read_bytes(),
            headers={**OCTET, "x-api-key": ADMIN},
        )
        assert uploaded.status_code == 201 and state.models["weave"].version == 2  # swapped while the batch waits
        assert first.retired and first in state.retired and not first.batcher.closed
        release.set()
        held.result(30)
        waiting.join(30)
        assert result["model"]["version"] == 1
        assert result["raw_score"] == pytest.approx(predicted["first"]["raw_score"], rel=SCORE_RTOL)
        assert result["score"] == pytest.approx(
            predicted["first"]["score"], abs=1e-6
        )  # judged by version 1's calibration
        after = score(client, dataset)
        assert after["model"]["version"] == 2
        assert after["raw_score"] == pytest.approx(predicted["second"]["raw_score"], rel=SCORE_RTOL)
        assert after["score"] == pytest.approx(predicted["second"]["score"], abs=1e-6)
        for _ in range(200):  # the drained version is closed and let go
            if not state.retired:
                break
            time.sleep(0.02)
        assert not state.retired and first.scorer is None
        monitor = client.get("/models/weave/monitor", headers={"x-api-key": SCORING}).json()
        assert monitor["version"] == 2 and monitor["recorded"] == 1  # a new version starts a new window


def test_bad_input_changes_nothing(model_file, second_model, dataset, tmp_path):
    root = repository_with(tmp_path, model_file)
    partial = tmp_path / "partial.padim"
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        partial,
        "--weights",
        "random",
        "--image-size",
        IMAGE_SIZE,
        "--partial",
    )
    body = second_model.read_bytes()
    admin = {"x-api-key": ADMIN}
    with in_process(root) as client:
        wait_ready(client)
        before = score(client, dataset)

        def refused(response, status: int, code: str) -> None:
            assert response.status_code == status, response.text
            assert response.json()["error"]["code"] == code, response.text
            assert str(tmp_path) not in response.text  # no server paths
            now = score(client, dataset)
            assert now["model"] == before["model"] and now["raw_score"] == before["raw_score"]

        upload = "/models/weave/versions"
        refused(client.post(upload, content=body[: len(body) // 2], headers={**OCTET, **admin}), 422, "invalid_model")
        refused(client.post(upload, content=b"\0" * 4096, headers={**OCTET, **admin}), 422, "invalid_model")
        refused(client.post(upload, content=partial.read_bytes(), headers={**OCTET, **admin}), 422, "invalid_model")
        refused(
            client.post(upload, content=body, headers={**OCTET, **admin, "x-content-sha256": "0" * 64}),
            400,
            "digest_mismatch",
        )
        refused(
            client.post(upload, content=body, headers={"content-type": "image/png", **admin}),
            415,
            "unsupported_media_type",
        )
        refused(client.post(upload, content=b"", headers={**OCTET, **admin}), 422, "empty_body")
        refused(client.post("/models/weave/versions/9/activate", headers=admin), 404, "version_not_found")
        refused(client.post("/models/other/versions/1/activate", headers=admin), 404, "version_not_found")
        refused(client.post("/models/weave/rollback", headers=admin), 409, "nothing_to_roll_back")
        refused(client.delete("/models/weave/versions/1", headers=admin), 409, "version_active")
        refused(client.delete("/models/weave", headers=admin), 409, "default_model")
        refused(client.post("/models/a%20b/versions", content=body, headers={**OCTET, **admin}), 422, "invalid_request")
        assert [v.version for v in Repository(root).versions("weave")] == [1]  # nothing committed
        assert not list((root / "weave").glob(".incoming-*"))  # nothing left behind
        assert Repository(root).active("weave") == 1

        # two activations racing: one goes through, the other is told another change is under way
        assert client.post(upload, content=body, headers={**OCTET, **admin}).status_code == 201
        answers: list = []
        racers = [
            threading.Thread(
                target=lambda: answers.append(client.post("/models/weave/versions/2/activate", headers=admin))
            )
            for _ in range(2)
        ]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(60)
        assert sorted(a.status_code for a in answers) in ([200, 200], [200, 409])
        assert all(a.json()["error"]["code"] == "model_busy" for a in answers if a.status_code == 409)
        assert score(client, dataset)["model"]["version"] == 2


def test_a_fixed_set_of_models_cannot_be_changed(model_file, dataset):
    with TestClient(create_app(ServiceSettings(models=[model_file], admin_key=ADMIN, device="cpu"))) as client:
        wait_ready(client)
        for response in (
            client.post(
                "/models/weave/versions", content=model_file.read_bytes(), headers={**OCTET, "x-api-key": ADMIN}
            ),
            client.post("/models/weave/rollback", headers={"x-api-key": ADMIN}),
            client.post("/models/weave/versions/1/activate", headers={"x-api-key": ADMIN}),
        ):
            assert response.status_code == 409 and response.json()["error"]["code"] == "read_only_models", response.text
            assert "PADIM_REPOSITORY" in response.json()["error"]["message"]
        listed = client.get("/models/weave/versions", headers={"x-api-key": ADMIN}).json()["versions"]
        assert [(v["version"], v["active"]) for v in listed] == [(1, True)]


def test_the_scoring_key_cannot_change_models_and_without_an_admin_key_the_routes_do_not_exist(
    model_file, dataset, tmp_path
):
    root = repository_with(tmp_path, model_file)
    with in_process(root) as client:
        wait_ready(client)
        for headers, status in (
            ({"x-api-key": SCORING}, 403),
            ({"authorization": f"Bearer {SCORING}"}, 403),
            ({}, 401),
            ({"x-api-key": "wrong"}, 401),
        ):
            for method, path in (
                ("get", "/models/weave/versions"),
                ("post", "/models/weave/rollback"),
                ("delete", "/models/weave"),
                ("post", "/models/weave/versions/1/activate"),
            ):
                response = getattr(client, method)(path, headers=headers)
                assert response.status_code == status, (method, path, response.text)
        assert score(client, dataset, key=ADMIN)["model"]["version"] == 1  # the admin key opens every route
        assert client.get("/models/weave/versions", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 200
        document = client.get("/openapi.json").json()
        assert document["paths"]["/models/{name}/versions"]["post"]["security"]
        assert "403" in document["paths"]["/models/{name}/rollback"]["post"]["responses"]
    with in_process(root, admin_key=None) as client:
        wait_ready(client)
        assert client.post("/models/weave/rollback", headers={"x-api-key": SCORING}).status_code == 404
        assert not [p for p in client.get("/openapi.json").json()["paths"] if "versions" in p or "rollback" in p]
    with pytest.raises(ValueError, match="must differ"):
        ServiceSettings(repository=root, admin_key="same", api_key="same")
    refused = run_cli(
        "serve", "--repository", root, env={"PADIM_ADMIN_KEY": "same", "PADIM_API_KEY": "same"}, check=False
    )
    assert refused.returncode == 1 and "must differ" in refused.stderr


def test_an_empty_repository_serves_the_first_upload(second_model, dataset, tmp_path):
    with in_process(tmp_path / "empty") as client:
        wait_ready(client)
        assert client.get("/models", headers={"x-api-key": SCORING}).json() == {
            "default": None,
            "models": [],
            "record": False,
        }
        response = client.post(
            "/score", content=probe(dataset), headers={"content-type": "image/png", "x-api-key": SCORING}
        )
        assert response.status_code == 404 and "upload" in response.json()["error"]["message"]
        created = client.post(
            "/models/line3/versions?activate=true",
            content=second_model.read_bytes(),
            headers={**OCTET, "x-api-key": ADMIN},
        )
        assert created.status_code == 201 and created.json()["version"] == 1
        assert score(client, dataset)["model"] == {**score(client, dataset)["model"], "name": "line3", "version": 1}
        described = client.get("/models", headers={"x-api-key": SCORING}).json()
        assert described["default"] == "line3" and described["models"][0]["versions"][0]["active"]


def test_a_version_copied_into_the_repository_is_picked_up_by_the_poll(model_file, second_model, dataset, tmp_path):
    root = repository_with(tmp_path, model_file)
    with in_process(root, repository_poll_s=0.2) as client:
        wait_ready(client)
        assert score(client, dataset)["model"]["version"] == 1
        staging = tmp_path / "staging"
        staging.mkdir()
        (staging / "model.padim").write_bytes(second_model.read_bytes())
        staging.rename(root / "weave" / "2")  # cp elsewhere, then mv in: no reader sees half a file
        (root / "weave" / "ACTIVE").write_text("2\n")
        for _ in range(300):
            if client.app.state.service.models["weave"].version == 2:
                break
            time.sleep(0.05)
        assert score(client, dataset)["model"]["version"] == 2


def test_a_load_that_does_not_fit_in_memory_is_refused_before_it_starts(
    model_file, second_model, dataset, tmp_path, monkeypatch
):
    import padim.service.state.loading as state_module

    root = repository_with(tmp_path, model_file)
    with in_process(root) as client:
        wait_ready(client)
        held = served_bytes(second_model)  # the tensors a served version holds (the statistics stay on disk)
        monkeypatch.setattr(state_module, "available_memory", lambda device: (held, "this machine"))
        response = client.post(
            "/models/weave/versions?activate=true",
            content=second_model.read_bytes(),
            headers={**OCTET, "x-api-key": ADMIN},
        )
        assert response.status_code == 507 and response.json()["error"]["code"] == "insufficient_memory"
        assert "MiB" in response.json()["error"]["message"]
        assert score(client, dataset)["model"]["version"] == 1
        assert [v.version for v in Repository(root).versions("weave")] == [1]


# --------------------------------------------------------------------------- kill -9
@pytest.mark.load_sensitive  # the kill must land inside an activation that exports for seconds
def test_kill_9_during_an_upload_and_during_an_activation_keeps_the_previous_version(
    model_file, second_model, dataset, tmp_path
):
    root = repository_with(tmp_path, model_file)
    # version 2 is added offline; activating it exports it for ONNX Runtime first (seconds): a kill lands mid-way
    run_cli("-q", "repository", "add", root, "weave", second_model)
    env = {"PADIM_ADMIN_KEY": ADMIN, "PADIM_RUNTIME": "onnxruntime", "PADIM_CACHE_DIR": str(tmp_path / "cache")}
    args = ("--repository", str(root), "--device", "cpu")

    def served_version(url: str) -> int:
        return httpx.post(url + "/score", content=probe(dataset), headers={"content-type": "image/png"}).json()[
            "model"
        ]["version"]

    with running_server(tmp_path, [], env=env, args=args) as server:
        body = second_model.read_bytes()
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as upload:  # half a body, then the server dies
            upload.sendall(
                f"POST /models/weave/versions?activate=true HTTP/1.1\r\nHost: x\r\nX-API-Key: {ADMIN}\r\n"
                f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            )
            upload.sendall(body[: len(body) // 2])
            for _ in range(100):
                if list((root / "weave").glob(".incoming-*/model.padim")):
                    break
                time.sleep(0.05)
            assert list((root / "weave").glob(".incoming-*/model.padim"))  # the upload was being written
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(30)

    with running_server(tmp_path, [], env=env, args=args) as server:
        assert served_version(server.url) == 1
        assert [v.version for v in Repository(root).versions("weave")] == [1, 2]  # the half upload is no version

        answered: list[int] = []

        def activate() -> None:
            try:
                answer = httpx.post(
                    server.url + "/models/weave/versions/2/activate", headers={"x-api-key": ADMIN}, timeout=60
                )
                answered.append(answer.status_code)
            except httpx.TransportError:  # the server is killed before it answers: that is the point
                pass

        activation = threading.Thread(target=activate, daemon=True)
        activation.start()
        # the kill lands while version 2 is being exported beside version 1 (its staging folder in the repository's
        # cache), not before the activation began nor after it was done
        exports = Repository(root).cache_root("weave")
        wait_until(lambda: list(exports.glob(".*.tmp-*")), 60, "version 2's export to begin")
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
        assert not answered, f"the activation was answered ({answered}) before the kill"
    assert (root / "weave" / "ACTIVE").read_text() == "1\n"

    with running_server(tmp_path, [], env=env, args=args) as server:
        assert served_version(server.url) == 1
        again = httpx.post(server.url + "/models/weave/versions/2/activate", headers={"x-api-key": ADMIN}, timeout=120)
        assert again.status_code == 200, again.text  # what the kill left (a cache half made) does not stand in the way
        assert served_version(server.url) == 2


# --------------------------------------------------------------------------- memory
def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.load_sensitive
def test_memory_after_ten_swaps_stays_within_one_model_of_the_start(model_file, second_model, dataset, tmp_path):
    """Runtime: torch on the CPU (PADIM_RUNTIME=torch)."""
    root = repository_with(tmp_path, model_file, second_model)
    env = {"PADIM_ADMIN_KEY": ADMIN, "PADIM_RUNTIME": "torch"}
    args = ("--repository", str(root), "--device", "cpu")
    with running_server(tmp_path, [], env=env, args=args, fresh=True) as server:  # its memory: a fresh interpreter
        admin = httpx.Client(base_url=server.url, timeout=120, headers={"x-api-key": ADMIN})

        def swap_to(version: int) -> None:
            assert admin.post(f"/models/weave/versions/{version}/activate").status_code == 200
            for _ in range(5):
                assert (
                    httpx.post(
                        server.url + "/score", content=probe(dataset), headers={"content-type": "image/png"}
                    ).json()["model"]["version"]
                    == version
                )

        # each version loaded twice before counting: the allocator's pools and the imports are warm (after one
        # round, the first of the ten swaps measured still grew by a model's worth now and then)
        for version in (1, 2, 1, 2, 1):
            swap_to(version)
        start = _rss(server.process.pid)
        for i in range(10):
            swap_to(2 if i % 2 == 0 else 1)
        time.sleep(1.0)  # the last retired version drains
        end = _rss(server.process.pid)
        loaded = metric(server.url, "padim_model_versions_loaded", model="weave")
    model_size = max(model_file.stat().st_size, second_model.stat().st_size)
    assert loaded == 1
    assert end - start < model_size, (
        f"RSS grew {(end - start) / 2**20:.1f} MiB over ten swaps (model {model_size / 2**20:.1f} MiB)"
    )


def test_a_model_upload_has_its_own_size_limit_and_the_pictures_keep_theirs(model_file, dataset, tmp_path):
    root = repository_with(tmp_path, model_file)
    size = model_file.stat().st_size
    with in_process(root, max_model_upload_bytes=size - 1, max_upload_bytes=100_000) as client:
        wait_ready(client)
        too_large = client.post(
            "/models/weave/versions", content=model_file.read_bytes(), headers={**OCTET, "x-api-key": ADMIN}
        )
        assert too_large.status_code == 413 and "PADIM_MAX_MODEL_UPLOAD_BYTES" in too_large.json()["error"]["message"]
        picture = client.post(
            "/score", content=b"\0" * 200_000, headers={"content-type": "image/png", "x-api-key": SCORING}
        )
        assert picture.status_code == 413 and "PADIM_MAX_UPLOAD_BYTES" in picture.json()["error"]["message"]
    with in_process(
        root, max_model_upload_bytes=size, max_upload_bytes=100_000
    ) as client:  # far over the picture limit
        wait_ready(client)
        assert (
            client.post(
                "/models/weave/versions", content=model_file.read_bytes(), headers={**OCTET, "x-api-key": ADMIN}
            ).status_code
            == 201
        )
        assert not list((root / "weave").glob(".incoming-*"))
