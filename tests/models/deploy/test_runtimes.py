"""Every runtime scores as torch does: parity at two sizes, both reductions, both factor dtypes, every
neighbourhood and image score.

The issue's bar: image scores within 1e-4 relative and maps within 1e-3 of the torch path on the
same images, for onnxruntime and OpenVINO, on the .padim file (exported and cached) and on an
export directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import defaults_as, run_cli, seed_export_cache
from PIL import Image, ImageEnhance
from torch.utils._python_dispatch import TorchDispatchMode

from padim.core.artifact import ArtifactError
from padim.models.deploy.export import ExportError, read_export
from padim.models.deploy.runtimes import DeployedDetector, cache_dir, load_scorer, runtime_choice
from padim.models.features.embedding import model_input
from padim.models.fit.model_file import load_detector, save_detector

#: (image size, reduction, stored factor dtype, neighbourhood, image score): each size with both
#: reductions and both dtypes, each neighbourhood and each image score at least once.
CASES = [
    (224, "random", "float32", 1, "map_max"),
    (224, "semi_orthogonal", "float16", 3, "patch_max"),
    (320, "random", "float16", 3, "top_mean"),
    (320, "semi_orthogonal", "float32", 5, "map_max"),
]
RUNTIMES = ("onnxruntime", "openvino")


@pytest.fixture(scope="module")
def ten_pictures(dataset, tmp_path_factory) -> Path:
    """Ten of the training pictures: parity needs a model, not a good one (a 320 px fit of 30 takes twice as long)."""
    folder = tmp_path_factory.mktemp("ten")
    for picture in sorted((dataset / "train" / "good").glob("*.png"))[:10]:
        shutil.copy(picture, folder)
    return folder


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}px-{c[1]}-{c[2]}-nb{c[3]}-{c[4]}")
def case_model(request, ten_pictures, tmp_path_factory):
    size, reduction, dtype, neighbourhood, image_score = request.param
    path = tmp_path_factory.mktemp("runtimes") / f"m{size}.padim"
    run_cli(
        "-q",
        "train",
        ten_pictures,
        "--output",
        path,
        "--weights",
        "random",
        "--image-size",
        size,
        "--reduction",
        reduction,
        "--precision-dtype",
        dtype,
        "--calibration-folds",
        2,
        "--batch-size",
        8,
        "--embedding-dim",
        64,
        "--neighbourhood",
        neighbourhood,
        "--image-score",
        image_score,
        "--top-fraction",
        0.02,
    )
    return path, size, dtype


def test_torch_reference_checks_its_inputs(case_model):
    path, size, dtype = case_model
    detector = load_detector(path, device="cpu")
    assert detector.config.features.image_size == size and str(detector.precision_dtype) == f"torch.{dtype}"
    case = next(c for c in CASES if c[:3] == (size, detector.config.features.reduction, dtype))
    assert (detector.config.gaussian.neighbourhood, detector.config.scoring.image_score) == case[3:]
    assert detector.model.embedder.embedding.neighbourhood == case[3] and detector.model.scoring.image_score == case[4]


@pytest.fixture(scope="module")
def case_reference(case_model, dataset):
    """The torch path's detector for the case, five test pictures as served (8-bit), and its scores of them."""
    path, _, _ = case_model
    reference = load_detector(path, device="cpu")
    paths = sorted((dataset / "test").rglob("*.png"))[::3][:5]
    batch = reference.preprocess([Image.open(p).convert("RGB") for p in paths])  # (5, 3, S, S)
    return reference, batch, reference.score(batch)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_runtime_scores_as_torch_does(case_model, case_reference, runtime):
    path, size, dtype = case_model
    reference, batch, expected = case_reference
    deployed = load_scorer(path, runtime, "cpu")
    assert isinstance(deployed, DeployedDetector) and deployed.describe()["runtime"] == runtime
    assert deployed.precision_dtype == reference.precision_dtype
    got = deployed.score(batch)
    assert got.maps.shape == expected.maps.shape == (5, size, size)
    relative = (
        (got.raw_scores.double() - expected.raw_scores.double()).abs() / expected.raw_scores.double().abs()
    ).max()
    assert relative <= 1e-4, f"{runtime}: image scores differ by {float(relative):.2e} relative"
    assert (got.maps - expected.maps).abs().max() <= 1e-3
    # batch of one: the dynamic batch dimension, not only the exported example's
    single = deployed.score(batch[:1])
    assert torch.allclose(single.raw_scores, got.raw_scores[:1], rtol=1e-5)
    # 8-bit pixels (as served) and the graph's own normalised float32 input score alike
    assert batch.dtype == torch.uint8
    torch.testing.assert_close(deployed.score(model_input(batch)).raw_scores, got.raw_scores)
    # the same verdict inputs: threshold and calibration travel with the graph
    assert deployed.calibration == reference.calibration
    assert deployed.describe()["calibration"] == reference.describe()["calibration"]
    # no torch arithmetic before the graph: torch's OpenMP threads would spin on the cores the runtime's need
    with TorchOperations() as seen:
        deployed.score(batch)
    assert not [op for op in seen.operations if not op.startswith(("aten.detach", "aten.alias", "aten.lift_fresh"))]


class TorchOperations(TorchDispatchMode):
    """Every torch operation dispatched while it is entered (``operations``, by name)."""

    def __init__(self):
        super().__init__()
        self.operations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operations.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_export_directory_runs_on_both_runtimes_and_triton_gets_the_same_graph(case_model, case_reference, tmp_path):
    """The export directory is the one the runtimes cached for the model file (``export_detector``, as ``padim export
    --format onnx`` writes it: tests/models/deploy/test_export.py runs the command); Triton's model repository,
    another layout of the same graph, is exported for the first case."""
    path, size, dtype = case_model
    directory = load_scorer(path, "onnxruntime", "cpu").directory  # exported on the first load, read after
    assert read_export(directory)["format"] == "onnx"
    reference = case_reference[0]
    batch = torch.randn(3, 3, size, size)
    scored = reference.score(batch)
    expected = scored.raw_scores
    for runtime in RUNTIMES:
        got = load_scorer(directory, runtime, "cpu").score(batch)
        assert torch.allclose(got.raw_scores, expected, rtol=1e-4), runtime
        assert torch.allclose(got.input_distances, scored.input_distances.float(), rtol=1e-4), runtime
    if (size, dtype) != (CASES[0][0], CASES[0][2]):  # Triton's export: the first case only
        return
    # Triton serves the model repository's graph as it is: run it as Triton's onnxruntime backend would
    import onnxruntime

    run_cli("-q", "export", path, "--format", "triton", "--output", tmp_path / "triton", "--name", "m")
    session = onnxruntime.InferenceSession(
        str(tmp_path / "triton" / "m" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    _, raw, _ = session.run(None, {"images": model_input(batch).numpy()})  # the graph reads normalised float32
    assert np.allclose(raw, expected.numpy(), rtol=1e-4)


@pytest.mark.parametrize("gpu", [False, True])
def test_auto_picks_onnxruntime_on_cpu_and_torch_where_torch_sees_a_gpu(monkeypatch, gpu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert runtime_choice("auto", "cpu")[0] == "onnxruntime"
    assert runtime_choice("auto", "cuda")[0] == "torch"
    assert runtime_choice("auto", "auto")[0] == ("torch" if gpu else "onnxruntime")
    with pytest.raises(ExportError, match="choose one of auto, torch, onnxruntime, openvino"):
        runtime_choice("tensorrt", "cpu")


def test_auto_says_which_runtime_it_chose_and_why_by_the_precision_the_threshold_was_computed_at(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # int8 and bf16 choose alike with a GPU or not
    assert runtime_choice("auto", "cpu")[0] == "onnxruntime" and "float32" in runtime_choice("auto", "cpu")[1]
    runtime, reason = runtime_choice("auto", "auto", "int8")
    assert runtime == "onnxruntime" and "int8 backbone" in reason and "threshold" in reason
    runtime, reason = runtime_choice("auto", "cpu", "bf16")
    assert runtime == "torch" and "bf16" in reason
    assert runtime_choice("onnxruntime", "cpu", "bf16") == ("onnxruntime", "asked for")


def test_auto_names_the_gated_export_that_scores_faster_on_this_cpu(monkeypatch):
    """ONNX Runtime's float32 stays the choice (the threshold is float32's); the reason says what would be faster."""
    from padim.models import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = {
        "avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8": "--precision bf16",  # AMX: bfloat16 first
        "avx2 avx512f avx512_vnni avx512_bf16": "--precision bf16",  # a Zen 4 EPYC
        "avx2 avx_vnni": "--precision int8",  # int8 dot products, no bfloat16
    }
    for flags, export in cases.items():
        monkeypatch.setattr(devices, "cpu_flags", lambda flags=flags: frozenset(flags.split()))
        runtime, reason = runtime_choice("auto", "cpu")
        assert runtime == "onnxruntime" and "float32" in reason
        assert f"padim export --format openvino {export} --calibration-images DIR" in reason, flags
        assert "threshold of its own" in reason
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # AVX2 alone: nothing faster known
    assert "padim export" not in runtime_choice("auto", "cpu")[1]
    assert "padim export" not in runtime_choice("auto", "cpu", "int8")[1]  # a reduced model's own scorer: no hint


def test_an_int8_model_asked_to_score_on_a_gpu_is_refused_with_what_to_do(tmp_path):
    """Its backbone is ONNX Runtime's int8 kernels: --device cuda is refused before anything loads."""
    from helpers import older_format_of

    from padim.core import load_artifact
    from padim.models.errors import UsageError

    model = tmp_path / "int8.padim"
    older_format_of({"x": torch.zeros(1)}, {"kind": "padim-detector", "config": {"precision": "int8"}}, model, 15)
    with pytest.raises(UsageError, match="an int8 backbone runs on the CPU"):
        load_scorer(model, "auto", "cuda")
    assert load_artifact(model)[1]["config"]["precision"] == "int8"


@pytest.mark.parametrize("fmt", ["onnx", "openvino"])
def test_auto_runs_an_export_on_the_runtime_its_graph_is_for(request, fmt, monkeypatch):
    """An OpenVINO export with --runtime auto used to go to ONNX Runtime and fail; on a GPU node too."""
    exported = request.getfixturevalue("model_export" if fmt == "onnx" else "model_export_openvino")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node whose runtimes have no CUDA provider
    monkeypatch.setattr("padim.models.devices.onnxruntime_has_cuda", lambda: False)
    scorer = load_scorer(exported, "auto", "auto")
    assert scorer.runtime == ("onnxruntime" if fmt == "onnx" else "openvino") and scorer.device.type == "cpu"
    assert scorer.providers[-1] in ("CPUExecutionProvider", "CPU")


def test_the_export_of_a_model_file_is_cached_and_renewed_when_the_file_changes(model_file, tmp_path, monkeypatch):
    monkeypatch.setenv("PADIM_CACHE_DIR", str(tmp_path / "cache"))
    first = load_scorer(model_file, "onnxruntime", "cpu")
    entries = sorted(p for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))  # not .export.lock
    assert len(entries) == 1 and first.directory == entries[0]
    stamp = (entries[0] / "model.onnx").stat().st_mtime_ns
    again = load_scorer(model_file, "onnxruntime", "cpu")  # read from the cache, not exported again
    assert again.directory == entries[0] and (entries[0] / "model.onnx").stat().st_mtime_ns == stamp
    # a changed model file (as evaluate --calibrate leaves it) gets its own export; the old one goes
    changed = tmp_path / model_file.name
    detector = load_detector(model_file, device="cpu", with_statistics=True)
    detector.calibration = detector.calibration.with_threshold(detector.calibration.threshold * 2)
    save_detector(detector, changed)
    renewed = load_scorer(changed, "onnxruntime", "cpu")
    assert renewed.calibration.threshold == pytest.approx(detector.calibration.threshold)
    assert renewed.metadata["model"]["sha256"] != first.metadata["model"]["sha256"]


def test_a_damaged_cache_is_exported_again(model_file, model_export, tmp_path, monkeypatch):
    monkeypatch.setenv("PADIM_CACHE_DIR", str(tmp_path / "cache"))
    seed_export_cache(model_file, model_export)  # as a first load leaves it (that it does: the test above)
    first = load_scorer(model_file, "onnxruntime", "cpu")
    with open(first.directory / "model.onnx", "r+b") as handle:  # one flipped byte in the graph
        handle.seek(1000)
        byte = handle.read(1)
        handle.seek(1000)
        handle.write(bytes([byte[0] ^ 0xFF]))
    again = load_scorer(model_file, "onnxruntime", "cpu")
    assert again.score(torch.zeros(1, 3, again.image_size, again.image_size)).raw_scores.isfinite().all()


def test_a_cache_an_older_padim_wrote_is_exported_again_and_an_older_export_is_still_served(
    model_file, model_export, tmp_path, monkeypatch
):
    """A model file's cached export older than today's graph (``GRAPH_VERSION``: 7 changed the float32 graph, 17 the
    int8 ones' stem) is made again, while an export directory of version 6 given as such is served as it is. A cache
    of ``GRAPH_VERSION`` is kept."""
    from padim.models.deploy.export import EXPORT_VERSION, GRAPH_VERSION, METADATA_FILE, metadata_sha256

    monkeypatch.setenv("PADIM_CACHE_DIR", str(tmp_path / "cache"))
    seed_export_cache(model_file, model_export)  # today's export, as a first load caches it
    first = load_scorer(model_file, "onnxruntime", "cpu")
    old = shutil.copytree(first.directory, tmp_path / "old-export")

    def written_as(folder, version):
        metadata = json.loads((folder / METADATA_FILE).read_text())
        metadata["export_version"] = version
        if version < 12 and "decode_workers" in metadata["config"]:  # as versions before 12 spelled it
            metadata["config"]["workers"] = metadata["config"].pop("decode_workers")
        if version < 13:  # no backbone family nor stages in the description before 13
            metadata["description"].pop("backbone_family", None)
            metadata["description"].pop("stages", None)
        if version < 14:  # a given shrinkage weight, nothing estimated, before 14
            metadata["provenance"].pop("shrinkage_estimated", None)
            if metadata["config"]["shrinkage"] == "auto":
                metadata["config"]["shrinkage"] = 0.5
        metadata["metadata_sha256"] = metadata_sha256(metadata)
        (folder / METADATA_FILE).write_text(json.dumps(metadata))

    written_as(first.directory, GRAPH_VERSION)
    assert load_scorer(model_file, "onnxruntime", "cpu").metadata["export_version"] == GRAPH_VERSION  # kept
    written_as(first.directory, GRAPH_VERSION - 1)
    written_as(old, 6)
    renewed = load_scorer(model_file, "onnxruntime", "cpu")
    assert renewed.metadata["export_version"] == EXPORT_VERSION
    served = load_scorer(old, "onnxruntime", "cpu")
    assert served.metadata["export_version"] == 6
    batch = torch.randn(2, 3, served.image_size, served.image_size)
    torch.testing.assert_close(served.score(batch).raw_scores, renewed.score(batch).raw_scores)
    assert "workers" in json.loads((old / METADATA_FILE).read_text())["config"]  # read as decode_workers
    assert "decode_workers" in renewed.metadata["config"]
    assert "stages" not in json.loads((old / METADATA_FILE).read_text())["description"]  # described by the table
    assert served.describe()["backbone_family"] == "resnet" == renewed.metadata["description"]["backbone_family"]
    assert [s["name"] for s in served.describe()["stages"]] == ["layer1", "layer2", "layer3"]


def test_a_read_only_model_folder_caches_elsewhere(model_file, tmp_path, monkeypatch):
    monkeypatch.delenv("PADIM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(os, "access", lambda path, mode: str(path).startswith(str(tmp_path)))
    place = cache_dir(model_file, "ab" * 32, "onnx")
    assert place.parent == tmp_path / "xdg" / "padim" and place.name == f"{model_file.name}.onnx-{'ab' * 8}"


def test_a_damaged_export_directory_is_refused(model_export, tmp_path):
    shutil.copytree(model_export, tmp_path / "e")
    meta = json.loads((tmp_path / "e" / "padim.json").read_text())
    meta["calibration"]["threshold"] = 0.0  # an edited threshold must not pass for the trained one
    (tmp_path / "e" / "padim.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="do not match its digest"):
        load_scorer(tmp_path / "e", "onnxruntime", "cpu")
    (tmp_path / "f").mkdir()
    with pytest.raises(ArtifactError, match="not a padim export"):
        read_export(tmp_path / "f")


def test_torch_cannot_run_an_export_and_onnxruntime_cannot_run_openvino_ir(model_file, model_export_openvino):
    with pytest.raises(ExportError, match="torch needs the .padim file"):
        load_scorer(model_export_openvino, "torch", "cpu")
    with pytest.raises(ExportError, match="run it with --runtime openvino"):
        load_scorer(model_export_openvino, "onnxruntime", "cpu")
    deployed = load_scorer(model_export_openvino, "openvino", "cpu")
    reference = load_detector(model_file, device="cpu")
    batch = torch.randn(2, 3, reference.config.features.image_size, reference.config.features.image_size)
    assert np.allclose(deployed.score(batch).raw_scores, reference.score(batch).raw_scores, rtol=1e-4)


def test_a_missing_runtime_says_what_to_install(model_file, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_openvino(name, *args, **kwargs):
        if name == "openvino" or name.startswith("openvino."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_openvino)
    monkeypatch.setattr("importlib.import_module", lambda name: no_openvino(name))
    with pytest.raises(
        ExportError, match=r"openvino is not installed; install it with: pip install '\.\[openvino\]' in padim's source"
    ):
        load_scorer(model_file, "openvino", "cpu")


def test_cuda_with_a_cpu_only_onnxruntime_is_an_error_not_a_silent_cpu_run(model_export):
    import onnxruntime

    from padim.models.deploy.runtimes import OnnxRuntimeSession

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(ExportError, match="needs onnxruntime-gpu"):
        OnnxRuntimeSession(model_export / "model.onnx", torch.device("cuda"))


def test_an_export_from_before_the_options_says_what_its_graph_computes(dataset, tmp_path):
    from padim.models.deploy.export import METADATA_FILE, metadata_sha256

    path = tmp_path / "paper.padim"
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        path,
        "--weights",
        "random",
        "--image-size",
        64,
        "--neighbourhood",
        1,
        "--calibration-folds",
        2,
    )
    run_cli("-q", "export", path, "--format", "onnx", "--output", tmp_path / "onnx")
    # padim.json as an export before format 4 wrote it: no scoring options, no framing (export version 1)
    metadata = json.loads((tmp_path / "onnx" / METADATA_FILE).read_text())
    for section in (metadata["config"], metadata["description"]):
        for key in ("neighbourhood", "image_score", "top_fraction", "roi", "resize", "standardise"):
            section.pop(key, None)
    metadata["export_version"] = 1
    del metadata["input"]["framing"]
    metadata["metadata_sha256"] = metadata_sha256(metadata)
    (tmp_path / "onnx" / METADATA_FILE).write_text(json.dumps(metadata))
    deployed = load_scorer(tmp_path / "onnx", "onnxruntime", "cpu")
    assert (deployed.config.gaussian.neighbourhood, deployed.config.scoring.image_score) == (1, "map_max")
    assert deployed.framing.is_whole_picture and deployed.describe()["resize"] == "squash"
    assert deployed.describe()["neighbourhood"] == 1 and deployed.describe()["image_score"] == "map_max"
    assert deployed.config.features.standardise == "none" and deployed.describe()["standardise"] == "none"
    batch = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(
        deployed.score(batch).raw_scores, load_detector(path, device="cpu").score(batch).raw_scores, rtol=1e-4, atol=0
    )


def test_a_framed_model_scores_alike_on_every_runtime_and_its_export_says_how_to_frame(dataset, tmp_path):
    path = tmp_path / "framed.padim"
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        path,
        "--weights",
        "random",
        "--image-size",
        64,
        "--roi",
        "8,16,80,64",
        "--resize",
        "pad",
        "--calibration-folds",
        2,
        "--embedding-dim",
        32,
    )
    reference = load_detector(path, device="cpu")
    pictures = [Image.open(p).convert("RGB") for p in sorted((dataset / "test").rglob("*.png"))[::3][:4]]
    expected = reference.score(reference.preprocess(pictures)).raw_scores.double()
    run_cli("-q", "export", path, "--format", "onnx", "--output", tmp_path / "onnx")
    for runtime in RUNTIMES:
        deployed = load_scorer(tmp_path / "onnx", runtime, "cpu")
        assert deployed.framing == reference.framing
        assert torch.equal(deployed.preprocess(pictures), reference.preprocess(pictures))  # framed alike, to the bit
        got = deployed.score(deployed.preprocess(pictures)).raw_scores.double()
        assert ((got - expected).abs() / expected.abs()).max() <= 1e-4, runtime
        assert deployed.describe()["roi"] == [8, 16, 80, 64] and deployed.describe()["resize"] == "pad"
    metadata = json.loads((tmp_path / "onnx" / "padim.json").read_text())
    assert metadata["export_version"] >= 2
    assert metadata["input"]["framing"]["roi"] == [8, 16, 80, 64] and metadata["input"]["framing"]["resize"] == "pad"
    assert "the region x=8, y=16, 80x64 pixels of the picture, centred on a square" in metadata["input"]["resize"]
    run_cli("-q", "export", path, "--format", "triton", "--output", tmp_path / "triton", "--name", "m")
    assert "framed to 64x64" in (tmp_path / "triton" / "m" / "config.pbtxt").read_text()


@pytest.mark.parametrize(
    ("statistics", "standardise"), [("position", "channels"), ("shared", "picture"), ("position", "gain")]
)
def test_a_tiled_model_scores_alike_on_every_runtime_with_the_tiles_inside_the_graph(
    dataset, tmp_path, statistics, standardise
):
    """The tiles cut inside the graph, each picture's light set inside it too (over the whole picture, before the
    tiles), as torch does."""
    path = tmp_path / "tiled.padim"
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        path,
        "--weights",
        "random",
        "--image-size",
        64,
        "--tiles",
        "2x3",
        "--tile-overlap",
        "0.25",
        "--tile-statistics",
        statistics,
        "--roi",
        "4,16,88,60",
        "--resize",
        "crop",
        "--calibration-folds",
        2,
        "--embedding-dim",
        32,
        "--blur-sigma",
        2,
        "--standardise",
        standardise,
    )
    reference = load_detector(path, device="cpu")
    pictures = [Image.open(p).convert("RGB") for p in sorted((dataset / "test").rglob("*.png"))[::3][:4]]
    batch = reference.preprocess(pictures)
    height, width = reference.config.input_shape
    assert batch.shape == (4, 3, height, width) and (height, width) == (112, 160)  # tiles of 64 overlapping 16 px
    expected = reference.score(batch)
    run_cli("-q", "export", path, "--format", "onnx", "--output", tmp_path / "onnx")
    for runtime in RUNTIMES:
        deployed = load_scorer(tmp_path / "onnx", runtime, "cpu")
        assert deployed.config.framing.tiles == (2, 3) and deployed.framing == reference.framing
        assert torch.equal(deployed.preprocess(pictures), batch)  # the client sends the whole framed picture
        got = deployed.score(batch)
        assert got.maps.shape == expected.maps.shape == (4, height, width)
        relative = (got.raw_scores.double() - expected.raw_scores.double()).abs() / expected.raw_scores.double().abs()
        assert relative.max() <= 1e-4, f"{runtime}: image scores differ by {float(relative.max()):.2e} relative"
        assert (got.maps - expected.maps).abs().max() <= 1e-3
        assert torch.allclose(deployed.score(batch[:1]).raw_scores, got.raw_scores[:1], rtol=1e-5)  # dynamic batch
    metadata = json.loads((tmp_path / "onnx" / "padim.json").read_text())
    assert metadata["export_version"] >= 3 and metadata["input"]["shape"] == ["batch", 3, 112, 160]
    assert metadata["input"]["tiles"]["rows"] == 2 and metadata["input"]["tiles"]["statistics"] == statistics
    assert metadata["export_version"] >= 9 and metadata["config"]["standardise"] == standardise
    # 15% more light: the same picture, whichever tiles it falls into, where the light is set
    brighter = reference.preprocess([ImageEnhance.Brightness(p).enhance(1.15) for p in pictures])
    moved = (reference.score(brighter).raw_scores.double() - expected.raw_scores.double()).abs()
    assert (moved / expected.raw_scores.double()).max() < 0.05
    # Triton: the tiles are cut inside the graph it serves; a batch counts pictures, the backbone sees six tiles each
    import onnxruntime
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    run_cli("-q", "export", path, "--format", "triton", "--output", tmp_path / "triton", "--name", "m")
    config = text_format.Parse((tmp_path / "triton" / "m" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert list(config.input[0].dims) == [3, 112, 160] and list(config.output[0].dims) == [112, 160]
    assert config.max_batch_size == 32 // 6
    session = onnxruntime.InferenceSession(
        str(tmp_path / "triton" / "m" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    maps, raw, inputs = session.run(None, {"images": model_input(batch).numpy()})  # the graph reads normalised float32
    np.testing.assert_allclose(raw, expected.raw_scores.numpy(), rtol=1e-4)
    np.testing.assert_allclose(inputs, expected.input_distances.numpy(), rtol=1e-4)
    assert maps.shape == (4, 112, 160)


def test_an_export_from_before_input_distances_is_served_without_them(model_file, tmp_path, monkeypatch):
    """Export version 3: two outputs, no calibration_input_distances; scored as before, no input drift reading."""
    from padim.core.drift import assess
    from padim.models.deploy import export
    from padim.models.deploy.export import METADATA_FILE, metadata_sha256

    forward = export.ExportedScorer.forward
    monkeypatch.setattr(export.ExportedScorer, "forward", lambda self, images: forward(self, images)[:2])
    monkeypatch.setattr(export, "OUTPUT_NAMES", export.OUTPUT_NAMES[:2])
    export.export_detector(load_detector(model_file, device="cpu"), tmp_path / "three", "onnx", model_file)
    monkeypatch.undo()
    metadata = json.loads((tmp_path / "three" / METADATA_FILE).read_text())
    del metadata["calibration_input_distances"], metadata["outputs"]["input_distance"]
    del metadata["calibration"]["input_distances"], metadata["description"]["calibration"]["input_distances"]
    metadata["export_version"] = 3
    metadata["metadata_sha256"] = metadata_sha256(metadata)
    (tmp_path / "three" / METADATA_FILE).write_text(json.dumps(metadata))
    reference = load_detector(model_file, device="cpu")
    batch = torch.randn(2, 3, reference.config.features.image_size, reference.config.features.image_size)
    for runtime in RUNTIMES:
        deployed = load_scorer(tmp_path / "three", runtime, "cpu")
        out = deployed.score(batch)
        assert out.input_distances is None and deployed.calibration.input_distances == ()
        torch.testing.assert_close(out.raw_scores, reference.score(batch).raw_scores, rtol=1e-4, atol=0)
        assert assess(out.raw_scores.repeat(20), deployed.calibration, out.input_distances).input_drift is None


def test_export_version_six_carries_the_expected_changes_and_version_five_has_none(model_file, tmp_path, monkeypatch):
    """Version 6: ``config.expect`` and ``config.fit_changes`` in padim.json; an older export is read with none,
    whatever today's defaults."""
    from padim.models.deploy import export
    from padim.models.deploy.export import METADATA_FILE, metadata_sha256

    export.export_detector(load_detector(model_file, device="cpu"), tmp_path / "six", "onnx", model_file)
    metadata = json.loads((tmp_path / "six" / METADATA_FILE).read_text())
    reference = load_detector(model_file, device="cpu")
    assert metadata["export_version"] == export.EXPORT_VERSION
    assert metadata["config"]["expect"] == reference.config.gaussian.expect
    assert metadata["config"]["fit_changes"] == reference.config.gaussian.fit_changes
    for key in ("expect", "fit_changes"):
        del metadata["config"][key]
    metadata["export_version"] = 5
    metadata["metadata_sha256"] = metadata_sha256(metadata)
    (tmp_path / "six" / METADATA_FILE).write_text(json.dumps(metadata))
    defaults_as(monkeypatch, expect="rough", fit_changes=True)  # as if the defaults declared changes
    five = load_scorer(tmp_path / "six", "onnxruntime", "cpu")
    assert five.config.gaussian.expect == "" and five.describe()["calibration"]["expect"] == ""
    batch = torch.randn(2, 3, reference.config.features.image_size, reference.config.features.image_size)
    torch.testing.assert_close(five.score(batch).raw_scores, reference.score(batch).raw_scores, rtol=1e-4, atol=0)
