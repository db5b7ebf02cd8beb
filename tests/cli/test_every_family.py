"""Every backbone family through everything downstream, as a user runs it: one small backbone of each family that is
not a ResNet (the rest of the suite runs resnet18) fits, resumes, fits in parts (one of them under torchrun) that
merge, is tiled, exports to ONNX, OpenVINO and Triton and scores alike there, fits at int8, bf16 and fp16 within
their gates, and is served and described. Seeded random weights at 64 px, 12 pictures: a model, not a good one.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from helpers import free_port, run_cli
from PIL import Image

from padim.models.deploy.runtimes import load_scorer
from padim.models.families import BACKBONES
from padim.models.features.embedding import model_input
from padim.models.fit.model_file import load_detector
from padim.service.app import create_app
from padim.service.settings import ServiceSettings

#: One of each family but ResNet's: VGG16 (the learned weights at hand are a VGG16's) and the smallest of the others.
FAMILIES = ("vgg16", "efficientnet_b0", "mobilenet_v3_small", "convnext_tiny")
#: A weight given: `--shrinkage auto` estimates its weight again on a resume or a merge, from the tails of the
#: pictures it reads then (docs/training.md), so only a given weight scores exactly as the one-shot fit.
COMMON = ("--weights", "random", "--image-size", "64", "--batch-size", "4", "--expect", "stable", "--shrinkage", "0.5")


@pytest.fixture(scope="module")
def folders(dataset, tmp_path_factory) -> dict[str, Path]:
    """``a`` (6 pictures), ``b`` (6 others), ``ab`` (both), ``calibration`` (4 more, for a merge)."""
    root = tmp_path_factory.mktemp("families")
    images = sorted((dataset / "train" / "good").glob("*.png"))
    chunks = {"a": images[:6], "b": images[6:12], "ab": images[:12], "calibration": images[12:16]}
    for name, chunk in chunks.items():
        (root / name).mkdir()
        for picture in chunk:
            (root / name / picture.name).write_bytes(picture.read_bytes())
    return {name: root / name for name in chunks}


def train(folder: Path, output: Path, backbone: str, *options) -> dict:
    return json.loads(run_cli("-q", "train", folder, "-o", output, "--backbone", backbone, *COMMON, *options).stdout)


@pytest.fixture(scope="module", params=FAMILIES)
def one_shot(request, folders, tmp_path_factory) -> tuple[str, Path]:
    """The backbone's model of ``ab`` in one fit, tiled (two tiles a picture, a Gaussian per tile position)."""
    path = tmp_path_factory.mktemp(request.param) / "ab.padim"
    summary = train(folders["ab"], path, request.param, "--tiles", "1x2")
    assert summary["backbone"] == request.param and summary["fit_image_count"] == 12
    assert summary["backbone_family"] == BACKBONES[request.param].family
    assert summary["stages"] == list(BACKBONES[request.param].default_stages)
    return request.param, path


@pytest.fixture(scope="module")
def test_batch(dataset, one_shot) -> torch.Tensor:
    """Five test pictures (good and defective) as the model reads them: 8-bit, framed."""
    paths = sorted((dataset / "test").rglob("*.png"))[::3][:5]
    return load_detector(one_shot[1], device="cpu").preprocess([Image.open(p).convert("RGB") for p in paths])


def scores(model: Path, batch: torch.Tensor) -> torch.Tensor:
    return load_detector(model, device="cpu").score(batch).raw_scores.double()


def assert_close_scores(got: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    relative = ((got.double() - expected).abs() / expected.abs()).max()
    assert relative <= rtol, f"scores differ by {float(relative):.2e} relative"


def test_padim_info_names_the_family_and_the_stages_it_reads(one_shot):
    backbone, path = one_shot
    info = json.loads(run_cli("info", path).stdout)
    spec = BACKBONES[backbone]
    assert info["backbone"] == backbone and info["backbone_family"] == spec.family
    assert [s["name"] for s in info["stages"]] == list(spec.default_stages)
    assert [(s["channels"], s["stride"]) for s in info["stages"]] == list(
        zip(spec.channels[:3], spec.strides[:3], strict=True)
    )
    assert info["header"]["backbone"]["family"] == spec.family and info["tiles"] == [1, 2]


@pytest.mark.system  # torchrun
def test_a_resumed_fit_and_merged_parts_one_under_torchrun_score_as_the_one_shot_fit(
    one_shot, folders, test_batch, tmp_path
):
    backbone, path = one_shot
    expected = scores(path, test_batch)
    train(folders["a"], tmp_path / "a.padim", backbone, "--tiles", "1x2")
    resumed = train(folders["ab"], tmp_path / "ab.padim", backbone, "--tiles", "1x2", "--resume", tmp_path / "a.padim")
    assert resumed["fit_image_count"] == 12 and resumed["already_fitted"] == 6
    # the statistics of the same pictures in other batches: float32 features to their last bits, so scores to 1e-5
    assert_close_scores(scores(tmp_path / "ab.padim", test_batch), expected, 1e-5)
    train(folders["a"], tmp_path / "a.part", backbone, "--tiles", "1x2", "--partial")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    import subprocess

    done = subprocess.run(
        [*torchrun, "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "padim", "-q", "train",
         str(folders["b"]), "-o", str(tmp_path / "b.part"), "--backbone", backbone, *COMMON, "--tiles", "1x2",
         "--partial", "--device", "cpu"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    merge = ["-q", "merge", tmp_path / "a.part", tmp_path / "b.part", "-o", tmp_path / "m.padim"]
    merged = json.loads(run_cli(*merge, "--calibration-dir", folders["calibration"]).stdout)
    assert merged["fit_image_count"] == 12
    # the same Gaussians (held-out calibration pictures set another threshold: the raw scores are compared)
    assert_close_scores(scores(tmp_path / "m.padim", test_batch), expected, 1e-5)


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_every_runtime_scores_as_torch_does(one_shot, test_batch, runtime):
    """The tolerances the ResNets' parity has (tests/models/deploy/test_runtimes.py): image scores within 1e-4
    relative, maps within 1e-3 of their scale."""
    _, path = one_shot
    reference = load_detector(path, device="cpu")
    expected = reference.score(test_batch)
    deployed = load_scorer(path, runtime, "cpu")
    got = deployed.score(test_batch)
    assert_close_scores(got.raw_scores, expected.raw_scores.double(), 1e-4)
    assert (got.maps - expected.maps).abs().max() <= 1e-3 * expected.maps.abs().max()
    assert deployed.describe()["stages"] == reference.describe()["stages"]
    assert deployed.describe()["backbone_family"] == BACKBONES[one_shot[0]].family


@pytest.mark.parametrize("one_shot", ["vgg16", "efficientnet_b0"], indirect=True)
def test_the_triton_repository_scores_as_torch_does(one_shot, test_batch, tmp_path):
    """Triton's model repository, its graph run as Triton's onnxruntime backend would, for the two families the
    issue names (its graph is the ONNX export's, which every family's test above runs)."""
    import onnxruntime

    _, path = one_shot
    run_cli("-q", "export", path, "--format", "triton", "--output", tmp_path / "triton", "--name", "m")
    session = onnxruntime.InferenceSession(
        str(tmp_path / "triton" / "m" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    _, raw, _ = session.run(None, {"images": model_input(test_batch).numpy()})
    assert_close_scores(torch.from_numpy(np.asarray(raw)), scores(path, test_batch), 1e-4)


@pytest.mark.parametrize("precision", ["int8", "bf16", "fp16"])
def test_a_reduced_precision_fits_within_its_gate_and_scores_on_its_runtime(one_shot, folders, precision, tmp_path):
    backbone, _ = one_shot
    options = ["--precision", precision]
    if precision == "int8" and backbone in ("efficientnet_b0", "mobilenet_v3_small"):
        # seeded random weights quantise poorly on these families: 19% and 18% largest score error with
        # --standardise none, 27% with the default gain, on these 12 pictures (2-core Intel Xeon VM), past the
        # default tolerance of 25%; the gate's mechanics are what is tested
        options += ["--max-score-error", "0.35"]
    summary = train(folders["ab"], tmp_path / f"{precision}.padim", backbone, *options)
    check = summary["precision_check"]
    assert summary["precision"] == precision and check["passed"] and not check["forced"]
    if precision == "int8":  # its own graph on ONNX Runtime (bf16 and fp16 run in torch, as the gate ran them)
        predicted = json.loads(
            run_cli("-q", "predict", tmp_path / "int8.padim", folders["calibration"], "-o", tmp_path / "p").stdout
        )
        assert predicted["images"] == 4 and predicted["failed"] == 0 and predicted["runtime"] == "onnxruntime"


def test_the_service_describes_the_family_and_scores_as_torch_does(one_shot, dataset):
    backbone, path = one_shot
    picture = dataset / "test" / "good" / "000.png"
    with TestClient(create_app(ServiceSettings(models=[path], device="cpu", runtime="torch"))) as client:
        for _ in range(600):
            if client.get("/health/ready").status_code == 200:
                break
            time.sleep(0.05)
        (described,) = client.get("/models").json()["models"]
        scored = client.post("/score", content=picture.read_bytes(), headers={"content-type": "image/png"}).json()
    assert described["backbone"] == backbone and described["backbone_family"] == BACKBONES[backbone].family
    assert [s["name"] for s in described["stages"]] == list(BACKBONES[backbone].default_stages)
    assert described["layers"] == list(BACKBONES[backbone].default_stages)
    detector = load_detector(path, device="cpu")
    expected = detector.score(detector.preprocess([Image.open(picture).convert("RGB")])).raw_scores[0]
    assert scored["raw_score"] == pytest.approx(float(expected), rel=1e-5)


@pytest.fixture(scope="module")
def calibration_pictures(tmp_path_factory) -> Path:
    """52 more normal pictures of the line (another seed of the generator): the 32 a quantised export's quantiser
    reads and 20 for its threshold."""
    from padim.models.data.synthetic import generate

    root = tmp_path_factory.mktemp("calibration")
    generate(root, ("weave",), train=52, test_good=1, test_defect=1, size=96, seed=3)
    return root / "weave" / "train" / "good"


def test_a_quantised_openvino_export_passes_its_gate_and_says_what_it_reads(one_shot, calibration_pictures, tmp_path):
    """``padim export --format openvino --precision int8`` (NNCF) of the fp32 model: its gate on calibration
    pictures, its description. A gate may refuse a backbone's int8 graph (random ConvNeXt's, on this project's
    AVX2 EPYC: a median score error of 17%): then it says so with its figures and writes nothing, and ``--force``
    writes it marked as forced."""
    backbone, path = one_shot
    export = [
        "export",
        path,
        "--format",
        "openvino",
        "--precision",
        "int8",
        "--calibration-images",
        calibration_pictures,
    ]
    done = run_cli("-q", *export, "--output", tmp_path / "int8", check=False)
    if done.returncode:
        assert "the int8 scorer is not accurate enough" in done.stderr and "median" in done.stderr, done.stderr
        assert not (tmp_path / "int8").exists()
        run_cli("-q", *export, "--output", tmp_path / "int8", "--force")
    info = json.loads(run_cli("info", tmp_path / "int8").stdout)
    agreement = info["quantisation"]["agreement"]
    assert info["precision"] == "int8" and agreement["passed"] != agreement["forced"]
    assert info["backbone_family"] == BACKBONES[backbone].family
    assert [s["name"] for s in info["stages"]] == list(BACKBONES[backbone].default_stages)
