"""Against a real `padim serve` (uvicorn) process on 127.0.0.1."""

import base64
import io
import json
import signal
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from helpers import SCORE_ATOL, SCORE_RTOL, assert_same_verdict, copy_model, run_cli, running_server
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from padim.core.artifact import FORMAT_VERSION, read_header


def post_image(url: str, path, **params) -> httpx.Response:
    with open(path, "rb") as handle:
        return httpx.post(url + "/score", files={"file": (path.name, handle, "image/png")}, params=params, timeout=60)


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def test_good_and_defective_verdicts(server, dataset):
    good = post_image(server.url, dataset / "test" / "good" / "000.png")
    bad = post_image(server.url, dataset / "test" / "hole" / "000.png", heatmap="true", mask="true")
    assert good.status_code == 200 and bad.status_code == 200
    g, b = good.json(), bad.json()
    assert g["is_anomaly"] is False and g["score"] < 0.5 and "heatmap" not in g
    assert b["is_anomaly"] is True and b["score"] > 0.5 and 0 < b["anomalous_area"] < 1
    assert b["model"]["name"] == "weave" and len(b["model"]["sha256"]) == 64 and "RANDOM" in b["model"]["weights"]
    assert b["latency_ms"] > 0
    heat = Image.open(io.BytesIO(base64.b64decode(b["heatmap"])))
    mask = np.asarray(Image.open(io.BytesIO(base64.b64decode(b["mask"]))))
    assert heat.size == (96, 96) and mask.shape == (96, 96)
    assert set(np.unique(mask)) <= {0, 255} and (mask == 255).any()
    assert good.headers["x-request-id"]


def test_raw_body_and_named_model_and_threshold_override(server, dataset):
    data = (dataset / "test" / "stain" / "001.png").read_bytes()
    raw = httpx.post(server.url + "/score", content=data, headers={"content-type": "image/png"})
    named = httpx.post(server.url + "/models/weave/score", content=data, headers={"content-type": "image/png"})
    assert raw.json()["raw_score"] == pytest.approx(named.json()["raw_score"], rel=1e-6)
    strict = httpx.post(
        server.url + "/score", content=data, headers={"content-type": "image/png"}, params={"threshold": 1.0}
    )
    lenient = httpx.post(server.url + "/score", files={"file": ("x.png", data)}, data={"threshold": "0"})
    assert (
        strict.json()["is_anomaly"] is False
        and strict.json()["threshold"] == 1.0
        and strict.json()["anomalous_area"] == 0.0
    )
    assert lenient.json()["is_anomaly"] is True and lenient.json()["anomalous_area"] == 1.0


def test_octet_stream_body_is_scored_like_an_image_body(server, dataset):
    data = (dataset / "test" / "hole" / "000.png").read_bytes()
    typed = httpx.post(server.url + "/score", content=data, headers={"content-type": "image/png"})
    untyped = httpx.post(server.url + "/score", content=data, headers={"content-type": "application/octet-stream"})
    assert typed.status_code == untyped.status_code == 200
    assert untyped.json()["raw_score"] == pytest.approx(typed.json()["raw_score"], rel=SCORE_RTOL)  # two batches


def test_threshold_zero_or_one_has_no_raw_value_and_says_so(server, dataset):
    data = (dataset / "test" / "good" / "000.png").read_bytes()
    for threshold, anomalous in ((0.0, True), (1.0, False)):
        answer = httpx.post(
            server.url + "/score", content=data, headers={"content-type": "image/png"}, params={"threshold": threshold}
        ).json()
        assert answer["raw_threshold"] is None and answer["is_anomaly"] is anomalous


@pytest.fixture(scope="module")
def predicted(dataset, tmp_path_factory):
    """``padim predict`` of the test pictures by a model and a runtime (``None``: its default), each pair predicted
    once a module: the records by picture path."""
    done: dict[tuple[str, str | None], dict[str, dict]] = {}

    def predict(model, runtime: str | None = None) -> dict[str, dict]:
        key = (str(model), runtime)
        if key not in done:
            out = tmp_path_factory.mktemp("predicted")
            flags = ("--runtime", runtime) if runtime else ()
            run_cli("-q", "predict", model, dataset / "test", "--output", out, "--no-heatmaps", "--no-maps", *flags)
            records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
            done[key] = {record["path"]: record for record in records}
        return done[key]

    return predict


def test_parity_with_padim_predict(server, model_file, predicted):
    from pathlib import Path

    for path, record in predicted(model_file).items():
        got = post_image(server.url, Path(path)).json()
        assert got["raw_score"] == pytest.approx(record["raw_score"], rel=1e-5)
        assert got["score"] == pytest.approx(record["score"], abs=SCORE_ATOL)
        assert_same_verdict(got, record)


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime", "openvino", "export"])
def test_predict_and_serve_agree_under_every_runtime(runtime, model_file, model_export, predicted, tmp_path):
    """Each runtime: serve equals predict on it (1e-5), and both equal torch (1e-4 relative)."""
    from pathlib import Path

    model, flags = model_file, ("--runtime", runtime)
    if runtime == "export":  # an export directory, served and predicted as it is (auto: onnxruntime)
        model, flags = model_export, ()
    records = predicted(model, None if runtime == "export" else runtime)
    torch_scores = {path: record["raw_score"] for path, record in predicted(model_file, "torch").items()}
    with running_server(tmp_path, [model], args=flags) as served:
        described = httpx.get(served.url + "/models").json()["models"][0]
        assert described["runtime"] == ("onnxruntime" if runtime == "export" else runtime)
        for path, record in records.items():
            got = post_image(served.url, Path(path)).json()
            assert got["raw_score"] == pytest.approx(record["raw_score"], rel=1e-5)
            assert_same_verdict(got, record)
            assert record["raw_score"] == pytest.approx(torch_scores[path], rel=1e-4)


def test_batch_endpoint_keeps_order(server, dataset):
    paths = [dataset / "test" / d / "000.png" for d in ("good", "hole", "scratch", "good")]
    files = [("file", (p.name, p.read_bytes(), "image/png")) for p in paths]
    response = httpx.post(server.url + "/score/batch", files=files, timeout=60)
    assert response.status_code == 200
    results = response.json()["results"]
    singles = [post_image(server.url, p).json()["raw_score"] for p in paths]
    assert [r["raw_score"] for r in results] == pytest.approx(singles, rel=1e-5)


@pytest.mark.load_sensitive
def test_64_concurrent_requests_equal_their_sequential_scores(server, dataset):
    """Every other request asks for a mask too: each picture's map comes back (through shared memory, with API
    processes) as its own, whatever else is in flight."""
    paths = sorted((dataset / "test").rglob("*.png"))
    paths = (paths * 4)[:64]
    sequential = {p: post_image(server.url, p, mask="true").json() for p in set(paths)}
    with ThreadPoolExecutor(64) as pool:
        responses = list(
            pool.map(
                lambda ip: post_image(server.url, ip[1], **({"mask": "true"} if ip[0] % 2 else {})), enumerate(paths)
            )
        )
    assert all(r.status_code == 200 for r in responses)
    for i, (path, response) in enumerate(zip(paths, responses, strict=True)):
        # batches of any composition give the same score, to float32 round-off
        assert response.json()["raw_score"] == pytest.approx(sequential[path]["raw_score"], rel=1e-5)
        if i % 2:
            mask, alone = (
                np.asarray(Image.open(io.BytesIO(base64.b64decode(r["mask"]))))
                for r in (response.json(), sequential[path])
            )
            assert (mask != alone).mean() < 0.01, path
    metrics = httpx.get(server.url + "/metrics").text
    sizes = {
        s.labels.get("le"): s.value
        for f in text_string_to_metric_families(metrics)
        if f.name == "padim_batch_size"
        for s in f.samples
        if s.name.endswith("_bucket")
    }
    assert sizes["1.0"] < sizes["+Inf"], "concurrent requests should have been batched together"


def truncated_png(dataset) -> bytes:
    data = (dataset / "test" / "good" / "000.png").read_bytes()
    return data[: len(data) // 2]


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header announcing a huge image, with a tiny body."""

    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    "case, status, code",
    [
        ("empty", 422, "empty_body"),
        ("not_image", 422, "invalid_image"),
        ("truncated_png", 422, "invalid_image"),
        ("truncated_jpeg", 422, "invalid_image"),
        ("text_type", 415, "unsupported_media_type"),
        ("no_file_field", 422, "missing_file"),
        ("too_large", 413, "payload_too_large"),
        ("too_large_chunked", 413, "payload_too_large"),
        ("bomb", 413, "image_too_large"),
        ("absurd_bomb", 413, "image_too_large"),
        ("batch_over_limit", 422, "batch_too_large"),
        ("two_files_to_score", 422, "too_many_files"),
        ("form_flag_not_json_bool", 422, "invalid_parameter"),
        ("unknown_model", 404, "model_not_found"),
        ("threshold_query", 422, "invalid_parameter"),
        ("threshold_form", 422, "invalid_parameter"),
    ],
)
def test_bad_input_gets_a_clear_answer_and_the_server_stays_up(server, dataset, case, status, code):
    url, png = server.url + "/score", (dataset / "test" / "good" / "000.png").read_bytes()
    jpeg = png_bytes(Image.open(io.BytesIO(png)).convert("RGB"), "JPEG")
    requests = {
        "empty": lambda: httpx.post(url, content=b"", headers={"content-type": "image/png"}),
        "not_image": lambda: httpx.post(url, files={"file": ("a.png", b"definitely not an image")}),
        "truncated_png": lambda: httpx.post(url, content=truncated_png(dataset), headers={"content-type": "image/png"}),
        "truncated_jpeg": lambda: httpx.post(
            url, content=jpeg[: len(jpeg) // 3], headers={"content-type": "image/jpeg"}
        ),
        "text_type": lambda: httpx.post(url, content=b"hello", headers={"content-type": "text/plain"}),
        "no_file_field": lambda: httpx.post(url, data={"image": "x"}, files={"other": ("a.png", png)}),
        "too_large": lambda: httpx.post(url, content=b"\0" * 21_000_000, headers={"content-type": "image/png"}),
        "too_large_chunked": lambda: httpx.post(
            url, content=(b"\0" * 1_000_000 for _ in range(25)), headers={"content-type": "image/png"}
        ),
        "bomb": lambda: httpx.post(url, content=bomb_png(20000, 20000), headers={"content-type": "image/png"}),
        # beyond Pillow's own bomb limit (2 x 89478485 pixels), which it refuses before we see the size
        "absurd_bomb": lambda: httpx.post(url, content=bomb_png(100000, 100000), headers={"content-type": "image/png"}),
        "batch_over_limit": lambda: httpx.post(server.url + "/score/batch", files=[("file", ("a.png", png))] * 33),
        "two_files_to_score": lambda: httpx.post(url, files=[("file", ("a.png", png)), ("file", ("b.png", png))]),
        "form_flag_not_json_bool": lambda: httpx.post(url, files={"file": ("a.png", png)}, data={"heatmap": "yes"}),
        "unknown_model": lambda: httpx.post(
            server.url + "/models/nope/score", content=png, headers={"content-type": "image/png"}
        ),
        "threshold_query": lambda: httpx.post(
            url, content=png, headers={"content-type": "image/png"}, params={"threshold": 1.5}
        ),
        "threshold_form": lambda: httpx.post(url, files={"file": ("a.png", png)}, data={"threshold": "-0.1"}),
    }
    try:
        response = requests[case]()
    except httpx.RemoteProtocolError:
        pytest.fail("the server dropped the connection instead of answering")
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == code and body["error"]["message"]
    assert " object at 0x" not in body["error"]["message"] and "Traceback" not in response.text  # no Python reprs
    if status == 413 and code == "image_too_large":  # the limit as configured, not Pillow's
        assert "PADIM_MAX_IMAGE_PIXELS = 40000000" in body["error"]["message"]
        assert "178956970" not in body["error"]["message"] and "89478485" not in body["error"]["message"]
    if code == "payload_too_large":
        assert "PADIM_MAX_UPLOAD_BYTES = 20000000" in body["error"]["message"]
    assert httpx.get(server.url + "/health/live").status_code == 200


def test_health_models_docs_and_metrics(server, model_file):
    assert httpx.get(server.url + "/health/ready").json()["models"] == ["weave"]
    models = httpx.get(server.url + "/models").json()
    assert models["default"] == "weave"
    (info,) = models["models"]
    assert info["backbone"] == "resnet18" and info["image_size"] == 64 and info["threshold"] == 0.5
    assert info["fit_image_count"] == 30 and info["verified"] is True
    models_text = httpx.get(server.url + "/models").text
    assert str(model_file.parent) not in models_text and "/tmp" not in models_text and ".padim" not in models_text
    calibration = info["calibration"]
    assert calibration["scores"] == 30 and calibration["source"] == "out_of_fold" and calibration["threshold"] > 0
    assert (
        calibration["false_alarm_rate"] == 0.01
        and 0 < calibration["promised_false_alarm_rate"] <= calibration["false_alarm_bound"]
    )
    # what the promise covers: the changes of the line the model was trained to expect (train --expect)
    header = read_header(model_file)["config"]
    assert calibration["expect"] == header["expect"] and calibration["fit_changes"] == (
        bool(header["expect"]) and header["fit_changes"]
    )
    assert calibration["covers"].startswith(
        "pictures within the declared changes" if header["expect"] else "pictures like the training pictures"
    )
    assert httpx.get(server.url + "/docs").status_code == 200
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/score", "/score/batch", "/models/{name}/score", "/health/ready", "/metrics"} <= set(spec["paths"])
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "padim_requests",
        "padim_request_latency_seconds",
        "padim_queue_wait_seconds",
        "padim_batch_size",
        "padim_requests_in_flight",
        "padim_model_load_seconds",
    ):
        assert name in families, name
    statuses = {
        (s.labels["route"], s.labels["status"])
        for s in families["padim_requests"].samples
        if s.name == "padim_requests_total"
    }
    assert ("/health/ready", "200") in statuses


def test_logs_are_json_lines_with_request_ids(server):
    response = httpx.get(server.url + "/health/live", headers={"X-Request-ID": "trace-abc-123"})
    assert response.headers["server"] == "padim"  # neutral: no server software or version
    assert response.headers["x-request-id"] == "trace-abc-123"
    time.sleep(0.2)
    entries = [json.loads(line) for line in server.logs().splitlines() if line.startswith("{")]
    assert len(entries) == len([line for line in server.logs().splitlines() if line.strip()])
    (entry,) = [e for e in entries if e.get("request_id") == "trace-abc-123"]
    assert entry["route"] == "/health/live" and entry["status"] == 200 and "latency_ms" in entry


def test_api_key(model_file, dataset, tmp_path):
    png = (dataset / "test" / "good" / "000.png").read_bytes()
    with running_server(tmp_path, [model_file], env={"PADIM_API_KEY": "s3cret"}) as srv:

        def score(**headers):
            return httpx.post(srv.url + "/score", content=png, headers={"content-type": "image/png", **headers})

        assert score().status_code == 401 and score().json()["error"]["code"] == "unauthorized"
        assert score(**{"x-api-key": "wrong"}).status_code == 401
        assert score(**{"x-api-key": "s3cret"}).status_code == 200
        assert score(authorization="Bearer s3cret").status_code == 200
        assert httpx.get(srv.url + "/models").status_code == 401
        assert httpx.get(srv.url + "/health/live").status_code == 200
        assert httpx.get(srv.url + "/health/ready").status_code == 200
        assert "s3cret" not in srv.logs()


def test_several_models_by_name(model_file, model_export, dataset, tmp_path):
    other = copy_model(model_file, tmp_path / "second.padim", model_export)
    with running_server(tmp_path, [other, model_file]) as srv:
        models = httpx.get(srv.url + "/models").json()
        assert models["default"] == "second" and [m["name"] for m in models["models"]] == ["second", "weave"]
        png = (dataset / "test" / "good" / "000.png").read_bytes()
        answer = httpx.post(srv.url + "/models/weave/score", content=png, headers={"content-type": "image/png"}).json()
        assert answer["model"]["name"] == "weave"


@pytest.mark.parametrize("problem", ["missing", "truncated", "newer", "flipped bit"])
def test_bad_model_file_stops_start_up_with_one_line(model_file, tmp_path, problem):
    path = tmp_path / "bad.padim"
    if problem == "flipped bit":  # caught while loading, after the header check: readiness never goes green
        data = bytearray(model_file.read_bytes())
        data[len(data) - 1000] ^= 0x01  # inside the last tensor
        path.write_bytes(bytes(data))
        result = run_cli("serve", "--model", path, "--port", "0", check=False, timeout=120)
        assert result.returncode == 1 and "does not match its digest" in result.stderr
        assert "Traceback" not in result.stderr
        return
    if problem == "truncated":
        path.write_bytes(model_file.read_bytes()[:100_000])
    elif problem == "newer":
        from padim.core import artifact
        from padim.core.artifact import load_artifact, save_artifact

        tensors, header = load_artifact(model_file)
        header["format_version"] = FORMAT_VERSION + 1
        original = artifact.FORMAT_VERSION
        artifact.FORMAT_VERSION = FORMAT_VERSION + 1
        try:
            save_artifact(path, tensors, {k: v for k, v in header.items() if k != "format_version"})
        finally:
            artifact.FORMAT_VERSION = original
    result = run_cli("serve", "--model", path, "--port", "0", check=False, timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.padim" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.load_sensitive
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_during_load_loses_no_accepted_request(model_file, dataset, tmp_path, workers):
    """Every request the server accepted is answered 200; the rest were refused, never half-done (with two API
    processes: each drains what it admitted before the scoring process stops).

    A connection still in the kernel's listen backlog when the listener closes is reset by the
    kernel (the client sees a read error, not a refused connect) although the server never
    saw the request; the request id, which the server logs for every request it receives,
    tells the two apart.
    """
    import uuid

    png = (dataset / "test" / "good" / "000.png").read_bytes()
    outcomes, lock = [], threading.Lock()

    def client(srv, stop_at):
        while time.time() < stop_at:
            request_id = uuid.uuid4().hex
            try:
                with httpx.Client(timeout=60) as c:  # a fresh connection per request
                    r = c.post(
                        srv.url + "/score",
                        content=png,
                        headers={"content-type": "image/png", "connection": "close", "x-request-id": request_id},
                    )
                outcome = r.status_code
            except httpx.ConnectError:
                outcome = "refused"  # the listener was already closed
            except httpx.TransportError:
                outcome = "reset"
            with lock:
                outcomes.append((request_id, outcome))
            if outcome in ("refused", "reset"):
                return

    with running_server(tmp_path, [model_file], args=("--workers", str(workers))) as srv:
        threads = [threading.Thread(target=client, args=(srv, time.time() + 20)) for _ in range(16)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        srv.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        code = srv.process.wait(30)
    assert code == 0, srv.logs()
    entries = [json.loads(line) for line in srv.logs().splitlines()]
    received = {e["request_id"]: e["status"] for e in entries if e.get("route") == "/score"}
    assert set(received.values()) == {200}
    assert not [e for e in entries if e["level"] == "error"]  # a stop under load logs no error, per request or other
    for request_id, outcome in outcomes:
        if outcome == 200:
            assert request_id in received
        else:
            assert outcome in ("refused", "reset") and request_id not in received, (request_id, outcome)
    assert sum(1 for _, o in outcomes if o == 200) >= 16


def test_serve_takes_models_positionally_like_the_other_commands(model_file, model_export, tmp_path):
    copy = copy_model(model_file, tmp_path / "line4.padim", model_export)
    with running_server(
        tmp_path, [model_file], args=(str(copy),)
    ) as running:  # `serve line4.padim --model weave.padim`
        listing = httpx.get(running.url + "/models", timeout=10).json()
    assert listing["default"] == "line4" and [m["name"] for m in listing["models"]] == ["line4", "weave"]


def test_a_framed_model_is_served_as_predict_scores_it(dataset, tmp_path):
    """Region of interest + pad: the service frames as train did, maps back onto the picture, refuses a
    picture that cannot hold the region, and GET /models says how it frames."""
    model = tmp_path / "framed.padim"
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        model,
        "--weights",
        "random",
        "--image-size",
        64,
        "--roi",
        "8,16,80,64",
        "--resize",
        "pad",
        "--calibration-folds",
        2,
    )
    run_cli("-q", "predict", model, dataset / "test" / "hole" / "000.png", "--output", tmp_path / "p")
    expected = json.loads((tmp_path / "p" / "results.jsonl").read_text().splitlines()[0])
    with running_server(tmp_path, [model]) as srv:
        got = post_image(srv.url, dataset / "test" / "hole" / "000.png", mask="true", heatmap="true")
        assert got.status_code == 200
        assert_same_verdict(got.json(), expected)
        mask = np.asarray(Image.open(io.BytesIO(base64.b64decode(got.json()["mask"]))))
        outside = np.ones(mask.shape, dtype=bool)
        outside[16:80, 8:88] = False  # pad scores the whole region
        assert mask.shape == (96, 96) and not mask[outside].any()
        heat = np.asarray(Image.open(io.BytesIO(base64.b64decode(got.json()["heatmap"]))).convert("RGB"), dtype=int)
        assert heat.shape == (96, 96, 3) and np.ptp(heat[0:10, 0:96], axis=2).max() <= 2  # outside: greyed out
        small = httpx.post(
            srv.url + "/score", content=png_bytes(Image.new("RGB", (50, 50))), headers={"content-type": "image/png"}
        )
        assert small.status_code == 422 and "does not lie inside this 50x50 picture" in small.json()["error"]["message"]
        described = httpx.get(srv.url + "/models").json()["models"][0]
        assert described["roi"] == [8, 16, 80, 64] and described["resize"] == "pad"
