"""In-process (TestClient) checks: readiness while loading, timeouts, overload, settings."""

import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from helpers import copy_model, running_server
from PIL import Image
from pydantic import ValidationError

from padim.service.app import create_app
from padim.service.settings import ServiceSettings
from padim.service.state.loading import Loader


def png(dataset, name="good/000.png") -> bytes:
    return (dataset / "test" / name).read_bytes()


def wait_ready(client: TestClient) -> None:
    import time

    for _ in range(300):
        if client.get("/health/ready").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("not ready")


def test_not_ready_until_models_are_loaded_and_warm(model_file, dataset, monkeypatch):
    release = threading.Event()
    original = Loader.load_one

    def slow_load(self, path, cache=None):
        assert release.wait(30)
        return original(self, path, cache)

    monkeypatch.setattr(Loader, "load_one", slow_load)
    with TestClient(create_app(ServiceSettings(models=[model_file], device="cpu"))) as client:
        assert client.get("/health/live").status_code == 200
        ready = client.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "loading"
        early = client.post("/score", content=png(dataset), headers={"content-type": "image/png"})
        assert (
            early.status_code == 503 and early.headers["retry-after"] and early.json()["error"]["code"] == "not_ready"
        )
        release.set()
        wait_ready(client)
        assert client.post("/score", content=png(dataset), headers={"content-type": "image/png"}).status_code == 200


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_a_nan_in_the_model_gives_an_error_never_a_verdict(model_file, dataset, monkeypatch, runtime):
    original = Loader.load_one

    def poisoned(self, path, cache=None):  # a model damaged in memory, after its file was verified
        detector, sha256 = original(self, path, cache)
        if runtime == "torch":
            detector.model.mean[0, 0] = float("nan")
        else:  # the graph's output, as a damaged runtime would give it
            run = detector._session.run

            def nan_run(images):
                maps, raw, *rest = run(images)
                return [maps * float("nan"), raw, *rest]

            detector._session.run = nan_run
        return detector, sha256

    monkeypatch.setattr(Loader, "load_one", poisoned)
    with TestClient(create_app(ServiceSettings(models=[model_file], device="cpu", runtime=runtime))) as client:
        wait_ready(client)
        for response in (
            client.post("/score", content=png(dataset), headers={"content-type": "image/png"}),
            client.post(
                "/score/batch",
                files=[("file", ("a.png", png(dataset))), ("file", ("b.png", png(dataset, "hole/000.png")))],
            ),
        ):
            assert response.status_code == 500, response.text
            assert response.json() == {
                "error": {"code": "non_finite_score", "message": response.json()["error"]["message"]}
            }
            assert "is_anomaly" not in response.text
        assert client.get("/health/live").status_code == 200


@pytest.mark.load_sensitive
def test_slow_scoring_gets_504(model_file, dataset):
    settings = ServiceSettings(models=[model_file], device="cpu", request_timeout_s=0.001, max_delay_ms=50)
    with TestClient(create_app(settings)) as client:
        wait_ready(client)
        response = client.post("/score", content=png(dataset), headers={"content-type": "image/png"})
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        assert client.get("/health/live").status_code == 200


@pytest.mark.load_sensitive
def test_start_up_failure_turns_readiness_red(tmp_path):
    broken = tmp_path / "broken.padim"
    broken.write_bytes(b"nonsense")
    with TestClient(create_app(ServiceSettings(models=[broken]))) as client:
        import time

        for _ in range(100):
            body = client.get("/health/ready").json()
            if body["reason"] != "loading":
                break
            time.sleep(0.05)
        assert body["reason"].startswith("failed:") and "broken.padim" in body["reason"]


def test_settings_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PADIM_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("PADIM_MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("PADIM_API_KEY", "zz-secret-9")
    (tmp_path / "b.padim").write_bytes(b"")
    (tmp_path / "a.padim").write_bytes(b"")
    settings = ServiceSettings()
    assert settings.max_batch_size == 8 and settings.api_key.get_secret_value() == "zz-secret-9"
    assert [p.name for p in settings.model_files()] == ["a.padim", "b.padim"]
    assert "zz-secret-9" not in repr(settings)
    monkeypatch.setenv("PADIM_MAX_BATCH_SIZE", "0")
    with pytest.raises(ValidationError, match="max_batch_size"):
        ServiceSettings()


@pytest.mark.load_sensitive
def test_model_dir_from_environment_and_full_queue_answers_503(model_file, model_export, dataset, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    copy_model(model_file, models / "weave.padim", model_export)
    env = {
        "PADIM_MODEL_DIR": str(models),
        "PADIM_MAX_QUEUE": "1",
        "PADIM_MAX_BATCH_SIZE": "1",
        "PADIM_MAX_DELAY_MS": "0",
    }
    with running_server(tmp_path, [], env=env) as srv:
        data = png(dataset)
        with ThreadPoolExecutor(24) as pool:
            responses = list(
                pool.map(
                    lambda _: httpx.post(
                        srv.url + "/score", content=data, headers={"content-type": "image/png"}, timeout=60
                    ),
                    range(48),
                )
            )
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503} and 200 in statuses
        assert 503 in statuses, "48 simultaneous requests should overflow a queue of 1"
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "overloaded"
        assert httpx.get(srv.url + "/health/live").status_code == 200


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "I;16", "CMYK", "exif"])
def test_image_modes_are_scored_like_rgb(server, dataset, mode):
    """Each mode gets the score of the same picture made RGB by Pillow itself (sent as an RGB PNG)."""
    image = Image.open(dataset / "test" / "good" / "000.png").convert("RGB")
    buffer = io.BytesIO()
    if mode == "exif":
        exif = Image.Exif()
        exif[0x0112] = 3  # upside down
        image.save(buffer, format="JPEG", exif=exif.tobytes())
        reference = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB").rotate(180)
    elif mode == "CMYK":
        image.convert("CMYK").save(buffer, format="JPEG")
        reference = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    elif mode == "I;16":
        gray = image.convert("L")
        Image.fromarray(np.asarray(gray, dtype=np.uint16) * 257).save(buffer, format="PNG")
        reference = gray.convert("RGB")
    else:
        converted = image.convert(mode)
        converted.save(buffer, format="PNG")
        reference = converted.convert("RGB")
    rgb = io.BytesIO()
    reference.save(rgb, format="PNG")
    scores = [
        httpx.post(server.url + "/score", content=body, headers={"content-type": "image/png"}, timeout=60)
        for body in (buffer.getvalue(), rgb.getvalue())
    ]
    assert [r.status_code for r in scores] == [200, 200], scores[0].text
    assert scores[0].json()["raw_score"] == pytest.approx(scores[1].json()["raw_score"], rel=1e-5)


def test_every_setting_is_in_the_docs_settings_tables_with_its_default():
    """docs/settings.md: a row for every setting the service reads, whose default is the setting's where that is a
    plain value (a number, a word, true/false); a computed one (from the CPUs, unset) is said in words."""
    import re
    from pathlib import Path

    from padim.service.settings import ServiceSettings

    page = (Path(__file__).parents[2] / "docs" / "settings.md").read_text()
    rows = dict(re.findall(r"^\| `(PADIM_[A-Z0-9_]+)` \| ([^|]*) \|", page, re.M))
    expected = {f"PADIM_{name.upper()}": field for name, field in ServiceSettings.model_fields.items()}
    missing = sorted(set(expected) - set(rows))
    assert not missing, f"not in docs/settings.md: {missing}"
    assert sorted(set(rows) - set(expected)) == ["PADIM_CACHE_DIR"]  # read by the model loader, not a setting
    for variable, field in expected.items():
        default, said = field.default, rows[variable].strip()
        if isinstance(default, bool):
            assert said == str(default).lower(), (variable, said)
        elif isinstance(default, (int, float)):
            assert float(said) == default, (variable, said, default)
        elif isinstance(default, str):
            assert said == default, (variable, said, default)
        else:  # None or a list: no plain value, so not a number
            assert not re.fullmatch(r"[0-9.]+", said), (variable, said)


def test_clients_see_a_weights_file_by_name_and_digest_never_its_server_path(dataset, weights_file, tmp_path):
    from helpers import run_cli

    model = tmp_path / "filed.padim"
    run_cli("-q", "train", dataset / "train" / "good", "--output", model, "--weights", weights_file, "--image-size", 32)
    with TestClient(create_app(ServiceSettings(models=[model], device="cpu"))) as client:
        wait_ready(client)
        (described,) = client.get("/models").json()["models"]
        scored = client.post("/score", content=png(dataset), headers={"content-type": "image/png"}).json()
    for shown in (described["weights"], scored["model"]["weights"]):
        assert shown.startswith(f"file: {weights_file.name} (parameters sha256 ")
        assert str(weights_file.parent) not in shown
    assert str(weights_file.parent) not in json.dumps(described)


def test_a_model_fitted_at_bf16_is_served_at_bf16_with_its_check(dataset, tmp_path):
    """``train --precision bf16``: the service scores it with torch at bf16 (runtime auto) and describes it so."""
    from helpers import run_cli

    from padim.models.fit.model_file import load_detector

    model = tmp_path / "bf16.padim"
    good = dataset / "train" / "good"
    run_cli("-q", "train", good, "-o", model, "--weights", "random", "--image-size", 32, "--precision", "bf16")
    with TestClient(create_app(ServiceSettings(models=[model], device="cpu"))) as client:
        wait_ready(client)
        (described,) = client.get("/models").json()["models"]
        scored = client.post("/score", content=png(dataset), headers={"content-type": "image/png"}).json()
    assert described["precision"] == "bf16" and described["runtime"] == "torch"
    assert described["precision_check"]["passed"] and described["calibration"]["threshold_of"] == "bf16 scorer"
    detector = load_detector(model, device="cpu")
    expected = detector.score(detector.preprocess([Image.open(dataset / "test" / "good" / "000.png").convert("RGB")]))
    assert scored["raw_score"] == pytest.approx(float(expected.raw_scores[0]), rel=1e-5)


def test_a_model_fitted_at_int8_is_served_with_its_own_graph_and_says_what_runs_and_why(dataset, tmp_path):
    """``train --precision int8``: the service (runtime auto) scores with the model's own int8 graph on ONNX Runtime,
    as torch with the same int8 backbone scores, and GET /models says so with the gate's figures."""
    from helpers import run_cli

    from padim.models.fit.model_file import load_detector

    model = tmp_path / "int8.padim"
    good = dataset / "train" / "good"
    run_cli("-q", "train", good, "-o", model, "--weights", "random", "--image-size", 32, "--precision", "int8")
    with TestClient(create_app(ServiceSettings(models=[model], device="auto"))) as client:
        wait_ready(client)
        (described,) = client.get("/models").json()["models"]
        scored = client.post("/score", content=png(dataset), headers={"content-type": "image/png"}).json()
    assert described["precision"] == "int8" and described["runtime"] == "onnxruntime"
    assert "int8 backbone" in described["runtime_reason"] and described["calibration"]["threshold_of"] == "int8 scorer"
    assert described["calibration"]["source"] == "out_of_fold"
    detector = load_detector(model)
    assert detector.device.type == "cpu"
    expected = detector.score(detector.preprocess([Image.open(dataset / "test" / "good" / "000.png").convert("RGB")]))
    assert scored["raw_score"] == pytest.approx(float(expected.raw_scores[0]), rel=1e-4)


def test_a_cover_sized_by_the_training_pictures_is_described_with_what_was_measured(dataset, tmp_path):
    """``train --expect auto``: GET /models shows what was measured beside the bounds, through the export the service
    scores with on a CPU (runtime auto) and through torch."""
    from helpers import run_cli

    from padim.core import load_artifact

    model = tmp_path / "auto.padim"
    good = dataset / "train" / "good"
    run_cli("-q", "train", good, "-o", model, "--weights", "random", "--image-size", 32, "--expect", "auto")
    _, header = load_artifact(model)
    for runtime in ("auto", "torch"):
        with TestClient(create_app(ServiceSettings(models=[model], device="cpu", runtime=runtime))) as client:
            wait_ready(client)
            (described,) = client.get("/models").json()["models"]
        calibration = described["calibration"]
        assert calibration["measured"] == header["expect_measured"] and calibration["measured"]["pictures"] == 30
        assert calibration["expect"] == header["config"]["expect"] and "(--expect auto;" in calibration["covers"]
        # the weight --shrinkage auto (the default) estimated, and why (model format 18, export version 14)
        assert described["shrinkage"] == "auto"
        chosen = described["shrinkage_chosen"]
        assert chosen["chosen"] == "estimated" and chosen["weight"] == header["shrinkage_estimated"]["weight"]
        assert "30 samples a pixel" in chosen["why"]
