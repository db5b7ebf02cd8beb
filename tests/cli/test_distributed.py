"""Fits split across processes (torchrun + Gloo on loopback) and partial fits merged later.

Both sides use --batch-size 1 and one OpenMP thread per process: then every image's float32
features are computed the same way whatever shard it falls in (oneDNN's results depend on the
batch and the thread count), and the accumulators must agree to float64 round-off.
"""

import json
import subprocess
import sys

import pytest
import torch
from helpers import IMAGE_SIZE, free_port, run_cli

from padim.core import load_artifact

COMMON = [
    "--weights",
    "random",
    "--image-size",
    str(IMAGE_SIZE),
    "--batch-size",
    "1",
    "--device",
    "cpu",
]  # Gloo, on any machine
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "padim",
        "-q",
        *map(str, args),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, **ONE_THREAD}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_same_statistics(a: dict, b: dict) -> None:
    assert int(a["statistics.count"]) == int(b["statistics.count"])
    torch.testing.assert_close(a["statistics.mean"], b["statistics.mean"], rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(a["statistics.comoment"], b["statistics.comoment"], rtol=1e-9, atol=1e-9)


@pytest.mark.system
@pytest.mark.parametrize("count, parity", [(29, "odd"), (30, "even")])
def test_two_gloo_processes_equal_one(dataset, tmp_path, count, parity):
    data = tmp_path / "data"
    data.mkdir()
    for p in sorted((dataset / "train" / "good").glob("*.png"))[:count]:
        (data / p.name).write_bytes(p.read_bytes())
    torchrun(2, "train", data, "--output", tmp_path / "two.padim", *COMMON)
    # torchrun makes no int8 scorer and runs torch's backbone; one process would make one, and run its float32
    # backbone in ONNX Runtime (float32 rounding apart): the same arithmetic on both sides
    run_cli("-q", "train", data, "--output", tmp_path / "one.padim", "--no-int8-scorer", *COMMON, env=ONE_THREAD)
    two, h2 = load_artifact(tmp_path / "two.padim")
    one, h1 = load_artifact(tmp_path / "one.padim")
    assert h2["fits"][-1]["world_size"] == 2 and h1["fits"][-1]["world_size"] == 1
    assert h1["fit_image_count"] == count and count % 2 == (1 if parity == "odd" else 0)
    assert_same_statistics(two, one)
    torch.testing.assert_close(two["mean"], one["mean"])
    torch.testing.assert_close(two["precision_factor"].float(), one["precision_factor"].float(), rtol=1e-3, atol=1e-3)
    # every fold was scored on one of the two ranks: the same out-of-fold scores and threshold
    torch.testing.assert_close(two["calibration.scores"], one["calibration.scores"], rtol=1e-5, atol=0)
    assert h2["calibration"]["threshold"] == pytest.approx(h1["calibration"]["threshold"], rel=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "one.padim", "two.padim"]  # rank 1 wrote nothing


def test_partial_fits_merged_equal_one_shot(dataset, tmp_path):
    images = sorted((dataset / "train" / "good").glob("*.png"))
    folders = {"a": images[:11], "b": images[11:24], "ab": images[:24], "calibration": images[24:]}
    for name, chunk in folders.items():
        (tmp_path / name).mkdir()
        for p in chunk:
            (tmp_path / name / p.name).write_bytes(p.read_bytes())
    for name in ("a", "b", "ab"):
        out = json.loads(
            run_cli("-q", "train", tmp_path / name, "--output", tmp_path / f"{name}.part", "--partial", *COMMON).stdout
        )
        assert out["kind"] == "partial" and out["fitted"] == out["fit_image_count"] == len(folders[name])
    merged = json.loads(
        run_cli(
            "-q",
            "merge",
            tmp_path / "a.part",
            tmp_path / "b.part",
            "--output",
            tmp_path / "m.padim",
            "--calibration-dir",
            tmp_path / "calibration",
        ).stdout
    )
    assert merged["fit_image_count"] == 24 and merged["calibration"]["scores"] == 6
    m, header = load_artifact(tmp_path / "m.padim")
    ab, _ = load_artifact(tmp_path / "ab.part")
    assert_same_statistics(m, ab)
    assert header["kind"] == "padim-detector" and header["calibration"]["scores"] == 6
    assert header["calibration_source"] == "held_out" and header["merged_from"] == [
        str(tmp_path / "a.part"),
        str(tmp_path / "b.part"),
    ]
    overlap = run_cli(
        "merge",
        tmp_path / "a.part",
        tmp_path / "b.part",
        "--output",
        tmp_path / "x.padim",
        "--calibration-dir",
        tmp_path / "a",
        check=False,
    )
    assert (
        overlap.returncode == 1 and "were fitted in the parts" in overlap.stderr and not (tmp_path / "x.padim").exists()
    )
    run_cli("-q", "predict", tmp_path / "m.padim", dataset / "test" / "good", "--output", tmp_path / "pred")
    refused = run_cli(
        "predict", tmp_path / "a.part", dataset / "test" / "good", "--output", tmp_path / "p2", check=False
    )
    assert refused.returncode == 1 and "padim merge" in refused.stderr


def test_parts_fitted_at_fp16_are_gated_when_merged(dataset, tmp_path):
    """A merge of reduced-precision parts is gated as ``train`` gates a model (on the calibration pictures):
    refused with the figures past ``--max-score-error``, nothing written; ``--force`` writes it, marked."""
    images = sorted((dataset / "train" / "good").glob("*.png"))
    for name, chunk in {"a": images[:12], "b": images[12:24], "calibration": images[24:]}.items():
        (tmp_path / name).mkdir()
        for p in chunk:
            (tmp_path / name / p.name).write_bytes(p.read_bytes())
    for name in ("a", "b"):
        run_cli(
            "-q", "train", tmp_path / name, "-o", tmp_path / f"{name}.part", "--partial", "--precision", "fp16", *COMMON
        )
    merge = ["merge", tmp_path / "a.part", tmp_path / "b.part", "--calibration-dir", tmp_path / "calibration"]
    refused = run_cli(*merge, "-o", tmp_path / "r.padim", "--max-score-error", "1e-9", check=False)
    assert refused.returncode == 1 and "fp16 model is not accurate enough" in refused.stderr
    assert not (tmp_path / "r.padim").exists()
    forced = run_cli("-q", *merge, "-o", tmp_path / "f.padim", "--max-score-error", "1e-9", "--force")
    check = json.loads(forced.stdout)["precision_check"]
    assert check["forced"] and not check["passed"] and check["images"] == len(images) - 24
    default = json.loads(run_cli("-q", *merge, "-o", tmp_path / "d.padim").stdout)["precision_check"]
    assert default["passed"] and default["tolerance"] == 0.02
    bad = run_cli(*merge, "-o", tmp_path / "x.padim", "--max-score-error", "0", check=False)
    assert bad.returncode == 1 and "must be a positive number" in bad.stderr


@pytest.mark.system
def test_partial_under_torchrun_equals_single_process(dataset, tmp_path):
    data = dataset / "train" / "good"
    torchrun(2, "train", data, "--output", tmp_path / "two.part", "--partial", *COMMON)
    run_cli("-q", "train", data, "--output", tmp_path / "one.part", "--partial", *COMMON, env=ONE_THREAD)
    assert_same_statistics(load_artifact(tmp_path / "two.part")[0], load_artifact(tmp_path / "one.part")[0])


@pytest.mark.parametrize(
    "flag, value, message",
    [("--image-size", "32", "image_size=32"), ("--seed", "1", "seed=1"), ("--layers", "layer1,layer2", "layers=")],
)
def test_mismatched_parts_are_refused(dataset, tmp_path, weights_file, flag, value, message):
    data = tmp_path / "few"
    data.mkdir()
    for p in sorted((dataset / "train" / "good").glob("*.png"))[:6]:
        (data / p.name).write_bytes(p.read_bytes())
    args = [
        "--weights",
        weights_file,
        "--image-size",
        str(IMAGE_SIZE),
        "--embedding-dim",
        "50",
    ]  # same weights whatever --seed
    run_cli("-q", "train", data, "--output", tmp_path / "a.part", "--partial", *args)
    run_cli("-q", "train", data, "--output", tmp_path / "b.part", "--partial", *args, flag, value)
    result = run_cli(
        "merge",
        tmp_path / "a.part",
        tmp_path / "b.part",
        "--output",
        tmp_path / "m.padim",
        "--calibration-dir",
        data,
        check=False,
    )
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "m.padim").exists()


def test_a_rank_joins_its_group_and_gpu_before_it_loads_the_model_it_resumes(
    dataset, model_file, tmp_path, monkeypatch
):
    """Loading --resume first put every rank's statistics on cuda:0 (finding 2 of the GPU review)."""
    from padim.cli import main
    from padim.models.errors import UsageError
    from padim.models.fit import distributed

    events = []

    def join(device):
        events.append("join")
        return distributed.Shard(0, 2)

    def load_fit(path, **kwargs):
        events.append("load")
        raise UsageError("stop here")

    monkeypatch.setattr(distributed, "from_environment", join)
    monkeypatch.setattr(distributed, "leave", lambda shard: events.append("leave"))
    monkeypatch.setattr("padim.models.fit.model_file.load_fit", load_fit)
    status = main(
        [
            "-q",
            "train",
            str(dataset / "train" / "good"),
            "--output",
            str(tmp_path / "m.padim"),
            "--resume",
            str(model_file),
            "--device",
            "cpu",
        ]
    )
    assert status == 1 and events == ["join", "load", "leave"]


@pytest.mark.parametrize(("text", "seconds"), [(None, 1800.0), ("", 1800.0), ("90", 90.0), ("2.5", 2.5)])
def test_collectives_time_out_after_padim_dist_timeout_s(text, seconds):
    from padim.models.fit.distributed import timeout_seconds

    assert timeout_seconds(text) == seconds


@pytest.mark.parametrize("text", ["0", "-5", "soon", "nan"])
def test_a_bad_padim_dist_timeout_s_is_a_usage_error(text):
    from padim.models.errors import UsageError
    from padim.models.fit.distributed import timeout_seconds

    with pytest.raises(UsageError, match="PADIM_DIST_TIMEOUT_S"):
        timeout_seconds(text)
