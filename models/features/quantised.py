"""The INT8 backbone (``train --precision int8``): quantised once from the training pictures, run by ONNX Runtime.

The backbone's stages (:class:`~padim.models.features.embedding.FeatureExtractor`, BatchNorms folded) are exported
to ONNX and quantised statically in the QDQ format by ``onnxruntime.quantization``: per-channel int8 weights,
uint8 activations whose ranges are the MinMax of :data:`QUANTISER_IMAGES` training pictures widened by
:data:`HEADROOM` (a defect's features are larger than any normal picture's), ``reduce_range`` (7-bit weights, which
CPUs without VNNI multiply without saturating), the convolutions and the ReLUs after them
(:func:`backbone_nodes`). The graph's bytes are kept in the model file among the backbone's tensors
(:data:`GRAPH_KEY`), so every copy of the model (a resume, a merge, a learned update, a repository's version) runs
the very graph its statistics and threshold were computed with; the file's digests cover it like any tensor.

:class:`QuantisedExtractor` runs it where the float backbone would run: the fit's embeddings, its out-of-fold scores
and so its threshold, every later score, all come from it. Only the backbone is int8: the embedding, the Gaussians
and the map are float32, as at every precision. :class:`GraphExtractor` runs the float32 graph it was quantised from
(a default fit's pass 1 on a CPU, where ONNX Runtime runs it faster than torch).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from padim.core.errors import ArtifactError
from padim.models.choices import install_extra
from padim.models.devices import onnxruntime_installed
from padim.models.errors import UsageError

log = logging.getLogger(__name__)

#: Where the quantised graph is kept among the backbone's tensors (``backbone.`` + this in the file): uint8 bytes.
GRAPH_KEY = "int8.onnx"
#: Training pictures whose activations set the quantiser's ranges (the same on every rank: the names that hash
#: lowest).
QUANTISER_IMAGES = 32
#: Activation ranges measured on normal pictures are widened by this factor: a defect's features are larger than any
#: normal picture's, and a range fitted to normal pictures alone clips them at the first quantiser they meet
#: (measured, docs/quantisation.md: defect scores fell by up to 22% and AUROC by .022 at 1.0; 1.5 kept AUROC).
HEADROOM = 1.5
#: ONNX operator set of the graphs (onnxruntime >= 1.16, OpenVINO >= 2023.1, Triton >= 23.10).
OPSET = 18
#: The quantised graph's input.
INPUT = "images"


def require_onnxruntime():
    """ONNX Runtime and the ONNX exporter, which an int8 backbone needs (the ``onnxruntime`` extra)."""
    if not onnxruntime_installed():
        raise UsageError(
            "--precision int8 runs the backbone in ONNX Runtime, which is not installed: "
            f"{install_extra('onnxruntime')} (or use --precision fp32)"
        )
    # an optional extra ([onnxruntime]): imported only for an int8 backbone
    import onnxruntime

    return onnxruntime


class quiet_exporter:
    """The dynamo exporter prints its progress with ``print`` and logs at INFO: keep stdout for JSON."""

    def __enter__(self):
        self._out = contextlib.redirect_stdout(io.StringIO())
        self._out.__enter__()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        for noisy in ("onnxscript", "onnx_ir", "torch.onnx", "torch.export", "torch._export"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc):
        self._warnings.__exit__(*exc)
        return self._out.__exit__(*exc)


def export_module(
    module: nn.Module,
    example: tuple[torch.Tensor, ...],
    input_names: Sequence[str],
    output_names: Sequence[str],
    path: Path,
    external_data: bool = False,
    varargs: bool = False,
    guard: contextlib.AbstractContextManager | None = None,
) -> Path:
    """``module`` as an ONNX graph at ``path`` (torch's dynamo exporter), every input's first axis a dynamic batch
    (``varargs``: ``module`` takes ``example`` as ``*args``), under ``guard`` (the embedding's ``TRACING.shared()``:
    not while a backbone is traced on another thread, a load or an update)."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    shapes = tuple({0: batch} for _ in example)
    with quiet_exporter(), guard or contextlib.nullcontext():
        program = torch.onnx.export(
            module,
            example,
            dynamo=True,
            input_names=list(input_names),
            output_names=list(output_names),
            dynamic_shapes=(shapes,) if varargs else shapes,
            opset_version=OPSET,
            optimize=True,
            verbose=False,
        )
        assert program is not None, "torch.onnx.export(dynamo=True) returns its program"
        program.save(str(path), external_data=external_data)
    return path


class _Stages(nn.Module):
    """The float backbone's stages with a tuple out (what the exporter takes): ``images -> (map of each layer)``."""

    def __init__(self, extractor) -> None:
        super().__init__()
        self.extractor, self.layers = extractor.body, extractor.layers

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self.extractor(images)
        return tuple(outputs[layer] for layer in self.layers)


#: The backbone's operations the quantiser is given: its convolutions, and the ReLUs that read a convolution's output,
#: so that each convolution's output is quantised once, with the range its ReLU leaves (ONNX Runtime fuses the ReLU
#: away). With the convolutions alone, each output was quantised over its signed range, then again after the ReLU: a
#: requantising pass of every activation map (the int8 backbone 12-15% slower at batches 1 and 16 on a Zen 4 CPU),
#: and 8 bits spread over values the ReLU then drops (resnet18's stages 17-26% further from float32 on average;
#: measured, docs/quantisation.md). A residual addition and its ReLU are not given to it: where the next convolution's
#: quantiser reads them, ONNX Runtime runs the addition in int8 (``QLinearAdd``) and folds the ReLU into that
#: quantiser; the last one, which only the embedding reads, stays float32.
QUANTISED_OPERATIONS = ("Conv", "Relu")


def backbone_nodes(model) -> tuple[list[str], list[str]]:
    """Names of the backbone's convolutions of an exported ONNX graph (nodes of a module named ``extractor``), and
    of the ReLUs that read one of their outputs.

    The exporter records each node's module path (``pkg.torch.onnx.name_scopes``); a graph without it has every
    such node counted (the embedding and the statistics have no convolution and no ReLU).
    """
    convolutions, outputs = [], set()
    for node in model.graph.node:
        if node.op_type != "Conv":
            continue
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
        if scopes is None or "'extractor" in scopes:
            convolutions.append(node.name)
            outputs.update(node.output)
    relus = [node.name for node in model.graph.node if node.op_type == "Relu" and node.input[0] in outputs]
    return convolutions, relus


def widen_onnx_ranges(model, factor: float) -> int:
    """Multiply the scale of every activation quantiser (``QuantizeLinear``; weights are stored quantised, with a
    ``DequantizeLinear`` alone) of a QDQ graph by ``factor``, in place: its range ``[min, max]`` becomes
    ``[factor min, factor max]`` (the zero point stays). Its ``DequantizeLinear`` shares the scale. Returns how many."""
    # an optional extra ([onnxruntime]): imported only for an int8 backbone
    from onnx import numpy_helper

    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    scales = {node.input[1] for node in model.graph.node if node.op_type == "QuantizeLinear"}
    for name in scales:
        tensor = initializers[name]
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(factor), name))
    return len(scales)


class _Stem(NamedTuple):
    """The nodes of a QDQ graph's stem convolution (:func:`space_to_depth_stem`)."""

    quantiser: Any  # QuantizeLinear of the picture (onnx's NodeProto: onnx is an optional extra)
    dequantised: Any  # its DequantizeLinear, which only the convolution reads
    conv: Any
    weights: Any  # the int8 weights' initializer (TensorProto)
    sides: tuple[int, int]  # the picture's height and width


def _stem(graph) -> _Stem | None:
    """The stem :func:`space_to_depth_stem` can rearrange: the one convolution reading the quantised picture, with an
    odd square kernel, stride 2, padding ``(k - 1) / 2``, no dilation nor groups, in a graph of fixed picture size;
    else ``None``."""
    # an optional extra ([onnxruntime]): imported only for an int8 backbone
    from onnx import helper

    dims = [d.dim_value if d.HasField("dim_value") else None for d in graph.input[0].type.tensor_type.shape.dim]
    if len(dims) != 4 or dims[2] is None or dims[3] is None:
        return None
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    quantiser = next(
        (n for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] == graph.input[0].name), None
    )
    picture = readers.get(quantiser.output[0], []) if quantiser is not None else []
    if len(picture) != 1 or picture[0].op_type != "DequantizeLinear" or len(readers[picture[0].output[0]]) != 1:
        return None
    conv = readers[picture[0].output[0]][0]
    weight_node = next((n for n in graph.node if conv.input[1] in n.output), None) if conv.op_type == "Conv" else None
    initial = {t.name: t for t in graph.initializer}
    if weight_node is None or weight_node.op_type != "DequantizeLinear" or weight_node.input[0] not in initial:
        return None
    shape = list(initial[weight_node.input[0]].dims)
    found = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
    kernel = shape[2] if len(shape) == 4 else 0
    if (
        kernel % 2 == 0
        or shape[3] != kernel
        or list(found.get("strides", [])) != [2, 2]
        or list(found.get("pads", [0] * 4)) != [(kernel - 1) // 2] * 4
        or any(d != 1 for d in found.get("dilations", [1, 1]))
        or found.get("group", 1) != 1
        or found.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")
    ):
        return None
    return _Stem(quantiser, picture[0], conv, initial[weight_node.input[0]], (dims[2], dims[3]))


def _blocked(weights: np.ndarray) -> np.ndarray:
    """``(O, C, k, k)`` stride-2 taps (``k`` odd) as ``(O, 4 C, (k + 1) / 2, (k + 1) / 2)`` stride-1 taps over
    ``SpaceToDepth`` blocks of the picture padded one pixel more before."""
    out_channels, channels, kernel = weights.shape[:3]
    taps = (kernel + 1) // 2  # the even kernel over 2 x 2 blocks
    padded = np.zeros((out_channels, channels, 2 * taps, 2 * taps), weights.dtype)
    padded[:, :, 1:, 1:] = weights  # a row and a column of zeros before, for the extra pixel of padding
    # SpaceToDepth's channel is (row in block, column in block, channel): the taps rearranged the same way
    blocked = padded.reshape(out_channels, channels, taps, 2, taps, 2).transpose(0, 3, 5, 1, 2, 4)
    return np.ascontiguousarray(blocked.reshape(out_channels, 4 * channels, taps, taps))


def space_to_depth_stem(model) -> bool:
    """Rewrite an int8 graph's stem convolution (the one that reads the quantised picture, with an odd
    ``k x k`` kernel, stride 2, padding ``(k - 1) / 2``, as resnets' 7 x 7) as the same sums over the picture's 2 x 2
    blocks, in place: the uint8 picture padded with its zero point and rearranged into 4 times the channels at half
    the side (``SpaceToDepth``), then a stride-1 ``(k + 1) / 2`` kernel whose taps are the old ones (and zeros
    where the even kernel overhangs the odd one). Each output is the same integer sum of the same products, so the
    graph's outputs are the same to the bit; ONNX Runtime's int8 kernels gather 12 channels a pixel far faster than
    3 (resnet18 at 224 px, 2-core Zen 4: the stem 7.96 -> 4.63 ms at batch 16, 0.82 -> 0.46 ms at batch 1, the
    rearranging 1.5 ms at 16; docs/performance.md). Returns whether it was rewritten: ``False`` for a graph without
    such a stem, a float one, one whose picture size is not fixed, or one already rewritten."""
    # an optional extra ([onnxruntime]): imported only for an int8 backbone
    from onnx import helper, numpy_helper

    stem = _stem(model.graph) if model.graph.input else None
    if stem is None:
        return False
    weights = numpy_helper.to_array(stem.weights)
    kernel, pad = weights.shape[2], (weights.shape[2] - 1) // 2
    taps = (kernel + 1) // 2
    stem.weights.CopyFrom(numpy_helper.from_array(_blocked(weights), stem.weights.name))
    # one more pixel before (the zero taps'); after, what the blocks need to cover the last output's taps
    ends = [2 * ((side + 2 * pad - kernel) // 2 + taps) - side - (pad + 1) for side in stem.sides]
    pads = np.array([0, 0, pad + 1, pad + 1, 0, 0, *ends], np.int64)
    model.graph.initializer.append(numpy_helper.from_array(pads, "stem_space_to_depth_pads"))
    zero_point = list(stem.dequantised.input[2:3])  # the picture's zero point pads it (none: 0)
    nodes = [
        helper.make_node(
            "Pad",
            [stem.quantiser.output[0], "stem_space_to_depth_pads", *zero_point],
            ["stem_padded"],
            name="stem_pad",
            mode="constant",
        ),
        helper.make_node("SpaceToDepth", ["stem_padded"], ["stem_blocks"], name="stem_space_to_depth", blocksize=2),
    ]
    stem.dequantised.input[0] = "stem_blocks"
    where = list(model.graph.node).index(stem.dequantised)
    for offset, node in enumerate(nodes):
        model.graph.node.insert(where + offset, node)
    for attribute in [a for a in stem.conv.attribute if a.name in ("kernel_shape", "strides", "pads")]:
        stem.conv.attribute.remove(attribute)
    stem.conv.attribute.extend(
        [
            helper.make_attribute("kernel_shape", [taps, taps]),
            helper.make_attribute("strides", [1, 1]),
            helper.make_attribute("pads", [0, 0, 0, 0]),
        ]
    )
    return True


def quantise_static(float_graph: Path, output: Path, batches: Sequence[np.ndarray], work: Path) -> dict:
    """Static QDQ quantisation of :func:`backbone_nodes` of ``float_graph`` into ``output`` (ranges from ``batches``,
    ``(b, 3, S, S)`` float32 inputs, widened by :data:`HEADROOM`); the settings that made it."""
    # an optional extra ([onnxruntime]): imported only for an int8 backbone
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    model = onnx.load(str(float_graph), load_external_data=False)
    convolutions, relus = backbone_nodes(model)
    input_name = model.graph.input[0].name
    del model
    prepared = work / "prepared.onnx"
    # symbolic shape inference fails on the statistics' reshapes, and the optimiser would fold the
    # packed precision factors into full float32 matrices: ONNX shape inference only
    quant_pre_process(str(float_graph), str(prepared), skip_optimization=True, skip_symbolic_shape=True)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._batches = iter(batches)

        def get_next(self):
            batch = next(self._batches, None)
            return None if batch is None else {input_name: batch}

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress: keep stdout for JSON
        quantize_static(
            str(prepared),
            str(output),
            Reader(),
            quant_format=QuantFormat.QDQ,
            nodes_to_quantize=convolutions + relus,
            op_types_to_quantize=list(QUANTISED_OPERATIONS),
            per_channel=True,
            reduce_range=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )
    prepared.unlink(missing_ok=True)
    quantised = onnx.load(str(output))
    widened = widen_onnx_ranges(quantised, HEADROOM)
    onnx.save(quantised, str(output))
    return {
        "runtime": "onnxruntime",
        "tool": "onnxruntime.quantization.quantize_static",
        "format": "QDQ",
        "weights": "int8, per channel",
        "activations": "uint8",
        "reduce_range": True,
        "calibration": "MinMax",
        "quantised": f"{len(convolutions)} backbone convolutions and the {len(relus)} ReLUs after them",
        "headroom": f"activation ranges x{HEADROOM} ({widened} quantisers)",
    }


class QuantisedBackbone(NamedTuple):
    """What :func:`quantise_backbone` makes: the int8 graph, what made it, and the float32 graph it was quantised
    from (uint8 bytes each)."""

    graph: torch.Tensor
    settings: dict
    float_graph: torch.Tensor


def quantise_backbone(
    extractor, batches: Sequence[torch.Tensor], guard: contextlib.AbstractContextManager | None = None
) -> QuantisedBackbone:
    """The int8 graph of a float :class:`~padim.models.features.embedding.FeatureExtractor` as uint8 bytes (for the
    model file), its activation ranges from ``batches`` (``(b, 3, S, S)`` normalised float32 tiles, as the backbone
    reads them); what made it (kept in the graph's metadata too); and the float32 graph it was quantised from, which
    :class:`GraphExtractor` runs. ``guard``: as :func:`export_module`'s."""
    ort = require_onnxruntime()
    # an optional extra ([onnxruntime]): imported only for an int8 backbone
    import onnx

    stages = _Stages(extractor).eval().to("cpu")
    side = batches[0].shape[-2:]
    with tempfile.TemporaryDirectory(prefix="padim-int8-") as folder:
        work = Path(folder)
        float_graph = float_backbone_graph(stages, (int(side[0]), int(side[1])), work / "float32.onnx", guard)
        inputs = [np.ascontiguousarray(b.detach().cpu().numpy(), dtype=np.float32) for b in batches]
        settings = quantise_static(float_graph, work / "int8.onnx", inputs, work)
        settings.update(
            {
                "images": int(sum(len(b) for b in batches)),
                "onnxruntime": ort.__version__,
                "layers": list(extractor.layers),
            }
        )
        model = onnx.load(str(work / "int8.onnx"))
        entry = model.metadata_props.add()
        entry.key, entry.value = "padim.quantisation", json.dumps(settings)
        data = model.SerializeToString()
        float_bytes = float_graph.read_bytes()
    return QuantisedBackbone(as_bytes(data), settings, as_bytes(float_bytes))


def as_bytes(data: bytes) -> torch.Tensor:
    """A graph's bytes as the uint8 tensor a model file keeps."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


#: Float backbone graphs kept between fits (:func:`float_backbone_graph`), the least recently used dropped beyond it.
GRAPHS_KEPT = 8
#: Changes when what goes into a kept graph changes (the stages' module, the exporter's settings): older ones unread.
GRAPH_CACHE_VERSION = 1


def float_backbone_graph(
    stages: _Stages, side: tuple[int, int], path: Path, guard: contextlib.AbstractContextManager | None = None
) -> Path:
    """The float backbone's ONNX graph at ``path``, for its quantiser: exported by torch's dynamo exporter (2.4-3.6 s
    for resnet18 on 2 cores; the TorchScript exporter's graph takes 0.2 s, but its int8 convolutions ran 3-5x slower
    in ONNX Runtime, shared biases and all), or copied from :func:`graph_cache` where the same stages, weights and
    picture size were exported before (each fit of a line's model with the same weights)."""
    cache = graph_cache()
    key = hashlib.sha256(f"{GRAPH_CACHE_VERSION} {torch.__version__} {OPSET} {side} {stages.layers}".encode())
    for name, tensor in stages.state_dict().items():
        key.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
        key.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    kept = None if cache is None else cache / f"{key.hexdigest()[:32]}.onnx"
    if kept is not None and kept.is_file():
        shutil.copyfile(kept, path)
        os.utime(kept)  # recently used: the last to go
        return path
    export_module(stages, (torch.zeros(2, 3, *side),), [INPUT], list(stages.layers), path, guard=guard)
    if cache is not None and kept is not None:
        try:  # published whole (a rename), so that another process never reads half a graph
            staged = kept.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(path, staged)
            os.replace(staged, kept)
            for old in sorted(cache.glob("*.onnx"), key=lambda p: p.stat().st_mtime, reverse=True)[GRAPHS_KEPT:]:
                old.unlink(missing_ok=True)
        except OSError:  # a full or read-only cache costs the next fit the export, nothing else
            log.debug("float backbone graph not kept in %s", cache, exc_info=True)
    return path


def graph_cache() -> Path | None:
    """Where float backbone graphs are kept between fits: ``$XDG_CACHE_HOME/padim/graphs`` (``~/.cache``), else the
    temporary directory's ``padim-cache/graphs``; ``None`` where neither can be written."""
    for root in (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "padim",
        Path(tempfile.gettempdir()) / "padim-cache",
    ):
        folder = root / "graphs"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    return None


def graph_settings(graph: torch.Tensor) -> dict:
    """What made a quantised graph (its ``padim.quantisation`` metadata); ``{}`` where it holds none."""
    # an optional extra ([onnxruntime]): imported only for an int8 backbone
    import onnx

    model = onnx.load_from_string(graph.numpy().tobytes())
    found = next((p.value for p in model.metadata_props if p.key == "padim.quantisation"), None)
    return {} if found is None else json.loads(found)


class GraphExtractor(nn.Module):
    """The backbone's stages as an ONNX graph in ONNX Runtime (on the CPU): what
    :class:`~padim.models.features.embedding.FeatureExtractor` gives, ``(B, 3, S, S)`` normalised images ->
    ``[(B, C_l, S / stride_l, S / stride_l)]`` float32 maps. The float32 graph (:attr:`QuantisedBackbone.float_graph`)
    runs a fit's pass 1 on a CPU (:meth:`padim.models.fit.in_progress.Fit.prepare_int8_scorer`);
    :class:`QuantisedExtractor` runs the int8 one.

    Args:
        graph: the graph's bytes, as the model file keeps them (uint8).
        layers: the stages it returns, shallowest first.

    Raises:
        ArtifactError: bytes that are not the graph of these stages.
        UsageError: ONNX Runtime is not installed.
    """

    #: What the graph is, in its errors.
    what = "the float32 backbone graph"

    def __init__(self, graph: torch.Tensor, layers: tuple[str, ...]) -> None:
        super().__init__()
        ort = require_onnxruntime()
        self.layers = tuple(layers)
        self.dtype = torch.float32
        self.graph = graph
        self.register_buffer("_anchor", torch.zeros(0), persistent=False)  # where the module is (always the CPU)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        # idle threads otherwise spin after each run, taking the cores from the decoding beside it
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(self.runnable(graph), options, providers=["CPUExecutionProvider"])
        except Exception as error:  # ONNX Runtime raises its own types for a graph it cannot read
            raise ArtifactError(f"{self.what} cannot be read ({type(error).__name__}: {error})") from None
        outputs = [output.name for output in self.session.get_outputs()]
        if outputs != list(self.layers) or [i.name for i in self.session.get_inputs()] != [INPUT]:
            raise ArtifactError(f"{self.what} gives {outputs}, not the stages {list(self.layers)}")

    @staticmethod
    def runnable(graph: torch.Tensor) -> bytes:
        """The bytes ONNX Runtime is given: the graph's own."""
        return graph.numpy().tobytes()

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> list[torch.Tensor]:
        array = np.ascontiguousarray(images.detach().to("cpu", torch.float32).numpy())
        return [torch.from_numpy(m) for m in self.session.run(None, {INPUT: array})]


class QuantisedExtractor(GraphExtractor):
    """The backbone's stages as their int8 graph (:data:`GRAPH_KEY`) in ONNX Runtime: a :class:`GraphExtractor` that
    an embedder reports as quantised (:attr:`~padim.models.features.embedding.FeatureEmbedder.quantised`)."""

    what = "the int8 backbone"

    @staticmethod
    def runnable(graph: torch.Tensor) -> bytes:
        """The graph with its stem rearranged (:func:`space_to_depth_stem`: the same maps to the bit, faster), as the
        scorer's export runs it; bytes that are not a graph go to ONNX Runtime as they are, which refuses them."""
        # an optional extra ([onnxruntime]): imported only for an int8 backbone
        import onnx
        from google.protobuf.message import DecodeError

        data = graph.numpy().tobytes()
        try:
            model = onnx.load_from_string(data)
        except DecodeError:
            return data
        return model.SerializeToString() if space_to_depth_stem(model) else data
