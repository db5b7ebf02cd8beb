"""Shared fixtures: a small generated data set and a detector trained on it through the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import IMAGE_SIZE, run_cli, running_server

from padim.models.data.synthetic import generate


def pytest_configure(config):
    """System components (tests/components.py) skip or fail where missing.

    The default suite runs on the CPU on every machine; ``pytest -m cuda`` runs the CUDA suite (tests/cuda).

    Tests that leave ``--device`` at ``auto`` would otherwise run on a GPU where there is one, and
    compare with CPU references that were never meant for it. Hidden before torch first asks CUDA
    (torch reads ``CUDA_VISIBLE_DEVICES`` then), and inherited by every CLI and server subprocess.
    """
    import components

    config.pluginmanager.register(components, "padim-system-components")  # markers for docker, browser, ...
    expression = (config.option.markexpr or "").replace("not cuda", "")
    if "cuda" not in expression:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """An MVTec-layout 'weave' category: 30 train, 6 good + 3x4 defective test images, 96 px."""
    root = tmp_path_factory.mktemp("data")
    (category,) = generate(root, ("weave",), train=30, test_good=6, test_defect=4, size=96, seed=0)
    return category


@pytest.fixture(scope="session")
def weights_file(tmp_path_factory) -> Path:
    """A resnet18 state_dict file of seeded random weights: the same weights whatever --seed a test passes."""
    import torch
    import torchvision

    path = tmp_path_factory.mktemp("weights") / "resnet18-seed0.pth"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.save(torchvision.models.resnet18().state_dict(), path)
    return path


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
def model_file(dataset, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "weave.padim"
    result = train_weave(dataset, path)
    summary = json.loads(result.stdout)
    assert summary["images"] == 30
    return path


@pytest.fixture(scope="session")
def second_model(dataset, tmp_path_factory) -> Path:
    """Another model of the same line: other random projection (another --seed), so other raw scores."""
    path = tmp_path_factory.mktemp("second") / "weave-v2.padim"
    train_weave(dataset, path, "--seed", 1, "--false-alarm-rate", 0.05)
    return path


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
