"""The whole scorer as one graph, for other runtimes: ONNX, OpenVINO IR, a Triton model repository.

One graph takes a normalised image batch and gives the anomaly maps and raw scores, with
everything in between inside it: the backbone (BatchNorm folded, as the torch path runs it),
the channel subset or projection, the Mahalanobis distance with the stored precision factors,
upsampling + blur (as the two precomputed matrices :func:`padim.core.scoring.anomaly_maps`
uses) and the image score (the model's ``image_score``: the map's maximum, the feature grid's, or
the mean of its top pixels; any neighbourhood average is part of the embedding). Nothing a client could get
wrong is left outside but the framing (region of interest and resize mode, :mod:`padim.models.data.framing`)
and the normalisation, which ``padim.json`` spells out and
:class:`padim.models.deploy.runtimes.DeployedDetector` does exactly as training did.

| graph tensor | shape | dtype |
|---|---|---|
| input ``images`` | ``(B, 3, S, S)``, ``B`` dynamic | float32, RGB, ImageNet-normalised |
| output ``anomaly_map`` | ``(B, S, S)`` | float32, raw units (Mahalanobis distance) |
| output ``raw_score`` | ``(B,)`` | float32, the image score (by default the maximum of each map) |
| output ``input_distance`` | ``(B,)`` | float32, mean squared distance over the feature pixels (input drift) |

The precision factors travel packed (lower triangle only) in the dtype the model file stores
(float16 where ``train`` chose it), and are unpacked and cast to float32 by the graph's first
constant nodes, which the runtimes fold once at load. Graphs whose weights pass
:data:`EXTERNAL_DATA_BYTES` keep them in ONNX's external-data file (``model.onnx.data``).

Beside the graph, ``padim.json`` (:data:`METADATA_FILE`) holds what a client needs: the input
size and normalisation, the calibration and threshold, the model's identity, and the sha256 of
every file of the export, checked when it is loaded.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from padim.core import __version__
from padim.core.artifact import ArtifactError, file_sha256
from padim.core.calibration import Calibration
from padim.core.scoring import image_scores, upsample_blur_operator
from padim.core.tiling import tiled_anomaly_maps
from padim.models.choices import EXPORT_FORMATS, install_extra
from padim.models.data.framing import PAD_FILL
from padim.models.errors import ExportError as ExportError  # re-exported: raised here
from padim.models.features.backbones import IMAGENET_MEAN, IMAGENET_STD
from padim.models.features.embedding import TRACING, FeatureExtractor, build_extractor
from padim.models.features.photometric import standardised
from padim.models.features.quantised import GRAPH_KEY, export_module, space_to_depth_stem
from padim.models.features.quantised import INPUT as QUANTISED_INPUT
from padim.models.scoring.detector import PadimDetector
from padim.models.scoring.reduced import Int8Scorer

log = logging.getLogger(__name__)

METADATA_FILE = "padim.json"
#: Every earlier export version is read; docs/file-format.md has a table of what each added.
EXPORT_KIND, EXPORT_VERSION = "padim-export", 18
#: The export version whose graph is today's: a model file's cached export older than it is made again (faster);
#: a newer version that changed only ``padim.json`` (8: ``precision: bf16``; 10: ``calibration_line_scores``, a
#: line's threshold, which only a model of format 13 has) or what only a model of a newer format computes (9:
#: ``config.standardise``, none in every older file; 11: an int8 model file's own graph, ``precision: int8`` without
#: ``quantisation``, which only a model of format 15 has; 12: the run option ``decode_workers``, spelled ``workers``
#: before; 13: ``description.backbone_family`` and ``description.stages``, any backbone family; 14: ``config.shrinkage``
#: ``auto`` and ``provenance.shrinkage_estimated``; 15: ``config.standardise`` ``gain``, which only a model of format
#: 19 has; 16: ``quantisation.model_scorer``, the graph of a model file's int8 scorer, which only a model of format
#: 20 has) keeps the cache. 17: an int8 graph's stem reads the picture in 2 x 2 blocks (the same scores, faster).
#: 18: the deepest stage's last convolution computes only the channels the embedding keeps (the same scores, faster).
GRAPH_VERSION = 18
INPUT_NAME = "images"
OUTPUT_NAMES = ("anomaly_map", "raw_score", "input_distance")
ONNX_FILE, OPENVINO_FILE = "model.onnx", "model.xml"
#: Graphs with more weight bytes than this keep them in ONNX external data (protobuf stops at 2 GiB).
EXTERNAL_DATA_BYTES = 1_500_000_000
#: Largest batch the Triton configuration accepts.
TRITON_MAX_BATCH = 32
#: Where Triton runs the model (``instance_group`` kind): ``gpu`` (``KIND_GPU``) or ``cpu``.
TRITON_DEVICES = ("gpu", "cpu")


class ExportedScorer(nn.Module):
    """What goes into the graph: ``(B, 3, H_in, W_in)`` images -> ``(B, H_in, W_in)`` maps, ``(B,)`` raw scores and
    ``(B,)`` input distances.

    The same operations as :class:`padim.models.scoring.model.PadimModel`, written without in-place
    or ``out=`` ops so that the exporters can trace them. A tiled model's tiles are cut inside the
    graph (slices of the input, one batch through the backbone) and their maps stitched there
    (:mod:`padim.core.tiling`): a client sends the whole framed picture, as to an untiled model.

    Args:
        detector: the fitted detector (its torch model, any device).
    """

    # buffers, declared for the type checker (nn.Module's attributes are untyped)
    mean: torch.Tensor
    precision_factor_packed: torch.Tensor
    unpack_index: torch.Tensor
    rows: torch.Tensor
    cols_t: torch.Tensor

    def __init__(self, detector: PadimDetector, backbone_dtype: torch.dtype = torch.float32):
        super().__init__()
        model = detector.model
        self.backbone_dtype = backbone_dtype
        if model.embedder.precision != "fp32":  # fitted at bf16, fp16 or int8: its float backbone from the weights
            extractor = build_extractor(detector.config, detector.backbone_weights, "fp32")
            assert isinstance(extractor, FeatureExtractor), "fp32 is the float backbone"
            self.extractor = extractor.body
        else:
            self.extractor = model.embedder.extractor.body
        if backbone_dtype != torch.float32:  # a copy: the detector's own backbone stays as it is
            self.extractor = copy.deepcopy(self.extractor).to(backbone_dtype)
        self.layers = model.embedder.extractor.layers
        self.embedding = model.embedder.embedding
        self.grid_shape = model.grid_shape
        self.tiling = model.embedder.tiling
        self.standardise = model.embedder.standardise
        self.tiles_per_row = self.tiling.count // model.embedder.rows_per_image  # T (a Gaussian per position) or 1
        self.scoring = model.scoring
        dim = self.embedding.embedding_dim
        rows, cols = torch.tril_indices(dim, dim)
        # (D * D,) position of every entry of W in the packed row, or T (a zero column) above the diagonal
        index = torch.full((dim, dim), rows.numel(), dtype=torch.int64)
        index[rows, cols] = torch.arange(rows.numel())
        factor = model.precision_factor.detach().cpu()  # (p, D, D) as stored (float16 or float32)
        packed = factor[:, rows, cols].to(detector.precision_dtype)  # (p, T), T = D (D + 1) / 2
        self.register_buffer("mean", model.mean.detach().cpu().clone())  # (p, D)
        self.register_buffer("precision_factor_packed", torch.cat([packed, packed.new_zeros(len(packed), 1)], 1))
        self.register_buffer("unpack_index", index.flatten())  # (D * D,)
        height, width = self.grid_shape
        size, sigma = model.image_size, model.scoring.blur_sigma
        if self.tiling.count == 1:
            self.register_buffer("rows", upsample_blur_operator(height, size, sigma).clone())  # (S, H)
            self.register_buffer("cols_t", upsample_blur_operator(width, size, sigma).T.contiguous())  # (W, S)
        else:
            rows_op, cols_op = self.tiling.map_operators(sigma)
            self.register_buffer("rows", rows_op.clone())  # (R, H_in, H)
            self.register_buffer("cols_t", cols_op.clone())  # (C, W, W_in)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tiles = self.tiles(images)  # (B * T, 3, S, S) through the backbone
        if self.backbone_dtype != torch.float32:  # fp16 exports: the backbone alone in float16
            features = self.extractor(tiles.to(self.backbone_dtype))
            features = {layer: features[layer].to(torch.float32) for layer in self.layers}
        else:
            features = self.extractor(tiles)
        return self.statistics([features[layer] for layer in self.layers], images.shape[0])

    def tiles(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H_in, W_in)`` -> ``(B * T, 3, S, S)``: what the backbone reads."""
        return self.tiling.cut(standardised(images, self.standardise))

    def statistics(
        self, features: list[torch.Tensor], batch: int | torch.SymInt
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backbone's maps of ``batch`` pictures -> anomaly maps, raw scores and input distances: all after the
        backbone."""
        embedding = self.embedding(features)  # (B * T, D, H, W)
        dim, grid_pixels = embedding.shape[1], self.grid_shape[0] * self.grid_shape[1]
        pixels = self.mean.shape[0]
        # constant subgraph, folded at load: (p, T + 1) packed -> (p, D, D) float32
        factor = self.precision_factor_packed.to(torch.float32).index_select(1, self.unpack_index)
        factor = factor.reshape(pixels, dim, dim)
        # rows of the statistics: (p, N, D), tile positions one after another when each has its Gaussian
        if self.tiles_per_row == 1:  # one axis moved to the front: a transpose runtimes do in one fast pass
            rows = embedding.reshape(-1, dim, grid_pixels).permute(2, 0, 1)
        else:
            rows = embedding.reshape(-1, self.tiles_per_row, dim, grid_pixels).permute(1, 3, 0, 2)
            rows = rows.reshape(pixels, -1, dim)
        delta = rows - self.mean.unsqueeze(1)  # (p, N, D)
        squared = triangular_squared_norm(delta, factor).transpose(0, 1)  # (N, p)
        squared = squared.reshape(batch, self.tiling.count * grid_pixels)  # (B, T * P)
        if self.tiling.count == 1:
            distance = squared.clamp_min(0).sqrt().reshape(-1, *self.grid_shape)  # (B, H, W)
            maps = self.rows @ distance @ self.cols_t  # (B, S, S)
        else:
            maps = tiled_anomaly_maps(squared, self.tiling, 0.0, (self.rows, self.cols_t))  # (B, H_in, W_in)
        return maps, image_scores(maps, self.scoring.image_score, squared, self.scoring.top_fraction), squared.mean(1)


#: Row blocks of the lower-triangular precision factor in the graph: ``||W delta||^2`` as the sum over blocks of
#: ``||W[rows, :end] delta[:end]||^2``, skipping the zeros above the diagonal. At batch 1 the product only reads the
#: factors (memory-bound: 125 MB at 56 x 56 pixels and D = 100); 4 blocks read 62.5% of them.
FACTOR_BLOCKS = 2


def triangular_squared_norm(delta: torch.Tensor, factor: torch.Tensor, blocks: int = FACTOR_BLOCKS) -> torch.Tensor:
    """``||W delta||^2`` for each pixel's lower-triangular ``W``: ``(p, N, D)``, ``(p, D, D)`` -> ``(p, N)``.

    Each block of rows of ``W`` is multiplied with the columns up to its diagonal only (constant slices of the
    factor, folded when the graph loads), so about half of ``W``'s zeros are never read.
    """
    dim = factor.shape[-1]
    bounds = [round(dim * (i + 1) / blocks) for i in range(blocks)]
    squared = None
    start = 0
    for stop in bounds:
        part = torch.matmul(delta[..., :stop], factor[:, start:stop, :stop].transpose(1, 2))  # (p, N, stop - start)
        term = (part * part).sum(-1)  # a Mul in the graph: ONNX Runtime's Pow squares more slowly (the same bits)
        squared = term if squared is None else squared + term
        start = stop
    assert squared is not None
    return squared


# ---------------------------------------------------------------------- writing
def export_detector(
    detector: PadimDetector,
    output: str | Path,
    fmt: str,
    source: str | Path,
    source_sha256: str | None = None,
    name: str | None = None,
    external_data: bool | None = None,
    triton_device: str = "gpu",
    write_graph: Callable[[Path, Path], Any] | None = None,
) -> Path:
    """Write ``detector`` as ``fmt`` into the directory ``output`` (created; replaced atomically).

    Args:
        fmt: ``onnx`` (``model.onnx``), ``openvino`` (``model.xml`` + ``model.bin``) or
            ``triton`` (a model repository: ``output/NAME/config.pbtxt``, ``output/NAME/1/model.onnx``).
        source: the model file it came from (its name and digest go into ``padim.json``).
        name: the Triton model name (default: the model file's stem).
        external_data: force ONNX external data on or off (default: by size).
        triton_device: ``gpu`` (one instance on each GPU, ``KIND_GPU``) or ``cpu`` (``KIND_CPU``).
        write_graph: ``(graph_dir, staging) -> Quantised`` writes another graph than the float32 one (a
            quantised scorer: :func:`padim.models.deploy.quantise.export_quantised_detector`, which calls this
            function); ``None``: float32.

    Returns:
        The directory holding the graph and ``padim.json`` (``output/NAME`` for Triton).

    Raises:
        ExportError: an unknown format, or a runtime package that is not installed.
        AccuracyGateFailed: from ``write_graph``, a quantised scorer that moved scores past its tolerance (nothing
            written).
    """
    _check_export(detector, fmt, triton_device, quantised=write_graph is not None)
    output, source = Path(output), Path(source)
    name = name or source.stem
    source_sha256 = source_sha256 or file_sha256(source)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    staging.chmod(0o755)  # readable by a server running as another user, as model files are
    try:
        graph_dir = staging / name / "1" if fmt == "triton" else staging
        graph_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        quantised = None if write_graph is None else write_graph(graph_dir, staging)
        files = quantised.files if quantised is not None else _float32_graph(detector, graph_dir, fmt, external_data)
        meta_dir = staging / name if fmt == "triton" else staging
        prefix = "1/" if fmt == "triton" else ""
        metadata = export_metadata(
            detector, fmt, source, source_sha256, {prefix + f: file_sha256(graph_dir / f) for f in files}, quantised
        )
        _write_beside(detector, meta_dir, metadata, name, triton_device if fmt == "triton" else None)
        log.info("exported %s as %s in %.1f s", source, fmt, time.perf_counter() - started)
        _replace_dir(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output / name if fmt == "triton" else output


@dataclass(frozen=True)
class _Int8Scorer:
    """What :func:`export_int8_scorer` wrote: the graph of a float32 model's int8 scorer and its threshold, as a
    quantised export's ``write_graph`` says it (:class:`padim.models.deploy.quantise.Quantised`)."""

    files: list[str]
    scorer: Int8Scorer
    precision: str = "int8"

    @property
    def calibration(self) -> Calibration:
        assert self.scorer.calibration is not None, "a usable int8 scorer"
        return self.scorer.calibration

    @property
    def threshold_of(self) -> str:
        return "int8 scorer: the model file's own, its threshold from its out-of-fold int8 scores at fit time"

    def describe(self, float32: Calibration) -> dict:
        return {
            "precision": self.precision,
            "model_scorer": "int8",
            "source": "the model file's int8 scorer (train --int8-scorer)",
            "runtime": "onnxruntime",
            "check": self.scorer.check,
            "quantiser": self.scorer.quantiser,
            "float32_calibration": float32.summary(),
            "promise": f"{self.calibration.count} out-of-fold int8 scores of the training pictures promise "
            f"{self.calibration.promised_false_alarm_rate:.2%} false alarms (at most "
            f"{self.calibration.false_alarm_bound:.2%} with 95% confidence)",
            "verified": "checked against float32 by the fit's gate",
        }


def export_int8_scorer(
    detector: PadimDetector, output: str | Path, source: str | Path, source_sha256: str | None = None
) -> Path:
    """The graph of a float32 model's int8 scorer (its quantised backbone, the model's Gaussians) as an ONNX export
    into ``output``, with the scorer's own threshold (:mod:`padim.models.scoring.reduced`): what ``--runtime auto``
    runs where the CPU computes int8 faster.

    Raises:
        ExportError: the model has no usable int8 scorer.
    """
    scorer = detector.int8_scorer
    if scorer is None or not scorer.usable or GRAPH_KEY not in detector.backbone_weights:
        raise ExportError(f"{source}: no usable int8 scorer (padim info says why); export it as float32")

    def write_graph(graph_dir: Path, staging: Path) -> _Int8Scorer:
        assert scorer is not None
        return _Int8Scorer([_export_int8_onnx(detector, graph_dir / ONNX_FILE, None).name], scorer)

    return export_detector(detector, output, "onnx", source, source_sha256, write_graph=write_graph)


def _write_beside(detector: PadimDetector, folder: Path, metadata: dict, name: str, triton: str | None) -> None:
    """``padim.json`` beside the graph, and for Triton (``triton``: where it runs the model) ``config.pbtxt``."""
    if triton is not None:
        tiles = detector.config.tile_count
        shape, batch = detector.config.input_shape, max(1, TRITON_MAX_BATCH // tiles)
        (folder / "config.pbtxt").write_text(triton_config(name, shape, batch, device=triton, tiles=tiles))
    (folder / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")


def _check_export(detector: PadimDetector, fmt: str, triton_device: str, quantised: bool) -> None:
    """Refuse an unknown format or Triton device, a float32 graph of a reduced-precision model (its threshold is
    that precision's), or a runtime package that is not installed; before anything is written."""
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if triton_device not in TRITON_DEVICES:
        raise ExportError(f"unknown Triton device {triton_device!r}; choose one of {', '.join(TRITON_DEVICES)}")
    precision = detector.config.features.precision
    if not quantised and precision == "int8":  # its own int8 graph, which ONNX Runtime runs on a CPU
        if fmt == "openvino":
            raise ExportError(
                "this model scores with its int8 backbone in ONNX Runtime, and its threshold is those scores': export "
                "it with --format onnx (or triton --triton-device cpu), or --format openvino --precision int8 "
                "--calibration-images DIR for an OpenVINO graph checked against float32 with a threshold of its own"
            )
        if fmt == "triton" and triton_device == "gpu":
            raise ExportError("an int8 model's graph runs on ONNX Runtime's CPU provider: use --triton-device cpu")
    elif not quantised and precision != "fp32":
        raise ExportError(
            f"this model scores at {precision} and its threshold is {precision}'s: a float32 graph needs its own. "
            "Export it with --precision int8 or fp16 and --calibration-images (checked against float32 and given "
            "a threshold of its own), or score it with padim serve / predict"
        )
    if fmt == "openvino":
        require("openvino")
    require("onnx")
    require("onnxscript")


def _float32_graph(detector: PadimDetector, graph_dir: Path, fmt: str, external_data: bool | None) -> list[str]:
    """The model's own graph written into ``graph_dir`` (ONNX, converted for OpenVINO): float32, or the int8
    backbone of a model fitted at int8; the names of its files."""
    if detector.config.features.precision == "int8":
        onnx_path = _export_int8_onnx(detector, graph_dir / ONNX_FILE, external_data)
    else:
        onnx_path = _export_onnx(detector, graph_dir / ONNX_FILE, external_data)
    files = [onnx_path.name] + ([f"{onnx_path.name}.data"] if (graph_dir / f"{onnx_path.name}.data").exists() else [])
    if fmt == "openvino":
        files = _convert_openvino(onnx_path, graph_dir / OPENVINO_FILE)
        for leftover in (onnx_path, Path(f"{onnx_path}.data")):
            leftover.unlink(missing_ok=True)
    return files


def _export_onnx(
    detector: PadimDetector, path: Path, external_data: bool | None, backbone_dtype: torch.dtype = torch.float32
) -> Path:
    # an optional extra ([onnx]), as the exporter: imported only when asked for
    import onnx

    scorer = ExportedScorer(detector, backbone_dtype).eval().to("cpu")
    weight_bytes = sum(t.numel() * t.element_size() for t in (*scorer.parameters(), *scorer.buffers()))
    external = weight_bytes > EXTERNAL_DATA_BYTES if external_data is None else external_data
    height, width = detector.config.input_shape
    export_module(
        scorer, (torch.zeros(2, 3, height, width),), [INPUT_NAME], OUTPUT_NAMES, path, external, guard=TRACING.shared()
    )
    model = onnx.load(str(path))  # its external data too, read before the file is written again
    if _kept_channels_only(model):
        Path(f"{path}.data").unlink(missing_ok=True)  # onnx appends to an external-data file that exists
        onnx.save(model, str(path), save_as_external_data=external, location=f"{path.name}.data")
    return path


class _Tiles(nn.Module):
    """What a picture becomes before the backbone: ``(B, 3, H_in, W_in)`` -> ``(B * T, 3, S, S)``."""

    def __init__(self, scorer: ExportedScorer) -> None:
        super().__init__()
        self.tiling, self.standardise = scorer.tiling, scorer.standardise

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.tiling.cut(standardised(images, self.standardise))


class _AfterBackbone(nn.Module):
    """Everything after the backbone: its maps -> the scorer's outputs (:meth:`ExportedScorer.statistics`)."""

    def __init__(self, scorer: ExportedScorer) -> None:
        super().__init__()
        self.scorer = scorer

    def forward(self, *maps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.scorer.statistics(list(maps), maps[0].shape[0] // self.scorer.tiling.count)


def _export_int8_onnx(detector: PadimDetector, path: Path, external_data: bool | None) -> Path:
    """The whole scorer of a model fitted at int8 as one ONNX graph: its own quantised backbone (the model file's,
    the very graph its threshold was computed with) between the graphs before it (tiles, light) and after it (the
    statistics, the map, the score), joined by :func:`onnx.compose.merge_models`."""
    # an optional extra ([onnx]): imported only when asked for
    import onnx
    from onnx import compose

    scorer = ExportedScorer(detector).eval().to("cpu")
    layers = list(scorer.layers)
    height, width = detector.config.input_shape
    images = torch.zeros(2, 3, height, width)
    with torch.no_grad():
        tiles = _Tiles(scorer)(images)
        features = scorer.extractor(tiles)
    maps = tuple(features[layer] for layer in layers)
    scorer.extractor = nn.Identity()  # the float backbone stays out of the graph
    weight_bytes = sum(t.numel() * t.element_size() for t in scorer.buffers())
    external = weight_bytes > EXTERNAL_DATA_BYTES if external_data is None else external_data
    with tempfile.TemporaryDirectory(prefix="padim-int8-export-") as folder:
        after = onnx.load(
            export_module(
                _AfterBackbone(scorer),
                maps,
                layers,
                OUTPUT_NAMES,
                Path(folder) / "after.onnx",
                varargs=True,
                guard=TRACING.shared(),
            )
        )
        backbone = onnx.load_from_string(detector.backbone_weights[GRAPH_KEY].numpy().tobytes())
        space_to_depth_stem(backbone)  # the same integers as the fit's, faster (the fit's extractor runs it so too)
        parts = [compose.add_prefix(backbone, "int8/"), compose.add_prefix(after, "after/")]
        entry = f"int8/{QUANTISED_INPUT}"
        if scorer.tiling.count > 1 or scorer.standardise != "none":
            before = onnx.load(
                export_module(
                    _Tiles(scorer), (images,), [INPUT_NAME], ["tiles"], Path(folder) / "t.onnx", guard=TRACING.shared()
                )
            )
            parts.insert(0, compose.add_prefix(before, "before/"))
        for part in parts:
            part.ir_version = max(p.ir_version for p in parts)
        if len(parts) == 3:
            parts[:2] = [compose.merge_models(parts[0], parts[1], io_map=[("before/tiles", entry)])]
            entry = f"before/{INPUT_NAME}"
        merged = compose.merge_models(
            parts[0], parts[1], io_map=[(f"int8/{layer}", f"after/{layer}") for layer in layers]
        )
    _rename(merged, entry, INPUT_NAME)
    for name in OUTPUT_NAMES:
        _rename(merged, f"after/{name}", name)
    _kept_channels_only(merged)
    onnx.save(merged, str(path), save_as_external_data=external)
    return path


class _GraphIndex:
    """Who makes and who reads each value of an ONNX graph, and the ways back from a map to the convolution that
    makes its channels (:func:`_kept_channels_only`)."""

    def __init__(self, graph) -> None:
        # an optional extra ([onnx]): imported only when a graph is exported
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.initial = {t.name: t for t in graph.initializer}
        self.producer = {name: node for node in graph.node for name in node.output}
        self.readers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.outputs = {value.name for value in graph.output}

    def alone(self, name: str, reader) -> bool:
        """Whether ``reader`` alone reads ``name``, which is not an output of the graph."""
        return name not in self.outputs and [id(n) for n in self.readers.get(name, [])] == [id(reader)]

    def scalar(self, name: str) -> bool:
        return name in self.initial and self.numpy_helper.to_array(self.initial[name]).size == 1

    def attribute(self, node, name: str, default: Any) -> Any:
        return next((self.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)

    def cut(self, name: str, reader) -> list | None:
        """The initializers to cut along their first axis for the constant ``name`` (a convolution's weights or
        bias, or their ``DequantizeLinear``) read by ``reader`` alone; ``None`` where it cannot be cut so."""
        if name in self.initial and self.alone(name, reader):
            return [self.initial[name]]
        node = self.producer.get(name)
        if node is None or node.op_type != "DequantizeLinear" or not self.alone(name, reader):
            return None
        if any(n not in self.initial for n in node.input if n):
            return None
        per_channel = [self.initial[n] for n in node.input[1:] if n and not self.scalar(n)]
        if per_channel and self.attribute(node, "axis", 1) != 0 and len(self.initial[node.input[0]].dims) != 1:
            return None
        tensors = [self.initial[node.input[0]], *per_channel]
        return tensors if all(self.alone(t.name, node) for t in tensors) else None  # a shared scale stays as it is

    def trace(self, name: str, reader) -> tuple[list, list, list] | None:
        """From the map ``name`` back to the convolution that makes its channels: the nodes on the way, the
        ``(Add, operand)`` pairs to gather, and the initializers to cut; ``None`` where the way is not clear."""
        node = self.producer.get(name)
        if node is None or not self.alone(name, reader):
            return None
        if node.op_type in ("Relu", "Cast") or (
            node.op_type in ("QuantizeLinear", "DequantizeLinear") and all(self.scalar(n) for n in node.input[1:] if n)
        ):
            found = self.trace(node.input[0], node)
            return None if found is None else ([node, *found[0]], found[1], found[2])
        if node.op_type == "Add" and len(node.input) == 2:
            for side in (0, 1):
                found = self.trace(node.input[side], node)
                if found is not None:
                    return [node, *found[0]], [(node, 1 - side), *found[1]], found[2]
            return None
        if node.op_type == "Conv" and self.attribute(node, "group", 1) == 1:
            edits = [self.cut(n, node) for n in node.input[1:] if n]
            tensors = [t for e in edits if e is not None for t in e]
            if all(e is not None for e in edits):
                constants = [self.producer[n] for n in node.input[1:] if n in self.producer]  # a DequantizeLinear
                return [node, *constants], [], tensors
        return None


def _kept_channels_only(model) -> int:
    """Make the deepest stage's last convolution compute only the channels the embedding keeps, in place.

    The embedding's channel subset is a ``Gather`` along the channels of each stage's map (``index_select``). Where a
    map is read by that ``Gather`` alone, as the deepest stage's is (a shallower one also feeds the next stage), the
    channels it drops need not be computed: the ``Gather``'s indices go back through the operations that keep each
    channel to itself (``Relu``, ``Cast``, ``QuantizeLinear`` / ``DequantizeLinear`` of one scale, an ``Add``, whose
    other operand is gathered instead) to the convolution that makes the channels, whose weights (bias, per-channel
    scales) are cut to those rows; the ``Gather`` goes. Each kept channel is the same sum of the same products as
    before, so the graph's outputs are the same: to the bit on an int8 graph, whose integer sums and per-tensor
    requantising do not depend on the other channels. resnet18 at 224 px keeps 53 of layer3's 256 channels (D = 100),
    so its last convolution does a fifth of its work (docs/performance.md). A graph without such a chain is left as
    it is. Returns the number of ``Gather`` nodes so removed.
    """
    graph = model.graph
    removed = 0
    index = _GraphIndex(graph)
    for gather in [n for n in graph.node if n.op_type == "Gather"]:
        if index.attribute(gather, "axis", 0) != 1 or gather.input[1] not in index.initial:
            continue
        keep = index.numpy_helper.to_array(index.initial[gather.input[1]])
        found = index.trace(gather.input[0], gather) if keep.ndim == 1 else None
        if found is None:
            continue
        chain, gathers, cuts = found
        for tensor in cuts:
            tensor.CopyFrom(index.numpy_helper.from_array(index.numpy_helper.to_array(tensor)[keep], tensor.name))
        for add, side in gathers:
            gathered = f"{add.input[side]}_kept_channels"
            node = index.helper.make_node(
                "Gather", [add.input[side], gather.input[1]], [gathered], name=f"{add.name}_kept_channels", axis=1
            )
            graph.node.insert(list(graph.node).index(add), node)
            add.input[side] = gathered
        changed = {output for node in chain for output in node.output} | {tensor.name for tensor in cuts}
        chain[0].output[0] = gather.output[0]  # the last node of the chain now gives what the Gather gave
        graph.node.remove(gather)
        for value in [v for v in graph.value_info if v.name in changed or v.name == gather.output[0]]:
            graph.value_info.remove(value)  # shapes inference would check against the old ones
        for value in graph.input:  # an initializer an older IR also lists as an input: its new rows
            if value.name in changed and value.type.tensor_type.shape.dim:
                value.type.tensor_type.shape.dim[0].dim_value = len(keep)
        removed += 1
        index = _GraphIndex(graph)  # the graph as this cut left it
    return removed


def _rename(model, old: str, new: str) -> None:
    """Rename the value ``old`` of an ONNX graph to ``new`` everywhere it appears (nodes, inputs, outputs)."""
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        if value.name == old:
            value.name = new


def _convert_openvino(onnx_path: Path, xml_path: Path) -> list[str]:
    import openvino as ov  # an optional extra: imported only when asked for

    model = ov.convert_model(str(onnx_path))
    ov.save_model(model, str(xml_path), compress_to_fp16=False)  # weights exactly as exported
    return [xml_path.name, xml_path.with_suffix(".bin").name]


def export_metadata(
    detector: PadimDetector, fmt: str, source: Path, source_sha256: str, files: dict[str, str], quantised: Any = None
) -> dict:
    """The ``padim.json`` of an export: what a client needs to feed the graph and read its outputs.

    A quantised export (``quantised``, a :class:`padim.models.deploy.quantise.Quantised`) carries the
    quantised scorer's own calibration (its threshold, scores and input distances), ``precision``, and
    ``quantisation``: how, on which images, the accuracy gate's reading and the float32 calibration it replaces.
    """
    calibration = detector.calibration if quantised is None else quantised.calibration
    own_precision = "int8" if detector.config.features.precision == "int8" else "float32"  # the graph's backbone
    metadata = {
        "kind": EXPORT_KIND,
        "export_version": EXPORT_VERSION,
        "format": fmt,
        "padim_version": __version__,
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "model": {"file": source.name, "sha256": source_sha256, "created": detector.provenance.created},
        "files_sha256": files,
        "input": _input_section(detector),
        **_output_sections(detector),
        "precision_dtype": str(detector.precision_dtype).removeprefix("torch."),
        "config": detector.config.stored(detector.embedding.embedding_dim),
        "weights": detector.weights.to_header(),
        "provenance": detector.provenance.to_header(),
        "description": detector.describe(),
        "calibration": calibration.summary(),
        "calibration_scores": list(calibration.scores),
        "calibration_input_distances": list(calibration.input_distances),
        "calibration_taken_scores": list(calibration.taken_scores),
        "calibration_line_scores": list(calibration.line_scores),
        "precision": own_precision if quantised is None else quantised.precision,
        "threshold_of": f"{own_precision} scorer" if quantised is None else quantised.threshold_of,
    }
    if quantised is not None:
        metadata["quantisation"] = quantised.describe(detector.calibration)
    metadata["metadata_sha256"] = metadata_sha256(metadata)
    return metadata


def _input_section(detector: PadimDetector) -> dict:
    """``padim.json``'s ``input``: what the graph takes, and how a picture becomes it."""
    height, width = detector.config.input_shape
    framing = detector.framing.describe()
    return {
        "name": INPUT_NAME,
        "shape": ["batch", 3, height, width],
        "dtype": "float32",
        "layout": "NCHW",
        "channels": "RGB",
        "resize": framing["steps"],
        "framing": {
            "roi": framing["roi"],
            "resize": framing["resize"],
            "pad_fill": list(PAD_FILL),
            "map": "anomaly_map covers the framed square; padim maps it back onto the picture, 0 outside "
            "the region (padim.models.data.framing.Framing.to_picture)",
        },
        "tiles": {
            "rows": detector.config.framing.tiles[0],
            "cols": detector.config.framing.tiles[1],
            "tile_size": detector.config.features.image_size,
            "overlap_pixels": detector.config.tiling.overlap * detector.config.tiling.cell,
            "statistics": detector.config.framing.tile_statistics,
            "where": "inside the graph: send the whole framed picture; its tiles are cut, scored and "
            "stitched into one anomaly_map there",
        },
        "normalisation": "(pixel / 255 - mean) / std, per channel",
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
    }


def _output_sections(detector: PadimDetector) -> dict:
    """``padim.json``'s ``outputs`` and ``verdict``: what the graph gives, and how a verdict is read from it."""
    height, width = detector.config.input_shape
    return {
        "outputs": {
            "anomaly_map": {
                "shape": ["batch", height, width],
                "dtype": "float32",
                "meaning": "Mahalanobis distance per pixel, upsampled and blurred (raw units)",
            },
            "raw_score": {
                "shape": ["batch"],
                "dtype": "float32",
                "meaning": f"image score ({detector.config.scoring.image_score}) of each anomaly_map",
            },
            "input_distance": {
                "shape": ["batch"],
                "dtype": "float32",
                "meaning": "mean squared Mahalanobis distance over every feature pixel of the picture "
                "(input drift: compared with calibration_input_distances)",
            },
        },
        "verdict": {
            "rule": "anomalous when raw_score >= calibration.threshold",
            "score": "1 / (1 + exp(-(raw_score - calibration.threshold) / calibration.scale))",
        },
    }


def metadata_sha256(metadata: dict) -> str:
    """sha256 of ``padim.json``'s canonical JSON without its own digest."""
    rest = {k: v for k, v in metadata.items() if k != "metadata_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode("utf-8")).hexdigest()


def triton_config(
    name: str, size: int | tuple[int, int], max_batch_size: int = TRITON_MAX_BATCH, device: str = "gpu", tiles: int = 1
) -> str:
    """``config.pbtxt`` of the ONNX graph on Triton's onnxruntime backend, with dynamic batching.

    ``device`` ``gpu``: one instance on every GPU Triton sees (``KIND_GPU``; Triton refuses to load
    it without one); ``cpu``: ``KIND_CPU``. ``KIND_AUTO`` is not used: it silently runs on the
    CPU when Triton's GPU backend is missing.

    Triton adds the batch dimension itself (``max_batch_size > 0``), so ``dims`` leave it out;
    ``raw_score`` and ``input_distance`` have no other dimension, which Triton writes as ``dims: [ 1 ]``
    reshaped to ``[ ]``.
    ``size``: the input's side, or ``(height, width)``; ``tiles``: a tiled model's tiles per picture
    (cut inside the graph; ``max_batch_size`` counts pictures, so that the backbone sees at most
    ``max_batch_size * tiles`` tiles a batch).
    """
    height, width = (size, size) if isinstance(size, int) else size
    tiled = (
        f"\n# Tiled: each picture is cut into {tiles} tiles inside the graph; a batch of {max_batch_size} pictures is "
        f"{max_batch_size * tiles} tiles."
        if tiles > 1
        else ""
    )
    return f"""# padim {__version__}: the whole scorer (backbone, Mahalanobis, map, maximum) on onnxruntime.
# Feed RGB images framed to {width}x{height}, normalised as padim.json says (input.resize, .normalisation).{tiled}
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [
  {{
    name: "{INPUT_NAME}"
    data_type: TYPE_FP32
    dims: [ 3, {height}, {width} ]
  }}
]
output [
  {{
    name: "anomaly_map"
    data_type: TYPE_FP32
    dims: [ {height}, {width} ]
  }},
  {{
    name: "raw_score"
    data_type: TYPE_FP32
    dims: [ 1 ]
    reshape: {{ shape: [ ] }}
  }},
  {{
    name: "input_distance"
    data_type: TYPE_FP32
    dims: [ 1 ]
    reshape: {{ shape: [ ] }}
  }}
]
dynamic_batching {{
  max_queue_delay_microseconds: 2000
}}
instance_group [
  {{
    kind: {"KIND_GPU" if device == "gpu" else "KIND_CPU"}
    count: 1
  }}
]
"""


def _replace_dir(staging: Path, output: Path) -> None:
    """Move ``staging`` to ``output``; an existing export there is replaced only once the new one is complete."""
    if output.exists():
        if output.is_dir() and (
            any(output.glob(f"*/{METADATA_FILE}")) or (output / METADATA_FILE).exists() or not any(output.iterdir())
        ):
            old = output.with_name(f".{output.name}.old-{os.getpid()}")
            output.rename(old)
            staging.rename(output)
            shutil.rmtree(old, ignore_errors=True)
            return
        raise ExportError(f"{output} exists and is not a padim export; choose another --output")
    staging.rename(output)


# ---------------------------------------------------------------------- reading
def read_export(directory: str | Path) -> dict:
    """``padim.json`` of an export directory, with every file's digest checked.

    Raises:
        ArtifactError: not an export, a newer export version, or a file that does not match its digest.
    """
    directory = Path(directory)
    path = directory / METADATA_FILE
    if not path.is_file():
        raise ArtifactError(f"{directory}: not a padim export (no {METADATA_FILE}); make one with `padim export`")
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ArtifactError(f"{path}: unreadable ({error})") from None
    if not isinstance(metadata, dict) or metadata.get("kind") != EXPORT_KIND:
        raise ArtifactError(f"{path}: not a padim export description")
    if int(metadata.get("export_version", 0)) > EXPORT_VERSION:
        raise ArtifactError(
            f"{path}: export version {metadata['export_version']} is newer than this padim "
            f"({__version__}) reads; upgrade padim"
        )
    if metadata.get("metadata_sha256") != metadata_sha256(metadata):
        raise ArtifactError(f"{path}: its contents do not match its digest (edited or damaged); export again")
    for name, digest in metadata["files_sha256"].items():
        file = directory / name
        if not file.is_file():
            raise ArtifactError(f"{directory}: {name} is missing; export again")
        if file_sha256(file) != digest:
            raise ArtifactError(f"{directory}: {name} does not match its sha256 (damaged or replaced); export again")
    return metadata


def require(package: str):
    """Import an optional runtime package, or stop with the line that says how to install it."""
    extra = {"onnxruntime": "onnxruntime", "openvino": "openvino", "onnx": "onnx", "onnxscript": "onnx"}[package]
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ExportError(f"{package} is not installed; install it with: {install_extra(extra)}") from None
