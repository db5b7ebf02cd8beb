"""Shared fixtures: a small generated data set and a detector trained on it through the CLI."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import uuid
from pathlib import Path

import docker_image
import pytest
from helpers import IMAGE_SIZE, RUN_ENV, made_once, run_cli, run_folder, running_server

from padim.models.data.synthetic import generate


def pytest_configure(config):
    """System components (tests/components.py) skip or fail where missing.

    The default suite runs on the CPU on every machine; ``pytest -m cuda`` runs the CUDA suite (tests/cuda).

    Tests that leave ``--device`` at ``auto`` would otherwise run on a GPU where there is one, and
    compare with CPU references that were never meant for it. Hidden before torch first asks CUDA
    (torch reads ``CUDA_VISIBLE_DEVICES`` then), and inherited by every CLI and server subprocess.
    """
    import components
    import durations
    import scheduling

    config.pluginmanager.register(components, "padim-system-components")  # markers for docker, browser, ...
    config.pluginmanager.register(durations, "padim-durations")  # each test's seconds by kind of work
    config.pluginmanager.register(scheduling, "padim-scheduling")  # both cores: files, load-sensitive tests apart
    os.environ.setdefault(RUN_ENV, uuid.uuid4().hex[:12])  # the run's name, inherited by xdist's workers
    # OpenMP threads wait for work asleep, not spinning: two workers share the cores, and a spinning thread of one
    # takes its core from the other (measured on 2 cores beside a busy one: a file of fits took 104 s spinning, 76 s
    # asleep; alone 65 s and 57 s). libgomp reads it when loaded: in every worker and process the tests start, set
    # before they import torch.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    one_tls_context_for_every_client()
    expression = (config.option.markexpr or "").replace("not cuda", "")
    if "cuda" not in expression:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def one_tls_context_for_every_client() -> None:
    """The tests speak plain HTTP to 127.0.0.1, yet httpx makes an SSL context, reading certifi's CA bundle, for every
    client it makes, and each module-level ``httpx.get`` or ``httpx.post`` is a new client: 26 ms of CPU here, more
    than the request it makes (py-spy over ``-m "not system"`` on 2 cores: a tenth of the run's CPU, half of it in the
    readiness polls, beside the server that was starting). One context, made once, serves every client that asks for
    httpx's default verification; any other asks httpx as before."""
    import httpx._config
    import httpx._transports.default as transports

    make = httpx._config.create_ssl_context
    made: dict[tuple, ssl.SSLContext] = {}  # by what httpx reads to make it: the same inputs, the same context

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in made:
            made[key] = make(verify=verify, cert=cert, trust_env=trust_env)
        return made[key]

    assert transports.create_ssl_context is make, "httpx no longer makes its transports' contexts here"
    transports.create_ssl_context = create_ssl_context


def pytest_collection_finish(session):
    """The Docker image's build starts now, in the background, where a test will need it and an engine can build it
    (tests/docker_image.py): its minutes of download and unpacking overlap the tests before it."""
    import components

    if any("image" in item.fixturenames for item in session.items if item.get_closest_marker("docker")):
        if components.COMPONENTS["docker"].missing() is None:
            docker_image.start()


def pytest_terminal_summary(terminalreporter):
    for line in docker_image.reported():  # what the Docker tests measured (the image's size, its build)
        terminalreporter.write_line(line)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):  # the run's first process: the others (xdist's workers) are gone
        docker_image.finish()
        shutil.rmtree(run_folder(), ignore_errors=True)


# The session's data and models are made once for the whole run, whichever worker asks first (helpers.made_once):
# the other worker reads them, and the exports a server makes of a model at its first load are cached beside it.
@pytest.fixture(scope="session")
def dataset() -> Path:
    """An MVTec-layout 'weave' category: 30 train, 6 good + 3x4 defective test images, 96 px."""

    def make(root: Path) -> None:
        generate(root, ("weave",), train=30, test_good=6, test_defect=4, size=96, seed=0)

    return made_once("data", make) / "weave"


@pytest.fixture(scope="session")
def weights_file() -> Path:
    """A resnet18 state_dict file of seeded random weights: the same weights whatever --seed a test passes."""

    def make(path: Path) -> None:
        import torch
        import torchvision

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            torch.save(torchvision.models.resnet18().state_dict(), path)

    return made_once("resnet18-seed0.pth", make)


def train_weave(dataset: Path, path: Path, *options):
    """``padim train`` of the generated line's good pictures, random weights, the tests' image size; ``options``
    added."""
    return run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        path,
        "--weights",
        "random",
        "--image-size",
        IMAGE_SIZE,
        "--batch-size",
        8,
        *options,
    )


@pytest.fixture(scope="session")
def model_file(dataset) -> Path:
    def make(path: Path) -> None:
        summary = json.loads(train_weave(dataset, path).stdout)
        assert summary["images"] == 30

    return made_once("weave.padim", make)


@pytest.fixture(scope="session")
def model_export(model_file) -> Path:
    """``padim export`` of ``model_file`` (ONNX, the default format), for the tests that only read it."""
    return made_once("weave-export", lambda path: run_cli("-q", "export", model_file, "--output", path))


@pytest.fixture(scope="session")
def model_export_openvino(model_file) -> Path:
    """``padim export --format openvino`` of ``model_file``, for the tests that only read it."""
    return made_once(
        "weave-export-openvino",
        lambda path: run_cli("-q", "export", model_file, "--format", "openvino", "--output", path),
    )


@pytest.fixture(scope="session")
def second_model(dataset) -> Path:
    """Another model of the same line: other random projection (another --seed), so other raw scores."""
    return made_once("weave-v2.padim", lambda path: train_weave(dataset, path, "--seed", 1, "--false-alarm-rate", 0.05))


@pytest.fixture(scope="session", params=[1, 2], ids=["one process", "two API processes"])
def server(request, model_file, tmp_path_factory):
    """A real `padim serve` (uvicorn) on 127.0.0.1 serving ``model_file``: one process, then a supervisor with a
    scoring process and two API processes (``--workers 2``): every test of it runs on both layouts."""
    workers = str(request.param)
    with running_server(tmp_path_factory.mktemp("server"), [model_file], args=("--workers", workers)) as running:
        yield running


@pytest.fixture(scope="session")
def postgres_cluster():
    """A throwaway PostgreSQL cluster (tests/postgres.py) for the whole run; each test takes a database of its own."""
    import postgres

    cluster = postgres.Cluster()
    yield cluster
    cluster.remove()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def record_url(request) -> str | None:
    """The record's database: ``None`` (SQLite in the record's folder, the default) or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return None
    return request.getfixturevalue("postgres_cluster").new_database()
