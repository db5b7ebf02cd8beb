"""`padim export`: the graph, padim.json, the Triton repository, external data, atomic replacement."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime
import pytest
from google.protobuf import text_format
from helpers import assert_same_verdict, run_cli
from PIL import Image
from tritonclient.grpc import model_config_pb2

from padim.models.deploy.export import METADATA_FILE, export_detector, read_export, triton_config
from padim.models.deploy.runtimes import load_scorer
from padim.models.fit.model_file import load_detector

ONNX_TO_TRITON = {onnx.TensorProto.FLOAT: model_config_pb2.TYPE_FP32}


@pytest.fixture(scope="module")
def triton_repo(model_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("triton") / "repo"
    result = run_cli("-q", "export", model_file, "--format", "triton", "--output", root, "--name", "weave_line3")
    report = json.loads(result.stdout)
    assert report["serve_with"] == f"tritonserver --model-repository {root}"
    return root


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_triton_config_matches_the_graphs_real_inputs_and_outputs(triton_repo):
    model_dir = triton_repo / "weave_line3"
    assert sorted(p.relative_to(triton_repo).as_posix() for p in triton_repo.rglob("*") if p.is_file()) == [
        "weave_line3/1/model.onnx",
        "weave_line3/config.pbtxt",
        f"weave_line3/{METADATA_FILE}",
    ]
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    graph = onnx.load(str(model_dir / "1" / "model.onnx"), load_external_data=False).graph
    assert config.name == "weave_line3" and config.platform == "onnxruntime_onnx"
    assert config.max_batch_size >= 1 and config.HasField("dynamic_batching")
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name: o for o in graph.output}
    assert [i.name for i in config.input] == list(inputs) and {o.name for o in config.output} == set(outputs)
    for declared in config.input:
        real = inputs[declared.name]
        assert ONNX_TO_TRITON[real.type.tensor_type.elem_type] == declared.data_type
        batch, *rest = _dims(real)
        assert isinstance(batch, str) and rest == list(declared.dims)  # dynamic batch, then Triton's dims
    for declared in config.output:
        real = outputs[declared.name]
        assert ONNX_TO_TRITON[real.type.tensor_type.elem_type] == declared.data_type
        batch, *rest = _dims(real)
        assert isinstance(batch, str)
        # a batch-only output is declared [1] and reshaped to [] (Triton's rule for max_batch_size > 0)
        assert rest == (list(declared.reshape.shape) if declared.HasField("reshape") else list(declared.dims))


def test_triton_runs_the_model_on_the_gpu_by_default_and_on_the_cpu_when_asked(triton_repo):
    written = text_format.Parse(
        (triton_repo / "weave_line3" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    assert [g.kind for g in written.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    on_cpu = text_format.Parse(triton_config("m", 64, device="cpu"), model_config_pb2.ModelConfig())
    assert [g.kind for g in on_cpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]


def test_the_triton_graph_runs_batched_as_triton_would_feed_it(triton_repo, model_file):
    graph = triton_repo / "weave_line3" / "1" / "model.onnx"
    session = onnxruntime.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    reference = load_detector(model_file, device="cpu")
    size = reference.config.features.image_size
    config = text_format.Parse((graph.parents[1] / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    batch = np.random.default_rng(0).standard_normal((config.max_batch_size, 3, size, size)).astype(np.float32)
    maps, raw, inputs = session.run(None, {"images": batch})
    assert maps.shape == (config.max_batch_size, size, size) and raw.shape == inputs.shape == (config.max_batch_size,)
    import torch

    expected = reference.score(torch.from_numpy(batch))
    assert np.allclose(raw, expected.raw_scores.numpy(), rtol=1e-4)
    assert np.allclose(inputs, expected.input_distances.numpy(), rtol=1e-4)


def test_padim_json_alone_is_enough_for_a_client(model_file, model_export, dataset, tmp_path):
    """A client that knows only padim.json (numpy, PIL, onnxruntime; no padim) scores as padim predict."""
    meta = json.loads((model_export / METADATA_FILE).read_text())
    assert (
        meta["input"]["name"] == "images" and meta["input"]["layout"] == "NCHW" and meta["input"]["channels"] == "RGB"
    )
    size = meta["input"]["shape"][2]
    session = onnxruntime.InferenceSession(str(model_export / "model.onnx"), providers=["CPUExecutionProvider"])
    run_cli(
        "-q",
        "predict",
        model_file,
        dataset / "test" / "hole",
        "--output",
        tmp_path / "p",
        "--no-maps",
        "--no-heatmaps",
        "--runtime",
        "torch",
    )
    for line in (tmp_path / "p" / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        image = Image.open(record["path"]).convert("RGB").resize((size, size), Image.BILINEAR)
        pixels = (np.asarray(image, dtype=np.float32) / 255 - meta["input"]["mean"]) / meta["input"]["std"]
        _, raw, _ = session.run(None, {"images": pixels.transpose(2, 0, 1)[None].astype(np.float32)})
        assert float(raw[0]) == pytest.approx(record["raw_score"], rel=1e-4)
        assert_same_verdict({"is_anomaly": float(raw[0]) >= meta["calibration"]["threshold"]}, record, rel=1e-4)
    described = load_detector(model_file, device="cpu")
    assert meta["calibration"] == described.calibration.summary()
    assert meta["calibration_scores"] == list(described.calibration.scores)
    assert meta["model"]["file"] == model_file.name and len(meta["model"]["sha256"]) == 64
    assert meta["weights"]["source"] == "random"


def test_fp16_factors_stay_fp16_and_packed_in_the_graph(dataset, tmp_path):
    model = tmp_path / "half.padim"
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        model,
        "--weights",
        "random",
        "--image-size",
        64,
        "--precision-dtype",
        "float16",
        "--calibration-folds",
        2,
    )
    run_cli("-q", "export", model, "--output", tmp_path / "e")
    graph = onnx.load(str(tmp_path / "e" / "model.onnx")).graph
    factor = next(t for t in graph.initializer if t.name == "precision_factor_packed")
    detector = load_detector(model, device="cpu")
    pixels, dim = detector.model.precision_factor.shape[:2]
    assert factor.data_type == onnx.TensorProto.FLOAT16
    assert list(factor.dims) == [pixels, dim * (dim + 1) // 2 + 1]  # lower triangle and one zero column
    assert json.loads((tmp_path / "e" / METADATA_FILE).read_text())["precision_dtype"] == "float16"


def test_external_data_is_written_digested_and_read_by_both_runtimes(model_file, tmp_path):
    run_cli("-q", "export", model_file, "--output", tmp_path / "e", "--external-data", "always")
    files = {p.name for p in (tmp_path / "e").iterdir()}
    assert files == {"model.onnx", "model.onnx.data", METADATA_FILE}
    assert (tmp_path / "e" / "model.onnx").stat().st_size < 1_000_000  # the weights are in the data file
    assert set(read_export(tmp_path / "e")["files_sha256"]) == {"model.onnx", "model.onnx.data"}
    reference = load_detector(model_file, device="cpu")
    import torch

    batch = torch.randn(2, 3, reference.config.features.image_size, reference.config.features.image_size)
    expected = reference.score(batch).raw_scores
    for runtime in ("onnxruntime", "openvino"):
        assert torch.allclose(load_scorer(tmp_path / "e", runtime, "cpu").score(batch).raw_scores, expected, rtol=1e-4)
    with open(tmp_path / "e" / "model.onnx.data", "r+b") as handle:  # damage the weights, not the graph
        handle.seek(4096)
        handle.write(b"\x00\x01\x02\x03")
    from padim.core.artifact import ArtifactError

    with pytest.raises(ArtifactError, match="model.onnx.data does not match its sha256"):
        load_scorer(tmp_path / "e", "onnxruntime", "cpu")


def test_export_replaces_an_earlier_export_and_refuses_other_folders(model_file, model_export_openvino, tmp_path):
    target = tmp_path / "e"
    shutil.copytree(model_export_openvino, target)  # an earlier `padim export --format openvino` of the model
    first = read_export(target)["files_sha256"]
    run_cli("-q", "export", model_file, "--output", target)  # ONNX, in its place
    assert set(read_export(target)["files_sha256"]) == {"model.onnx"} != set(first)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = run_cli("-q", "export", model_file, "--output", tmp_path / "mine", check=False)
    assert result.returncode == 1 and "is not a padim export; choose another --output" in result.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_export_flags_are_checked(model_file, tmp_path):
    result = run_cli("-q", "export", model_file, "--output", tmp_path / "e", "--name", "x", check=False)
    assert result.returncode == 1 and "--name is the Triton model name" in result.stderr
    result = run_cli("-q", "export", model_file, "--output", tmp_path / "e", "--format", "tflite", check=False)
    assert result.returncode == 2 and "invalid choice: 'tflite'" in result.stderr
    result = run_cli("-q", "export", tmp_path / "missing.padim", "--output", tmp_path / "e", check=False)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "missing.padim" in result.stderr


def test_export_of_an_in_memory_detector_writes_the_same_graph_inputs(model_file, tmp_path):
    detector = load_detector(model_file, device="cpu")
    directory = export_detector(detector, tmp_path / "api", "onnx", model_file)
    session = onnxruntime.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    assert [o.name for o in session.get_outputs()] == ["anomaly_map", "raw_score", "input_distance"]


def test_padim_json_says_how_to_frame_a_picture_for_a_client(dataset, tmp_path):
    """A framed model (region + pad): a client cropping and padding as padim.json says scores as padim predict."""
    model = tmp_path / "framed.padim"
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        model,
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
    )
    run_cli("-q", "export", model, "--output", tmp_path / "e")
    meta = json.loads((tmp_path / "e" / METADATA_FILE).read_text())
    framing, size = meta["input"]["framing"], meta["input"]["shape"][2]
    session = onnxruntime.InferenceSession(str(tmp_path / "e" / "model.onnx"), providers=["CPUExecutionProvider"])
    run_cli(
        "-q",
        "predict",
        model,
        dataset / "test" / "stain",
        "--output",
        tmp_path / "p",
        "--no-maps",
        "--no-heatmaps",
        "--runtime",
        "torch",
    )
    for line in (tmp_path / "p" / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        x, y, w, h = framing["roi"]
        region = np.asarray(Image.open(record["path"]).convert("RGB"))[y : y + h, x : x + w]
        side = max(w, h)
        canvas = np.empty((side, side, 3), dtype=np.uint8)
        canvas[...] = framing["pad_fill"]
        canvas[(side - h) // 2 : (side - h) // 2 + h, (side - w) // 2 : (side - w) // 2 + w] = region
        image = Image.fromarray(canvas).resize((size, size), Image.BILINEAR)
        pixels = (np.asarray(image, dtype=np.float32) / 255 - meta["input"]["mean"]) / meta["input"]["std"]
        _, raw, _ = session.run(None, {"images": pixels.transpose(2, 0, 1)[None].astype(np.float32)})
        assert float(raw[0]) == pytest.approx(record["raw_score"], rel=1e-4)


@pytest.mark.parametrize("blocks", [1, 2, 3, 4])
def test_the_graphs_triangular_product_equals_the_full_one_in_float64(blocks):
    """``||W delta||^2`` by blocks of rows (the zeros above the diagonal skipped) against numpy in float64."""
    import numpy as np
    import torch

    from padim.core.statistics import precision_factor
    from padim.models.deploy.export import triangular_squared_norm

    generator = torch.Generator().manual_seed(0)
    pixels, n, dim = 7, 3, 10
    samples = torch.randn(pixels, 50, dim, generator=generator, dtype=torch.float64)
    covariance = torch.einsum("pnd,pne->pde", samples, samples) / 50
    factor = precision_factor(covariance, epsilon=0.01).to(torch.float32)  # (p, D, D), lower triangular
    delta = torch.randn(pixels, n, dim, generator=generator)
    got = triangular_squared_norm(delta, factor, blocks).double().numpy()
    w, d = factor.double().numpy(), delta.double().numpy()
    assert np.allclose(np.triu(w, 1), 0)  # the zeros the blocks skip
    expected = np.square(np.einsum("pdk,pnk->pnd", w, d)).sum(-1)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
