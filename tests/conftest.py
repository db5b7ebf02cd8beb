"""Shared fixtures: a small generated data set and a detector trained on it through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from padim.synthetic import generate

IMAGE_SIZE = 64  # model input; keeps the whole suite at a few minutes on 2 cores


def run_cli(*args: str, check: bool = True, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the real ``padim`` command line in a subprocess."""
    result = subprocess.run(
        [sys.executable, "-m", "padim", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )
    if check and result.returncode != 0:
        raise AssertionError(f"padim {' '.join(map(str, args))} failed ({result.returncode}):\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """An MVTec-layout 'weave' category: 30 train, 6 good + 3x4 defective test images, 96 px."""
    root = tmp_path_factory.mktemp("data")
    (category,) = generate(root, ("weave",), train=30, test_good=6, test_defect=4, size=96, seed=0)
    return category


@pytest.fixture(scope="session")
def model_file(dataset, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "weave.padim"
    result = run_cli("-q", "train", dataset / "train" / "good", "--output", path,
                     "--weights", "random", "--image-size", IMAGE_SIZE, "--batch-size", 8)
    summary = json.loads(result.stdout)
    assert summary["images"] == 30
    return path
