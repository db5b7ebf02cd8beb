"""The run folder's pieces on their own: a version's view, the table, slots."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from PIL import Image

from padim.models.deploy.runtimes import load_scorer
from padim.service.edge.errors import ApiError
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


def test_the_settings_reach_a_child_with_their_keys_and_the_keys_are_in_no_file(run):
    settings = run.settings(run.secrets_pipe())
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "k"
    assert settings.models == run.settings(run.secrets_pipe()).models  # each child its own pipe
    assert (run.root / "settings.json").stat().st_mode & 0o777 == 0o600
    assert not [path for path in run.root.rglob("*") if path.is_file() and b'"k"' in path.read_bytes()]
    assert RunFolder(run.root).settings(RunFolder(run.root).secrets_pipe()).api_key is None  # a child holds none


def test_a_start_sweeps_the_run_folders_of_supervisors_that_are_gone(tmp_path):
    """By pid and start time in this pid namespace: a gone supervisor's folder goes, a running one's (this
    process's, or one whose pid now names another process) stays where that process is it, another namespace's
    and another name's stay."""
    from padim.service.processes.shared import pid_namespace, process_start, sweep

    me, namespace = os.getpid(), pid_namespace()
    gone = _a_pid_that_is_gone()
    folders = {
        "running": tmp_path / f"padim-{namespace}-{me}-{process_start(me)}-aaaaaaaa",
        "gone": tmp_path / f"padim-{namespace}-{gone}-12345-bbbbbbbb",
        "pid reused": tmp_path / f"padim-{namespace}-{me}-{process_start(me) - 1}-cccccccc",
        "other namespace": tmp_path / f"padim-{namespace + 1}-{gone}-12345-dddddddd",
        "older name": tmp_path / f"padim-{gone}-eeeeeeee",
    }
    for folder in folders.values():
        folder.mkdir()
        (folder / "status").write_bytes(b"x")
    removed = sweep(tmp_path)
    assert sorted(removed) == sorted([folders["gone"], folders["pid reused"]])
    assert {name for name, folder in folders.items() if folder.exists()} == {"running", "other namespace", "older name"}


def _a_pid_that_is_gone() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


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
