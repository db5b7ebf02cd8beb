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


def block_graph(quantised: bool, seed: int = 0):
    """A residual block's end as the exporter writes it: ``x -> Conv -> Relu = r``, then ``Conv(r) + r -> Relu`` read
    by the embedding's ``Gather`` of channels 1, 4, 6 (``kept``); with ``quantised``, the QDQ form the quantiser
    writes (per-channel int8 weights, int32 bias, per-tensor activations), which ONNX Runtime runs as int8."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    constants = {"kept": np.array([1, 4, 6], np.int64)}
    nodes = []

    def conv(name: str, source: str, inputs: int) -> str:
        weights = rng.normal(0, 0.3, (8, inputs, 3, 3)).astype(np.float32)
        bias = rng.normal(0, 0.1, 8).astype(np.float32)
        if not quantised:
            constants[f"{name}_w"], constants[f"{name}_b"] = weights, bias
            nodes.append(helper.make_node("Conv", [source, f"{name}_w", f"{name}_b"], [name], pads=[1] * 4))
            return name
        scale = (np.abs(weights).reshape(8, -1).max(1) / 127).astype(np.float32)
        constants.update({
            f"{name}_w": np.round(weights / scale[:, None, None, None]).astype(np.int8), f"{name}_ws": scale,
            f"{name}_wz": np.zeros(8, np.int8), f"{name}_b": np.round(bias / (scale * 0.05)).astype(np.int32),
            f"{name}_bs": (scale * 0.05).astype(np.float32), f"{name}_bz": np.zeros(8, np.int32),
        })  # fmt: skip
        nodes.extend([
            helper.make_node("DequantizeLinear", [f"{name}_w", f"{name}_ws", f"{name}_wz"], [f"{name}_wf"], axis=0),
            helper.make_node("DequantizeLinear", [f"{name}_b", f"{name}_bs", f"{name}_bz"], [f"{name}_bf"], axis=0),
            helper.make_node("Conv", [source, f"{name}_wf", f"{name}_bf"], [f"{name}_f"], pads=[1] * 4),
            helper.make_node("QuantizeLinear", [f"{name}_f", "a_scale", "a_zero"], [f"{name}_q"]),
            helper.make_node("DequantizeLinear", [f"{name}_q", "a_scale", "a_zero"], [name]),
        ])  # fmt: skip
        return name

    source = "images"
    if quantised:
        constants.update({"a_scale": np.float32(0.05), "a_zero": np.uint8(128)})
        nodes += [helper.make_node("QuantizeLinear", ["images", "a_scale", "a_zero"], ["images_q"]),
                  helper.make_node("DequantizeLinear", ["images_q", "a_scale", "a_zero"], ["images_f"])]  # fmt: skip
        source = "images_f"
    nodes.append(helper.make_node("Relu", [conv("first", source, 4)], ["r"]))
    nodes += [
        helper.make_node("Add", [conv("last", "r", 8), "r"], ["sum"]),
        helper.make_node("Relu", ["sum"], ["stage"]),
        helper.make_node("Gather", ["stage", "kept"], ["embedding"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 4, 6, 6])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", 3, 6, 6])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def run_graphs(*models) -> list[np.ndarray]:
    images = np.random.default_rng(3).normal(0, 1, (2, 4, 6, 6)).astype(np.float32)
    return [
        onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"images": images}
        )[0]
        for m in models
    ]


@pytest.mark.parametrize("quantised", [False, True], ids=["float32", "int8"])
def test_the_last_convolution_computes_only_the_channels_the_embedding_keeps(quantised):
    """The kept channels' weights, bias and per-channel scales are cut, the residual gathered, the embedding's
    ``Gather`` gone; the same embedding (to the bit at int8: the same integer sums, requantised alike)."""
    from padim.models.deploy.export import _kept_channels_only

    model = block_graph(quantised)
    pruned = onnx.ModelProto()
    pruned.CopyFrom(model)
    assert _kept_channels_only(pruned) == 1
    onnx.checker.check_model(pruned)
    onnx.shape_inference.infer_shapes(pruned, strict_mode=True)  # no shape left as it was
    constants = {t.name: t for t in pruned.graph.initializer}
    assert list(constants["last_w"].dims) == [3, 8, 3, 3] and list(constants["last_b"].dims) == [3]
    assert list(constants["first_w"].dims) == [8, 4, 3, 3]  # the map the residual comes from: every channel
    if quantised:
        assert list(constants["last_ws"].dims) == [3] and list(constants["last_bs"].dims) == [3]
    gathers = [n for n in pruned.graph.node if n.op_type == "Gather"]
    assert [n.input[0] for n in gathers] == ["r"]  # the residual's, before the addition
    expected, found = run_graphs(model, pruned)
    assert found.shape == expected.shape == (2, 3, 6, 6)
    if quantised:
        assert np.array_equal(found, expected)
    else:
        np.testing.assert_allclose(found, expected, rtol=1e-6, atol=1e-6)
    assert _kept_channels_only(pruned) == 0  # once


def test_a_map_the_embedding_does_not_read_alone_is_left_as_it_is():
    """A map also read elsewhere (a shallower stage feeds the next), a grouped convolution, a requantising of one
    scale a channel, or a ``Gather`` along another axis: every channel is still needed or the way back is not
    clear, and the graph is not touched."""
    from onnx import TensorProto, helper, numpy_helper

    from padim.models.deploy.export import _kept_channels_only

    read_twice = block_graph(False)
    read_twice.graph.output.append(helper.make_tensor_value_info("stage", TensorProto.FLOAT, ["batch", 8, 6, 6]))
    grouped = block_graph(False)
    last = next(n for n in grouped.graph.node if n.output[0] == "last")
    last.attribute.append(helper.make_attribute("group", 2))
    weights = next(t for t in grouped.graph.initializer if t.name == "last_w")
    weights.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weights)[:, :4], "last_w"))
    per_channel = block_graph(True)
    for tensor in per_channel.graph.initializer:  # the last convolution's output requantised per channel
        if tensor.name == "a_scale":
            per_channel.graph.initializer.append(numpy_helper.from_array(np.full(8, 0.05, np.float32), "c_scale"))
            per_channel.graph.initializer.append(numpy_helper.from_array(np.full(8, 128, np.uint8), "c_zero"))
    for node in per_channel.graph.node:
        if node.output[0] in ("last_q", "last"):
            node.input[1:] = ["c_scale", "c_zero"]
            node.attribute.append(helper.make_attribute("axis", 1))
    other_axis = block_graph(False)
    next(n for n in other_axis.graph.node if n.op_type == "Gather").attribute[0].i = 0
    for model in (read_twice, grouped, per_channel, other_axis):
        before = model.SerializeToString()
        assert _kept_channels_only(model) == 0
        assert model.SerializeToString() == before
    run_graphs(grouped, per_channel)  # valid graphs: what was refused was runnable


def test_exported_graphs_compute_the_deepest_stage_for_the_kept_channels_only(model_file, tmp_path, monkeypatch):
    """The model's float32 graph and its int8 scorer's, against the same graphs with every channel computed: the
    same outputs (to the bit at int8), the last convolution's weights cut to the deepest stage's kept channels."""
    import torch

    from padim.models.deploy import export

    detector = load_detector(model_file, device="cpu")
    kept = int(detector.embedding._part2.numel())  # the deepest of the default stages (layer3)
    images = torch.randn(3, 3, *detector.config.input_shape, generator=torch.Generator().manual_seed(0)).numpy()
    makers = [("float32", export._export_onnx)]
    if detector.int8_scorer is not None and detector.int8_scorer.usable:
        makers.append(("int8", export._export_int8_onnx))
    assert len(makers) == 2, "the tests' default model carries an int8 scorer"
    for name, make in makers:
        pruned = onnx.load(str(make(detector, tmp_path / f"{name}.onnx", False)))
        with monkeypatch.context() as patched:
            patched.setattr(export, "_kept_channels_only", lambda model: 0)
            whole = onnx.load(str(make(detector, tmp_path / f"{name}-whole.onnx", False)))
        cut = [n for n in pruned.graph.node if n.op_type == "Gather"]
        assert len(cut) == len([n for n in whole.graph.node if n.op_type == "Gather"])  # one gone, one added
        constants = {t.name: tuple(t.dims) for t in pruned.graph.initializer}
        assert any(len(d) == 4 and d[0] == kept for d in constants.values()), name  # the last convolution's
        expected, found = (
            onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
                None, {"images": images}
            )
            for m in (whole, pruned)
        )
        for e, f in zip(expected, found, strict=True):
            if name == "int8":
                assert np.array_equal(e, f)
            else:
                np.testing.assert_allclose(f, e, rtol=1e-5, atol=1e-5 * float(np.abs(e).max()))
