"""The run folder's pieces on their own: a version's view, the table, slots."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from padim.models.deploy.runtimes import load_scorer
from padim.service.errors import ApiError
from padim.service.processes.shared import RunFolder, ScorerView, SlotMaps, SlotPool, Table, view_of
from padim.service.settings import ServiceSettings


@pytest.fixture
def run(tmp_path, monkeypatch, model_file) -> RunFolder:
    monkeypatch.setattr("padim.service.processes.shared.shared_memory_root", lambda: tmp_path)
    folder = RunFolder.create(ServiceSettings(models=[model_file], api_key="k"), workers=2)
    yield folder
    folder.remove()


@pytest.mark.parametrize("runtime", ["torch", "onnxruntime"])
def test_a_view_decodes_and_judges_as_its_scorer(model_file, dataset, runtime):
    """What an API process reads of a version, through JSON as the run folder holds it: the same model input and
    the same calibration (hence verdicts) as the scorer itself."""
    scorer = load_scorer(model_file, runtime, "cpu")
    view = ScorerView(json.loads(json.dumps(view_of("weave", 3, 7, "abc", scorer))))
    picture = Image.open(dataset / "test" / "hole" / "000.png").convert("RGB")
    assert torch.equal(view.preprocess([picture]), scorer.preprocess([picture]))  # the same arithmetic: bit for bit
    assert view.config == scorer.config and view.calibration == scorer.calibration
    assert view.framing.describe() == scorer.framing.describe()
    assert view.weights.public_label == scorer.weights.public_label
    assert view.provenance.created == scorer.provenance.created


def test_the_settings_keep_their_keys_for_the_other_processes(run):
    settings = run.settings()
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "k"
    assert (run.root / "settings.json").stat().st_mode & 0o777 == 0o600


def test_the_table_is_read_again_when_its_generation_changes(run, model_file):
    table = Table(run)
    with pytest.raises(ApiError) as loading:
        table.served(None)
    assert loading.value.code == "not_ready"
    scorer = load_scorer(model_file, "torch", "cpu")
    view = view_of("weave", 1, 1, "abc", scorer)
    run.publish(
        {
            "engine": 1,
            "ready": True,
            "default": "weave",
            "models": {"weave": {"serial": 1, "version": 1}},
            "indices": {"weave": 0},
        },
        {1: view},
    )
    served = table.served(None)
    assert (served.name, served.version, served.serial) == ("weave", 1, 1) and table.index("weave") == 0
    run.publish(
        {
            "engine": 1,
            "ready": True,
            "default": "weave",
            "models": {"weave": {"serial": 2, "version": 2}},
            "indices": {"weave": 0},
        },
        {2: {**view, "version": 2, "serial": 2}},
    )
    assert table.served("weave").version == 2
    with pytest.raises(ApiError) as unknown:
        table.served("carpet")
    assert unknown.value.code == "model_not_found"
    run.publish({"engine": 2, "ready": False, "failure": "the GPU failed"}, {})
    with pytest.raises(ApiError) as failed:
        table.served(None)
    assert failed.value.code == "not_ready" and "the GPU failed" in failed.value.message


def test_slots_are_shared_memory_reused_by_size(run):
    pool, maps = SlotPool(run, 1), SlotMaps(run)
    slot = pool.take(3 * 8 * 8 * 4)
    slot.tensor(3, 8, 8).copy_(torch.arange(192, dtype=torch.float32).view(3, 8, 8))
    seen = maps.get(1, slot.number, slot.nbytes).tensor(3, 8, 8)  # as the scoring process maps it
    assert torch.equal(seen, torch.arange(192, dtype=torch.float32).view(3, 8, 8))
    seen[0, 0, 0] = -1.0  # a map written back
    assert slot.tensor(1)[0] == -1.0
    pool.give([slot])
    assert pool.take(700).number == slot.number  # the same size class: reused, not made again
    assert pool.take(700).number != slot.number
    SlotPool(run, 1)  # a successor in the row removes its predecessor's slots
    assert not list((run.root / "slots").glob("1-*"))


def test_a_burst_leaves_at_most_keep_free_slots_behind(run):
    pool = SlotPool(run, 2, keep=1)
    first, second = pool.take(1000), pool.take(1000)
    pool.give([first, second])
    assert first.path.exists() and not second.path.exists()  # removed: its memory goes back once unmapped
    assert pool.take(1000) is first
