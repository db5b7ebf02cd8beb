"""Every file in configs/ is read as written and trains a tiny model through the real CLI.

ImageNet weights cannot be fetched in tests, so ``--weights random`` and a small ``--image-size``
override the file; every other option is the file's own, and the model file says so.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import run_cli

from padim.core.artifact import read_header
from padim.models.config import PadimConfig, read_config_file
from padim.models.options import OPTIONS, RENAMED

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
#: What a test must override: ImageNet weights are out of reach, and small images keep it quick.
OVERRIDDEN = {"weights", "image_size"}


def test_there_are_configs():
    assert {p.stem for p in CONFIGS} >= {"demo", "resnet18", "wide_resnet50_2"}


def written_as_stored(key: str, value, listed: bool = False):
    """A YAML value as the configuration holds it: lists as tuples (as lists in a file's header), ``expect``'s
    presets as their bounds."""
    if key == "expect":
        return PadimConfig(expect=value).gaussian.expect
    return tuple(value) if isinstance(value, list) and not listed else value


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_config_uses_current_names_and_allowed_values(path):
    values = yaml.safe_load(path.read_text())
    assert not set(values) & set(RENAMED), f"{path.name} uses an old name: {set(values) & set(RENAMED)}"
    config, given = read_config_file(path)
    assert given == set(values)
    assert given <= set(OPTIONS)
    for key, value in values.items():
        assert config.to_dict()[key] == written_as_stored(key, value)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_config_trains_a_tiny_model(path, dataset, tmp_path):
    images = tmp_path / "good"
    images.mkdir()
    for source in sorted((dataset / "train" / "good").glob("*.png"))[:6]:
        shutil.copy(source, images / source.name)
    output = tmp_path / f"{path.stem}.padim"
    result = run_cli(
        "-q",
        "train",
        images,
        "--config",
        path,
        "--weights",
        "random",
        "--image-size",
        64,
        "--output",
        output,
        "--device",
        "cpu",
        timeout=600,
    )
    summary = json.loads(result.stdout)
    assert summary["fit_image_count"] == 6
    stored = read_header(output)["config"]
    written = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k not in OVERRIDDEN | {"device"}}
    for key, value in written.items():
        assert stored[key] == written_as_stored(key, value, listed=True), (key, stored[key], value)
    assert stored["weights"] == "random" and stored["image_size"] == 64
