"""The service when its GPU fails: out of memory, a GPU in an error state, warm-up at the largest batch.

No GPU is needed: the model's ``score`` raises the errors torch raises on one (``torch.OutOfMemoryError``,
a CUDA ``RuntimeError``), and the CUDA probe of /health/ready is replaced. tests/cuda forces a real
out-of-memory on a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch
from fastapi.testclient import TestClient

from padim.service.app import create_app
from padim.service.settings import ServiceSettings
from padim.service.state import ServiceState, loading, scoring


class OnGpu:
    """A loaded detector that says it runs on CUDA (so the probe and the GPU batch preference apply)."""

    def __init__(self, detector):
        self._detector = detector

    def __getattr__(self, name):
        return getattr(self._detector, name)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda")


@pytest.fixture
def faults(monkeypatch):
    """``faults.fail(predicate, error)``: after warm-up, scoring a batch for which ``predicate(batch)`` holds raises."""

    class Faults:
        sizes: list[int] = []
        rule = None
        gpu = False

        def fail(self, predicate, error=None):
            self.rule = (predicate, error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.50 GiB"))

    faults = Faults()
    faults.sizes = []
    real = loading.load_scorer

    def load_scorer(*args, **kwargs):
        detector = real(*args, **kwargs)
        score = detector.score

        def faulty(batch):
            faults.sizes.append(batch.shape[0])
            if faults.rule is not None and faults.rule[0](batch):
                raise faults.rule[1]
            return score(batch)

        detector.score = faulty
        return OnGpu(detector) if faults.gpu else detector

    monkeypatch.setattr(loading, "load_scorer", load_scorer)
    return faults


def started(settings: ServiceSettings) -> TestClient:
    client = TestClient(create_app(settings))
    client.__enter__()
    for _ in range(300):
        if client.get("/health/ready").status_code == 200:
            return client
        time.sleep(0.05)
    client.__exit__(None, None, None)
    raise AssertionError("not ready")


def service(client: TestClient) -> ServiceState:
    return client.app.state.service


def png(dataset) -> bytes:
    return (dataset / "test" / "good" / "000.png").read_bytes()


def test_out_of_memory_is_cured_by_splitting_the_batch(model_file, faults):
    client = started(ServiceSettings(models=[model_file], device="cpu"))
    try:
        faults.fail(lambda batch: batch.shape[0] >= 4)
        state = service(client)
        size = state.models["weave"].scorer.config.features.image_size
        faults.sizes.clear()
        out = state.scoring.score(state.models["weave"], torch.zeros(5, 3, size, size))
        assert out.raw_scores.shape == (5,) and out.maps.shape[0] == 5
        assert faults.sizes == [5, 3, 2]  # the whole batch, then its two halves
        assert state.scoring.device_errors == 0
        metrics = client.get("/metrics").text
        assert 'padim_device_errors_total{model="weave",outcome="split"} 1.0' in metrics
    finally:
        client.__exit__(None, None, None)


def test_out_of_memory_even_split_is_503_and_repeated_failures_make_the_service_unready(model_file, dataset, faults):
    client = started(ServiceSettings(models=[model_file], device="cpu", max_device_errors=2))
    try:
        state = service(client)
        size = state.models["weave"].scorer.config.features.image_size
        faults.fail(lambda batch: True)
        answer = client.post("/score", content=png(dataset), headers={"content-type": "image/png"})
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "device_out_of_memory"
        assert client.get("/health/ready").status_code == 200  # one failure: still ready
        faults.rule = None
        state.scoring.score(state.models["weave"], torch.zeros(2, 3, size, size))  # a success resets the count
        assert state.scoring.device_errors == 0
        faults.fail(lambda batch: True, RuntimeError("CUDA error: an illegal memory access was encountered"))
        for _ in range(2):
            with pytest.raises(RuntimeError, match="illegal memory access"):
                state.scoring.score(state.models["weave"], torch.zeros(1, 3, size, size))
        ready = client.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["reason"].startswith("failed: 2 scoring batches in a row")
        refused = client.post("/score", content=png(dataset), headers={"content-type": "image/png"})
        assert refused.status_code == 503 and "restart the service" in refused.json()["error"]["message"]
        metrics = client.get("/metrics").text
        assert 'padim_device_errors_total{model="weave",outcome="error"} 2.0' in metrics
        assert 'padim_device_errors_total{model="weave",outcome="out_of_memory"} 1.0' in metrics
    finally:
        client.__exit__(None, None, None)


def test_an_error_that_is_not_the_gpus_is_a_500_and_does_not_count(model_file, dataset, faults):
    client = started(ServiceSettings(models=[model_file], device="cpu", max_device_errors=1))
    try:
        faults.fail(lambda batch: True, ValueError("something else"))
        answer = client.post("/score", content=png(dataset), headers={"content-type": "image/png"})
        assert answer.status_code == 500 and answer.json()["error"]["code"] == "scoring_failed"
        assert service(client).scoring.device_errors == 0 and client.get("/health/ready").status_code == 200
    finally:
        client.__exit__(None, None, None)


@pytest.mark.parametrize(("preferred", "gpu", "expected"), [(None, False, 8), (3, False, 3), (None, True, 16)])
def test_warm_up_runs_the_largest_batch_the_batcher_will_form(
    model_file, faults, preferred, gpu, expected, monkeypatch
):
    monkeypatch.setattr(scoring, "probe", lambda device: None)
    faults.gpu = gpu
    client = started(
        ServiceSettings(models=[model_file], device="cpu", max_batch_size=16, preferred_batch_size=preferred)
    )
    try:
        assert faults.sizes[0] == expected
    finally:
        client.__exit__(None, None, None)


def test_a_warm_up_out_of_gpu_memory_stops_the_start_with_what_to_lower(model_file, faults):
    faults.fail(lambda batch: True)  # from the first batch: the warm-up
    with TestClient(create_app(ServiceSettings(models=[model_file], device="cpu"))) as client:
        for _ in range(300):
            reason = client.get("/health/ready").json()["reason"]
            if reason != "loading":
                break
            time.sleep(0.05)
        assert reason.startswith("failed: ") and "does not fit in the GPU's memory" in reason
        assert "PADIM_MAX_BATCH_SIZE" in reason


def test_readiness_runs_a_cuda_probe_a_failed_one_is_final_a_slow_one_is_not(model_file, faults, monkeypatch):
    faults.gpu = True
    calls = []
    behaviour = {"mode": "ok"}

    def probe(device):
        calls.append(device)
        if behaviour["mode"] == "slow":
            time.sleep(4.0)
        if behaviour["mode"] == "broken":
            raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(scoring, "probe", probe)
    monkeypatch.setattr(scoring, "PROBE_TIMEOUT_S", 1.5)  # well above a thread's start on a loaded machine
    client = started(ServiceSettings(models=[model_file], device="cpu", max_batch_size=4))
    try:
        assert calls and calls[-1] == torch.device("cuda")
        behaviour["mode"] = "slow"
        slow = client.get("/health/ready")
        assert slow.status_code == 503 and "took over 1.5 s" in slow.json()["reason"]
        behaviour["mode"] = "ok"
        assert client.get("/health/ready").status_code == 200  # a busy GPU is not a broken one
        behaviour["mode"] = "broken"
        broken = client.get("/health/ready")
        assert broken.status_code == 503 and "unspecified launch failure" in broken.json()["reason"]
        behaviour["mode"] = "ok"
        assert client.get("/health/ready").status_code == 503  # a GPU in an error state stays failed
    finally:
        client.__exit__(None, None, None)
