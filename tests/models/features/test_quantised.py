"""The int8 backbone: quantised from pictures, checked against the float backbone it came from and against an
independent reading of its QDQ graph."""

import re

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from padim.core.errors import ArtifactError
from padim.models.data.synthetic import texture
from padim.models.features.backbones import build_backbone
from padim.models.features.embedding import FeatureExtractor, model_input
from padim.models.features.quantised import (
    HEADROOM,
    GraphExtractor,
    QuantisedExtractor,
    graph_settings,
    quantise_backbone,
    space_to_depth_stem,
)

LAYERS = ("layer1", "layer2")
SIDE = 64


def pictures(count: int, seed: int) -> torch.Tensor:
    """``count`` generated weave pictures as the backbone reads them (normalised float32)."""
    rng = np.random.default_rng(seed)
    stack = np.stack([texture("weave", SIDE, rng) for _ in range(count)])  # (N, S, S, 3) uint8
    return model_input(torch.from_numpy(stack).permute(0, 3, 1, 2).contiguous())


@pytest.fixture(scope="module")
def quantised():
    model, _ = build_backbone("resnet18", "random", seed=0)
    extractor = FeatureExtractor(model.eval(), LAYERS)
    made = quantise_backbone(extractor, [pictures(8, 0), pictures(8, 1)])
    return extractor, made.graph, made.settings, made.float_graph


def test_the_int8_backbone_gives_the_float_backbones_maps_within_its_quantisation_step(quantised):
    extractor, graph, _, _ = quantised
    int8 = QuantisedExtractor(graph, LAYERS)
    unseen = pictures(4, 2)  # pictures the quantiser did not see
    for reference, approximate in zip(extractor(unseen), int8(unseen), strict=True):
        assert approximate.shape == reference.shape and approximate.dtype == torch.float32
        error = (approximate - reference).abs().max() / reference.abs().max()
        assert 0 < error < 0.1  # int8: not exact, but a few steps of 1/255 of each range
        correlation = np.corrcoef(approximate.flatten().numpy(), reference.flatten().numpy())[0, 1]
        assert correlation > 0.99


def test_the_float32_graph_it_was_quantised_from_gives_the_float_backbones_maps_within_rounding(quantised):
    """The graph a CPU fit's pass 1 runs in ONNX Runtime in place of torch's backbone (Fit.prepare_int8_scorer)."""
    extractor, _, _, float_graph = quantised
    graph = GraphExtractor(float_graph, LAYERS)
    unseen = pictures(4, 2)
    for reference, found in zip(extractor(unseen), graph(unseen), strict=True):
        assert found.shape == reference.shape and found.dtype == torch.float32
        assert (found - reference).abs().max() / reference.abs().max() < 1e-5  # float32 rounding, not int8's steps
    assert not isinstance(graph, QuantisedExtractor)  # an embedder running it is not quantised
    with pytest.raises(ArtifactError, match="float32 backbone graph gives"):
        GraphExtractor(float_graph, ("layer1", "layer2", "layer3"))


def test_the_convolutions_and_their_relus_are_quantised_with_int8_weights_and_widened_activation_ranges(quantised):
    extractor, graph, settings, _ = quantised
    model = onnx.load_from_string(graph.numpy().tobytes())
    convolutions = [n for n in model.graph.node if n.op_type == "Conv"]
    produced_by = {output: node for node in model.graph.node for output in node.output}
    initial = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for conv in convolutions:  # every input of every convolution passes through a quantiser
        activation, weight = (produced_by[name] for name in conv.input[:2])
        assert activation.op_type == weight.op_type == "DequantizeLinear"
        assert initial[weight.input[0]].dtype == np.int8
        # reduce_range: 7-bit weights, which CPUs without VNNI multiply without saturating
        assert np.abs(initial[weight.input[0]]).max() <= 64
    assert len(convolutions) == sum(isinstance(m, torch.nn.Conv2d) for m in extractor.body.modules())
    assert {n.op_type for n in model.graph.node if n.op_type.startswith("QLinear")} == set()  # QDQ, not QOperator
    # a convolution's ReLU is folded into its output's quantiser; those left follow a residual addition
    assert all(produced_by[n.input[0]].op_type == "Add" for n in model.graph.node if n.op_type == "Relu")
    said = re.fullmatch(
        rf"{len(convolutions)} backbone convolutions and the (\d+) ReLUs after them", settings["quantised"]
    )
    blocks = sum(n.op_type == "Add" for n in model.graph.node)  # a residual addition a block
    assert said and int(said[1]) == 1 + blocks  # the stem's, and each block's first: not those after its addition
    assert settings["headroom"].startswith(f"activation ranges x{HEADROOM}") and settings["images"] == 16
    assert graph_settings(graph) == settings


def test_onnx_runtime_runs_each_convolution_with_its_relu_and_no_requantising_pass(quantised, tmp_path):
    """A convolution's output is quantised once, with its ReLU's range: once ONNX Runtime has fused the graph, no
    convolution's ReLU is left and no dequantised tensor is quantised again (a pass over the whole map at other
    scales)."""
    import onnxruntime as ort

    _, graph, _, _ = quantised
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "fused.onnx")
    ort.InferenceSession(graph.numpy().tobytes(), options, providers=["CPUExecutionProvider"])
    fused = onnx.load(str(tmp_path / "fused.onnx")).graph.node
    produced_by = {output: node for node in fused for output in node.output}
    assert [n.op_type for n in fused if n.op_type == "QLinearConv"]
    assert all(produced_by[n.input[0]].op_type in ("Add", "QLinearAdd") for n in fused if n.op_type == "Relu")
    requantised = [
        n.name
        for n in fused
        if n.op_type == "QuantizeLinear"
        and n.input[0] in produced_by  # not the picture's own quantiser
        and produced_by[n.input[0]].op_type == "DequantizeLinear"
    ]
    assert not requantised


def test_the_stem_read_in_two_by_two_blocks_gives_the_same_maps_to_the_bit(quantised):
    """The int8 extractor (a fit's embeddings) and the scorer's export run the stem over 2 x 2 blocks of the
    picture: the same integer sums as the 7 x 7 stride-2 convolution, so the same maps exactly."""
    import onnxruntime as ort

    _, graph, _, float_graph = quantised
    model = onnx.load_from_string(graph.numpy().tobytes())
    assert space_to_depth_stem(model)
    stem = next(n for n in model.graph.node if n.op_type == "Conv")
    found = {a.name: onnx.helper.get_attribute_value(a) for a in stem.attribute}
    assert found["kernel_shape"] == [4, 4] and found["strides"] == [1, 1] and found["pads"] == [0] * 4
    assert [n.op_type for n in model.graph.node].count("SpaceToDepth") == 1
    assert not space_to_depth_stem(model)  # once
    assert not space_to_depth_stem(onnx.load_from_string(float_graph.numpy().tobytes()))  # no quantised picture
    plain = ort.InferenceSession(graph.numpy().tobytes(), providers=["CPUExecutionProvider"])
    unseen = pictures(4, 2)
    as_stored = plain.run(None, {"images": unseen.to(torch.float32).numpy()})
    for reference, found_map in zip(as_stored, QuantisedExtractor(graph, LAYERS)(unseen), strict=True):
        assert np.array_equal(found_map.numpy(), reference)  # integer sums, requantised alike: exact


def qdq_stem(kernel: int, height: int, width: int, channels: int = 3, seed: int = 0):
    """A graph of one int8 convolution (stride 2, padding ``(kernel - 1) / 2``) between quantisers, as the quantiser
    writes a stem: ONNX Runtime runs it as one ``QLinearConv``."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    weights = rng.integers(-64, 64, (8, channels, kernel, kernel)).astype(np.int8)
    constants = {
        "x_scale": np.float32(0.02), "x_zero": np.uint8(121), "w": weights,
        "w_scale": (rng.random(8) * 1e-2 + 1e-3).astype(np.float32), "w_zero": np.zeros(8, np.int8),
        "y_scale": np.float32(0.05), "y_zero": np.uint8(7),
    }  # fmt: skip
    pad = (kernel - 1) // 2
    nodes = [
        helper.make_node("QuantizeLinear", ["images", "x_scale", "x_zero"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "x_scale", "x_zero"], ["x"]),
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["wf"], axis=0),
        helper.make_node("Conv", ["x", "wf"], ["c"], kernel_shape=[kernel] * 2, strides=[2, 2], pads=[pad] * 4),
        helper.make_node("QuantizeLinear", ["c", "y_scale", "y_zero"], ["qc"]),
        helper.make_node("DequantizeLinear", ["qc", "y_scale", "y_zero"], ["maps"]),
    ]
    graph = helper.make_graph(
        nodes, "stem", [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", channels, height, width])],
        [helper.make_tensor_value_info("maps", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(("kernel", "height", "width"), [(7, 33, 34), (7, 40, 41), (3, 29, 30), (5, 18, 17)])
def test_the_stem_rearranged_covers_every_kernel_and_odd_or_even_side(kernel, height, width):
    """Odd and even sides need one more or one less pixel of padding after; a 3 x 3 stride-2 stem (EfficientNet's)
    becomes 2 x 2 over the blocks. Against the graph as written, with zero points that are not 0 (the padding
    must be the picture's zero, not the integer 0)."""
    import onnxruntime as ort

    model = qdq_stem(kernel, height, width)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert space_to_depth_stem(rewritten)
    images = np.random.default_rng(1).normal(0, 1.2, (2, 3, height, width)).astype(np.float32)
    options = ort.SessionOptions()
    expected, found = (
        ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
            None, {"images": images}
        )[0]
        for m in (model, rewritten)
    )
    assert found.shape == expected.shape == (2, 8, (height - 1) // 2 + 1, (width - 1) // 2 + 1)
    assert np.array_equal(found, expected)


def test_a_stem_it_cannot_rearrange_is_left_as_it_is():
    """Stride 1, a picture size that is not fixed, or an even kernel: the graph is not touched."""
    for model in (qdq_stem(3, 20, 20), qdq_stem(4, 20, 20), qdq_stem(7, 20, 20)):
        conv = next(n for n in model.graph.node if n.op_type == "Conv")
        if conv.attribute[0].ints == [3, 3]:  # stride 1 instead of 2
            next(a for a in conv.attribute if a.name == "strides").ints[:] = [1, 1]
        elif conv.attribute[0].ints != [4, 4]:  # a picture size the graph does not fix
            model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "height"
        before = model.SerializeToString()
        assert not space_to_depth_stem(model)
        assert model.SerializeToString() == before


def test_bytes_that_are_not_the_graph_of_these_stages_are_refused(quantised):
    _, graph, _, _ = quantised
    with pytest.raises(ArtifactError, match="cannot be read"):
        QuantisedExtractor(graph[: len(graph) // 2].clone(), LAYERS)
    with pytest.raises(ArtifactError, match="not the stages"):
        QuantisedExtractor(graph, ("layer1", "layer2", "layer3"))


def test_a_backbone_exported_once_is_quantised_again_from_its_kept_graph(tmp_path, monkeypatch):
    """torch's exporter takes seconds a backbone: the same stages, weights and size are exported once and their graph
    kept (``$XDG_CACHE_HOME/padim/graphs``); another fit quantises the same graph from it, other weights or another
    size are exported anew, and the least recently used go beyond :data:`GRAPHS_KEPT`."""
    from padim.models.features import quantised as module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    exported = []
    export = module.export_module
    monkeypatch.setattr(module, "export_module", lambda *a, **k: exported.append(a[-1]) or export(*a, **k))
    model, _ = build_backbone("resnet18", "random", seed=0)
    extractor = FeatureExtractor(model.eval(), LAYERS)
    batches = [pictures(8, 0)]
    first = quantise_backbone(extractor, batches).graph
    second = quantise_backbone(extractor, batches).graph
    assert len(exported) == 1 and torch.equal(first, second)  # the kept graph, quantised alike
    kept = tmp_path / "padim" / "graphs"
    assert len(list(kept.glob("*.onnx"))) == 1 and not list(kept.glob("*.tmp"))
    other, _ = build_backbone("resnet18", "random", seed=1)
    quantise_backbone(FeatureExtractor(other.eval(), LAYERS), batches)
    assert len(exported) == 2 and len(list(kept.glob("*.onnx"))) == 2  # other weights: another graph
    monkeypatch.setattr(module, "GRAPHS_KEPT", 1)
    quantise_backbone(extractor, [pictures(8, 0)[:, :, :32, :32]])  # another size
    assert len(exported) == 3 and len(list(kept.glob("*.onnx"))) == 1
