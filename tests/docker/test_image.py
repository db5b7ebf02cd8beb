"""The Docker image, built and run for real on a local Docker engine.

The base is a minimal Debian made by ``docker/test-base.sh`` (image registries are out of
reach here, so NVIDIA's CUDA base cannot be pulled); the Dockerfile is otherwise the one that
ships. Inside the image a model is trained on generated images with random weights, then a
server container serves it read-only: Docker's own HEALTHCHECK must report healthy, a score
must equal ``padim predict`` on the host, the process must run as uid 10001, and ``docker stop``
must let an in-flight request finish and exit 0.

Needs a running Docker engine and the base image (the ``docker`` component of tests/components.py:
``bash tests/setup-system.sh`` provides both). Without them these tests skip, saying so (fail under
``PADIM_TEST_REQUIRE=all``, as in CI); deselect them with ``-m "not docker"``.
"""

from __future__ import annotations

import json
import re
import shlex
import threading
import time
from pathlib import Path

import docker_image
import httpx
import pytest
from docker_image import BASE, DEPS, IMAGE, docker
from helpers import assert_same_verdict, free_port, large_png, metric, run_cli

pytestmark = [pytest.mark.docker, pytest.mark.system]


@pytest.fixture(scope="module")
def image():
    """The image as shipped (``BAKE_WEIGHTS`` empty), built in the background since the run began
    (tests/docker_image.py)."""
    seconds = docker_image.wait()
    # The build stage is an image that nothing needs once the final one exists.
    docker("image", "prune", "-f", "--filter", "label=padim.stage=build")
    size = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout)
    docker_image.report(
        f"docker image {IMAGE} on {BASE}: {size / 1e9:.2f} GB, built in {seconds:.0f} s (in the background from the "
        f"run's start, the dependencies' stage kept as {DEPS}); removed after the tests"
    )
    try:
        yield IMAGE
    finally:
        docker("rmi", "-f", IMAGE, check=False)


@pytest.fixture(scope="module")
def trained(image, dataset, tmp_path_factory) -> Path:
    """A model trained inside the image, as uid 10001, into a host folder."""
    models = tmp_path_factory.mktemp("image-models")
    models.chmod(0o777)  # written by the image's user
    result = docker(
        "run",
        "--rm",
        "-v",
        f"{dataset / 'train' / 'good'}:/data:ro",
        "-v",
        f"{models}:/models",
        image,
        "-q",
        "train",
        "/data",
        "--output",
        "/models/weave.padim",
        "--weights",
        "random",
        "--image-size",
        "64",
    )
    summary = json.loads(result.stdout)
    assert summary["fitted"] == 30 and summary["calibration"]["scores"] == 30
    return models / "weave.padim"


def readme_docker_run(image: str, models: Path, port: int) -> list[str]:
    """The README's ``docker run --gpus all ...`` as written, for this engine: no GPU here, the port on 127.0.0.1,
    the test's models folder, the test's image."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (line,) = re.findall(r"^docker run --gpus all (.*?)\s+#", readme, re.M)
    words = shlex.split(line)
    assert words[-1] == "padim" and "-p" in words and "-v" in words, words
    port_at, volume_at = words.index("-p") + 1, words.index("-v") + 1
    assert words[port_at] == "8000:8000" and words[volume_at].endswith(":/models:ro"), words
    words[port_at], words[volume_at] = f"127.0.0.1:{port}:8000", f"{models}:/models:ro"
    return [*words[:-1], image]


@pytest.fixture(scope="module")
def container(image, trained):
    """The server container as the README's ``docker run`` starts it, model folder mounted read-only, in the layout
    of a GPU node: a supervisor as PID 1 with a scoring process and two API processes meeting in the container's
    /dev/shm; removed at the end."""
    port = free_port()
    name = f"padim-test-{port}"
    docker(
        "run",
        "-d",
        "--name",
        name,
        # the image's own HEALTHCHECK command, checked every 2 s instead of 15: healthy as soon as it is
        "--health-interval",
        "2s",
        "-e",
        "PADIM_WORKERS=2",
        *readme_docker_run(image, trained.parent, port),
    )
    try:
        deadline = time.time() + 240
        status = ""
        while time.time() < deadline:
            status = docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip()
            if (
                status in ("healthy", "unhealthy")
                or docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() != "true"
            ):
                break
            time.sleep(1)
        assert status == "healthy", f"health {status!r}:\n{docker('logs', name, check=False).stderr[-3000:]}"
        yield name, f"http://127.0.0.1:{port}"
    finally:
        docker("rm", "-f", name, check=False)


def test_served_score_equals_padim_predict_on_the_host(container, trained, dataset, tmp_path):
    name, url = container
    image_path = dataset / "test" / "hole" / "000.png"
    served = httpx.post(
        url + "/score", content=image_path.read_bytes(), headers={"content-type": "image/png"}, timeout=60
    ).json()
    run_cli("-q", "predict", trained, image_path, "--output", tmp_path, "--no-heatmaps", "--no-maps")
    (local,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert served["raw_score"] == pytest.approx(local["raw_score"], rel=1e-4)
    assert served["score"] == pytest.approx(local["score"], abs=25 * 1e-4)  # see helpers.SCORE_ATOL
    assert_same_verdict(served, local, rel=1e-4)
    assert "RANDOM" in served["model"]["weights"]


def test_the_image_leaves_out_triton(image):
    """torch's triton (0.9 GB, for torch.compile) is not used by padim: the image uninstalls it (serving a .padim on
    the CPU still exports it to ONNX: see the score test)."""
    shown = docker("run", "--rm", "--entrypoint", "pip", image, "show", "triton", check=False)
    assert shown.returncode != 0 and "not found" in (shown.stderr + shown.stdout).lower()


def test_runs_as_uid_10001_with_the_model_read_only(container):
    name, _ = container
    assert docker("exec", name, "id", "-u").stdout.strip() == "10001"
    assert docker("inspect", "-f", "{{.Config.User}}", name).stdout.strip() == "10001:10001"
    write = docker("exec", name, "touch", "/models/x", check=False)
    assert write.returncode != 0 and "Read-only file system" in write.stderr


def test_docker_stop_drains_in_flight_requests_and_exits_0(container, dataset):
    name, url = container
    # 16 images of 6300 x 6300: seconds of decoding, so the stop surely lands while they are in flight
    files = [("file", (f"{i}.png", large_png(), "image/png")) for i in range(16)]
    answer = {}

    def slow_request():
        answer["response"] = httpx.post(url + "/score/batch", files=files, timeout=120)

    worker = threading.Thread(target=slow_request)
    worker.start()
    deadline = time.time() + 60
    while metric(url, "padim_queue_depth", model="weave") < len(files):  # admitted: its images are being decoded
        assert time.time() < deadline, "the batch was never admitted"
        time.sleep(0.02)
    docker("stop", "-t", "60", name, timeout=120)
    worker.join(120)
    response = answer["response"]
    assert response.status_code == 200 and len(response.json()["results"]) == len(files)
    assert docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip() == "0"  # the supervisor, PID 1
    entries = [json.loads(line) for line in docker("logs", name).stderr.splitlines() if line.startswith("{")]
    messages = [(e.get("message"), e.get("route"), e.get("status")) for e in entries]
    stopping = next(i for i, m in enumerate(messages) if m[0] == "Shutting down")
    finished = next(i for i, m in enumerate(messages) if m[1] == "/score/batch")
    assert stopping < finished and messages[finished][2] == 200, messages[-12:]


@pytest.mark.cuda
def test_the_image_scores_on_the_gpu_with_gpus_all(image, trained, dataset, tmp_path):
    """``docker run --gpus all``: the image's torch finds the GPU and scores as the host's CPU does."""
    from padim.models.devices import CROSS_DEVICE_RTOL

    if "nvidia" not in docker("info", "-f", "{{json .Runtimes}}").stdout:
        pytest.skip("Docker has no NVIDIA runtime (install the NVIDIA Container Toolkit)")
    image_path = dataset / "test" / "good" / "000.png"
    result = docker(
        "run",
        "--rm",
        "--gpus",
        "all",
        "-v",
        f"{trained.parent}:/models:ro",
        "-v",
        f"{image_path}:/in.png:ro",
        "--entrypoint",
        "sh",
        image,
        "-c",
        "padim -q predict /models/weave.padim /in.png --device cuda "
        "--runtime torch --no-heatmaps --output /tmp/out && cat /tmp/out/results.jsonl",
    )
    on_gpu = json.loads(result.stdout.strip().splitlines()[-1])
    run_cli(
        "-q",
        "predict",
        trained,
        image_path,
        "--output",
        tmp_path,
        "--no-heatmaps",
        "--device",
        "cpu",
        "--runtime",
        "torch",
    )
    on_cpu = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])
    assert on_gpu["raw_score"] == pytest.approx(on_cpu["raw_score"], rel=CROSS_DEVICE_RTOL)
