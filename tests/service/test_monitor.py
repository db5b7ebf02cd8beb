"""The line monitor against a real server: normal images, then the same under a warmer lamp, then a reset."""

import time

import httpx
import pytest
from helpers import metric, normal_and_shifted, running_server, score_in_batches

WINDOW = 40
ENV = {"PADIM_MONITOR_WINDOW": str(WINDOW), "PADIM_MONITOR_MIN_IMAGES": "30"}


@pytest.fixture(scope="module")
def line(tmp_path_factory):
    """``WINDOW`` new normal images (unseen by the model) and the same under a warmer lamp."""
    return normal_and_shifted(tmp_path_factory.mktemp("line"), WINDOW)


def reading(url: str) -> dict:
    answer = httpx.get(url + "/models/weave/monitor")
    assert answer.status_code == 200, answer.text
    return answer.json()


def assert_metrics_agree(url: str, monitor: dict) -> None:
    assert metric(url, "padim_monitor_images", model="weave") == monitor["images"]
    for test in ("flag_rate", "score_drift", "input_drift"):
        assert metric(url, "padim_monitor_alarm", model="weave", test=test) == float(test in monitor["alarms"])
        assert metric(url, "padim_monitor_p_value", model="weave", test=test) == pytest.approx(
            monitor[test]["p_value"], rel=1e-9, abs=1e-300
        )
    assert metric(url, "padim_monitor_flag_rate", model="weave") == pytest.approx(monitor["flag_rate"]["rate"])
    assert metric(url, "padim_model_normal_flag_rate", model="weave") == pytest.approx(
        monitor["flag_rate"]["normal_rate"]
    )


def test_the_monitor_goes_from_normal_to_drift_and_back_after_a_reset(model_file, line, tmp_path):
    normal, shifted = line
    with running_server(tmp_path, [model_file], env=ENV) as server:
        empty = reading(server.url)
        assert empty["status"] == "collecting" and empty["images"] == 0 and empty["window"] == WINDOW
        assert empty["bytes"] == 16 * WINDOW and sum(empty["histogram"]["calibration"]) == 30
        score_in_batches(server.url, normal)
        calm = reading(server.url)
        assert calm["images"] == WINDOW and calm["status"] == "normal" and calm["alarms"] == [], calm["verdict"]
        assert calm["input_drift"] is not None and calm["flag_rate"]["basis"] == "promised"
        assert sum(calm["histogram"]["recent"]) == WINDOW and "within what the model promised" in calm["verdict"]
        assert_metrics_agree(server.url, calm)
        # the lamp changes: within one window every test says so
        score_in_batches(server.url, shifted)
        drift = reading(server.url)
        assert drift["images"] == WINDOW and drift["status"] == "alarm"
        assert set(drift["alarms"]) == {"flag_rate", "score_drift", "input_drift"}, drift["verdict"]
        assert "more flags than normal images alone would give" in drift["verdict"]
        assert "look unlike the training images" in drift["verdict"] and "padim train --expect" in drift["verdict"]
        assert drift["input_drift"]["median_ratio"] > 1 and drift["score_drift"]["psi"] > 0.25
        assert_metrics_agree(server.url, drift)
        answered = sum(
            metric(server.url, "padim_verdicts_total", model="weave", verdict=v) for v in ("anomalous", "normal")
        )
        assert answered == 2 * WINDOW and metric(server.url, "padim_score_count", model="weave") == 2 * WINDOW
        # fixed: the window is forgotten, the counters are not
        after = httpx.post(server.url + "/models/weave/monitor/reset").json()
        assert after["status"] == "collecting" and after["images"] == 0 and after["recorded"] == 0
        assert (
            metric(server.url, "padim_verdicts_total", model="weave", verdict="anomalous")
            >= drift["flag_rate"]["flags"]
        )
        score_in_batches(server.url, normal)
        again = reading(server.url)
        assert again["status"] == "normal" and again["alarms"] == []
        assert_metrics_agree(server.url, again)
        # a request's own threshold is counted beside; flags stay at the model's threshold; monitor=false is not kept
        score_in_batches(server.url, normal[:8], threshold=0.01)
        own = reading(server.url)
        assert own["threshold_overrides"] == 8 and own["flag_rate"]["flags"] == again["flag_rate"]["flags"]
        assert metric(server.url, "padim_threshold_overrides_total", model="weave") == 8
        score_in_batches(server.url, shifted[:8], monitor="false")
        assert reading(server.url)["recorded"] == own["recorded"]
        assert httpx.get(server.url + "/models/nope/monitor").status_code == 404


def test_a_client_that_gives_up_costs_no_batch(model_file, dataset):
    """Its image waits for the device (held busy); the client leaves; the image is never scored."""
    import threading

    import anyio
    from fastapi.testclient import TestClient

    from padim.service.app import create_app
    from padim.service.settings import ServiceSettings

    data = (dataset / "test" / "good" / "000.png").read_bytes()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/score",
        "raw_path": b"/score",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"image/png"), (b"content-length", str(len(data)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    with TestClient(create_app(ServiceSettings(models=[model_file], device="cpu"))) as client:
        for _ in range(600):
            if client.get("/health/ready").status_code == 200:
                break
            time.sleep(0.05)
        state = client.app.state.service
        release = threading.Event()
        held = state.scheduler.call(lambda: release.wait(30))  # the device is busy: the image waits in its queue

        async def leaving_client() -> list[dict]:
            sent: list[dict] = []
            given = False

            async def receive() -> dict:
                nonlocal given
                if not given:
                    given = True
                    return {"type": "http.request", "body": data, "more_body": False}
                await anyio.sleep(0.4)  # then the client goes away
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)

            await client.app(scope, receive, send)
            return sent

        sent = client.portal.call(leaving_client)
        release.set()
        held.result(30)
        assert sent[0]["status"] == 499
        time.sleep(0.5)  # the scheduler has passed the abandoned image by now
        metrics = client.get("/metrics").text
        assert 'padim_batch_size_count{model="weave"}' not in metrics  # no batch was ever scored
        assert 'padim_requests_total{route="/score",status="499"} 1.0' in metrics
        assert client.get("/models/weave/monitor").json()["recorded"] == 0
        kept = client.post("/score", content=data, headers={"content-type": "image/png"})
        assert kept.status_code == 200
        assert 'padim_batch_size_count{model="weave"} 1.0' in client.get("/metrics").text
