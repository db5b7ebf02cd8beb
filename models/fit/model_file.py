"""The model file of a detector or a partial fit: its tensors, its header, and older formats.

A file (:mod:`padim.core.artifact`: safetensors, digests, atomic writes) holds (``P``: pixels of the statistics,
``T x`` the grid with a Gaussian per tile position; ``T = D (D + 1) / 2`` entries of a packed triangle):

- ``mean`` ``(P, D)`` float32 and ``precision_factor`` ``(P, T)`` (float16 or float32, the packed lower-triangular
  ``W``): detectors.
- ``calibration.scores``, ``calibration.input_distances``, ``calibration.taken_scores`` ``(N,)`` float64: the
  normal pictures' out-of-fold (or held-out) scores, input distances and, with ``expect``, their own scores where
  ``scores`` are their changed copies'; ``calibration.digests`` ``(N,)`` int64 and ``calibration.linked``
  ``(N, 3)`` float64 tie each to its picture's content digest (unsorted; NaN: none); ``calibration.line_scores``
  ``(L,)`` float64: the line's normal pictures' scores where the threshold is theirs (format 13, method ``line``).
- ``statistics.count``, ``statistics.mean``, ``statistics.comoment`` (``()``, ``(P, D)``, ``(P, T)``): the float64
  statistics, packed as in memory (resume, merge; not in ``--slim`` files; ``count`` counts tiles when they
  share the statistics).
- ``image_digests`` ``(N,)`` int64: content digests of the fitted pictures.
- ``embedding.channel_index`` ``(D,)`` or ``embedding.projection`` ``(C, D)``: the channel reduction.
- ``backbone.*``: the backbone weights used; at ``precision`` int8 also ``backbone.int8.onnx``, the quantised backbone
  (ONNX bytes, uint8: :mod:`padim.models.features.quantised`), format 15; a float32 model's with a usable int8
  scorer holds that scorer's graph there (format 20).
- ``int8_scorer.scores``, ``int8_scorer.input_distances``, ``int8_scorer.taken_scores`` ``(N,)`` float64: a float32
  model's int8 scorer's out-of-fold values, as ``calibration.*`` holds the model's (format 20,
  :mod:`padim.models.scoring.reduced`; its gate and threshold in the header's ``int8_scorer``).

The header holds ``kind`` (``padim-detector`` or ``padim-partial``), ``config`` (flat: every option,
:meth:`~padim.models.config.PadimConfig.stored`), ``backbone`` (its family and the stages read, each with its
channels and stride: format 17; checked against this padim's table on reading), ``weights``, ``embedding_dim``,
``grid``, ``precision_dtype``, ``calibration``, ``int8_scorer`` (format 20: its gate, its quantiser, its
calibration's summary, or ``null`` where none was made), ``has_statistics`` and the
:class:`~padim.models.scoring.detector.Provenance` fields.

Every earlier format is read (docs/file-format.md has a table of what each added): a file is read with the
options it was fitted with, and those it predates take the value they computed then (each option's ``before``,
:mod:`padim.models.options`), whatever today's defaults, so that it keeps scoring as it did.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torchvision

from padim.core import __version__
from padim.core.artifact import (
    FORMAT_VERSION,
    ArtifactError,
    TensorStream,
    copy_artifact,
    load_artifact,
    read_header,
    save_artifact,
    tensor_sizes,
)
from padim.core.calibration import Calibration
from padim.core.packing import pack_lower, packed_length, unpack_lower
from padim.core.statistics import GaussianState
from padim.models.config import RETIRED, PadimConfig
from padim.models.devices import check_precision, precision_device
from padim.models.features.backbones import WeightsInfo
from padim.models.features.embedding import Embedding, FeatureEmbedder
from padim.models.features.quantised import GRAPH_KEY
from padim.models.fit.in_progress import Fit
from padim.models.fit.passes import Finished
from padim.models.scoring.detector import PadimDetector, Provenance
from padim.models.scoring.model import PadimModel
from padim.models.scoring.reduced import KEY as INT8_KEY
from padim.models.scoring.reduced import Int8Scorer

log = logging.getLogger(__name__)

DETECTOR, PARTIAL = "padim-detector", "padim-partial"
#: Tensor-name prefixes of the streamed statistics: this format's, and format 1's.
STATISTICS_PREFIXES = ("statistics.", "accumulator.")
#: Rows of precision factors converted and written at a time.
FACTOR_CHUNK_BYTES = 32 * 2**20


# ---------------------------------------------------------------------- detectors
def save_detector(
    detector: PadimDetector, path: str | Path, with_statistics: bool = True, precision_dtype: torch.dtype | None = None
) -> None:
    """Write a detector held in memory to a model file, atomically.

    Args:
        with_statistics: keep the streamed statistics (needed by ``--resume`` and ``merge``).
        precision_dtype: storage dtype of the precision factors; default: the detector's.
    """
    dtype = precision_dtype or detector.precision_dtype
    with_statistics = with_statistics and detector.statistics is not None
    model = detector.model
    factor = model.precision_factor
    packed = TensorStream(
        dtype,
        (factor.shape[0], packed_length(factor.shape[-1])),
        lambda: (pack_lower(factor[p : p + 256]).to(dtype) for p in range(0, factor.shape[0], 256)),
    )
    _write(
        path,
        detector.config,
        detector.weights,
        detector.backbone_weights,
        detector.embedding,
        model.grid_shape,
        model.mean,
        packed,
        detector.calibration,
        detector.provenance,
        detector.image_digests,
        detector.statistics if with_statistics else None,
        detector.int8_scorer,
    )


def save_fitted(
    path: str | Path,
    fit: Fit,
    finished: Finished,
    calibration: Calibration,
    provenance: Provenance,
    with_statistics: bool = True,
    int8_scorer: Int8Scorer | None = None,
) -> None:
    """Write a finished fit's model file, atomically: its factors streamed from their scratch file.

    The factors are read a chunk of pixels at a time and converted to their storage dtype on
    the way, so that neither a second copy of them nor the float32 and float16 forms at once
    are ever in memory beside the statistics.
    """
    dtype, factors = finished.precision_dtype, finished.factors
    if factors is None:
        raise ValueError("a partial fit has no factors to write: it is saved with save_fit")
    pixels, length = finished.mean.shape[0], packed_length(finished.mean.shape[1])
    rows = max(1, FACTOR_CHUNK_BYTES // (4 * length))

    def chunks():
        for first in range(0, pixels, rows):
            count = min(rows, pixels - first)
            yield factors.read(first * length * 4, (count, length), torch.float32).to(dtype)

    _write(
        path,
        fit.config,
        fit.weights,
        fit.backbone_weights,
        fit.embedding,
        fit.embedder.grid_shape,
        finished.mean,
        TensorStream(dtype, (pixels, length), chunks),
        calibration,
        provenance,
        fit.image_digests,
        fit.statistics if with_statistics else None,
        int8_scorer,
    )


def store_calibration(
    path: str | Path, calibration: Calibration, target: str | Path | None = None, scorer: str = "float32"
) -> None:
    """Store another threshold in a model file (``evaluate --calibrate``, a line's threshold), atomically, into
    ``path`` itself or into ``target``.

    ``scorer`` says whose scores set it: ``float32`` (the model's own; an int8 scorer is then left out of the file,
    its threshold having been the same promise as the one replaced, on its own scores), or ``int8`` (the model's int8
    scorer's, :mod:`padim.models.scoring.reduced`; the float32 threshold stays the fit's). A file of this format
    keeps its tensors, streamed from the old file to the new; an older one is read whole and written again in this
    format.

    Raises:
        ValueError: ``int8`` for a file without a usable int8 scorer.
    """
    target = path if target is None else target
    header = read_header(path)
    stored = header.get(INT8_KEY)
    if scorer == "int8":
        if stored is None or stored.get("calibration") is None:
            raise ValueError(f"{path} has no usable int8 scorer to set the threshold of")
        header[INT8_KEY] = {**stored, "calibration": calibration.summary()}
        values = {name: None for name in tensor_sizes(path) if name.startswith(f"{INT8_KEY}.")}
        copy_artifact(path, target, header, {**values, **_values_tensors(INT8_KEY, calibration)})
        return
    if header["format_version"] >= FORMAT_VERSION:
        header["calibration"] = calibration_header(calibration)
        left_out: dict[str, torch.Tensor | None] = {}
        if stored is not None:
            header[INT8_KEY] = None
            left_out = {name: None for name in tensor_sizes(path) if name.startswith(f"{INT8_KEY}.")}
            if header["config"].get("precision", "fp32") != "int8":
                left_out[f"backbone.{GRAPH_KEY}"] = None
        copy_artifact(path, target, header, {LINE: line_tensors(calibration).get(LINE), **left_out})
        return
    detector = load_detector(path, "cpu", with_statistics=True)
    detector.calibration = calibration
    save_detector(detector, target, with_statistics=detector.statistics is not None)


def _write(
    path,
    config: PadimConfig,
    weights: WeightsInfo,
    backbone_weights,
    embedding: Embedding,
    grid,
    mean,
    factors: TensorStream,
    calibration: Calibration,
    provenance: Provenance,
    image_digests,
    statistics: GaussianState | None,
    int8_scorer: Int8Scorer | None = None,
) -> None:
    if config.features.precision != "int8" and (int8_scorer is None or not int8_scorer.usable):
        backbone_weights = {k: v for k, v in backbone_weights.items() if k != GRAPH_KEY}  # only a usable scorer's
    kept = int8_scorer.calibration if int8_scorer is not None else None
    tensors = {
        "mean": mean.to(torch.float32),
        "precision_factor": factors,
        "calibration.scores": torch.tensor(calibration.scores, dtype=torch.float64),
        **(
            {"calibration.input_distances": torch.tensor(calibration.input_distances, dtype=torch.float64)}
            if calibration.input_distances
            else {}
        ),
        **(
            {"calibration.taken_scores": torch.tensor(calibration.taken_scores, dtype=torch.float64)}
            if calibration.taken_scores
            else {}
        ),
        **{f"calibration.{k}": v for k, v in calibration.picture_tensors().items()},
        **line_tensors(calibration),
        **(_values_tensors(INT8_KEY, kept) if kept is not None else {}),
        **_common_tensors(embedding, backbone_weights, image_digests),
        **(_statistics_tensors(statistics) if statistics is not None else {}),
    }
    header = {
        "kind": DETECTOR,
        **_common_header(config, weights, embedding, grid),
        "precision_dtype": str(factors.dtype).removeprefix("torch."),
        "calibration": calibration_header(calibration),
        INT8_KEY: None if int8_scorer is None else int8_scorer.to_header(),
        "has_statistics": statistics is not None,
        **provenance.to_header(),
    }
    save_artifact(path, tensors, header)


def _values_tensors(prefix: str, calibration: Calibration) -> dict[str, torch.Tensor]:
    """A reduced scorer's calibration values: its scores, and its input distances, own scores, line's scores and
    links to its pictures where it has them."""
    values = {
        "scores": calibration.scores,
        "input_distances": calibration.input_distances,
        "taken_scores": calibration.taken_scores,
        "line_scores": calibration.line_scores,
    }
    return {
        **{f"{prefix}.{k}": torch.tensor(v, dtype=torch.float64) for k, v in values.items() if v or k == "scores"},
        **{f"{prefix}.{k}": v for k, v in calibration.picture_tensors().items()},
    }


def _read_int8_scorer(header: dict, tensors: dict[str, torch.Tensor]) -> Int8Scorer | None:
    """A float32 model's int8 scorer as its file keeps it (format 20; ``None`` in older files and where none was
    made)."""
    stored = header.get(INT8_KEY)
    if stored is None:
        return None
    calibration = None
    if stored["calibration"] is not None:
        calibration = Calibration.from_header(
            stored["calibration"],
            tensors[f"{INT8_KEY}.scores"],
            tensors.get(f"{INT8_KEY}.input_distances"),
            tensors.get(f"{INT8_KEY}.taken_scores"),
            tensors.get(f"{INT8_KEY}.digests"),
            tensors.get(f"{INT8_KEY}.linked"),
            tensors.get(f"{INT8_KEY}.line_scores"),
        )
    return Int8Scorer(dict(stored["check"]), dict(stored["quantiser"]), calibration)


LINE = "calibration.line_scores"


def line_tensors(calibration: Calibration) -> dict[str, torch.Tensor]:
    """``calibration.line_scores`` where the threshold is the line's (method ``line``), else nothing."""
    if not calibration.line_scores:
        return {}
    return {LINE: torch.tensor(calibration.line_scores, dtype=torch.float64)}


def calibration_header(calibration: Calibration) -> dict:
    """The header's calibration: its summary, and how many pictures' values ``calibration.digests`` links."""
    return {**calibration.summary(), "pictures": len(calibration.pictures)}


def served_bytes(path: str | Path) -> int:
    """Bytes of the tensors a served detector reads from its file: all but the statistics (which a model
    file keeps to be extended, and which are most of a wide_resnet50_2 file).

    Raises:
        ArtifactError: not a readable model file.
    """
    return sum(size for name, size in tensor_sizes(path).items() if not name.startswith(STATISTICS_PREFIXES))


def read_calibration(path: str | Path) -> Calibration:
    """A detector file's calibration alone (its tensors verified; the Gaussians and the backbone not read).

    Raises:
        ArtifactError: missing, damaged, partial, foreign or newer-format file (one line).
    """
    tensors, header = _calibration_tensors(path)
    try:
        return _read_calibration(header, tensors)
    except (KeyError, ValueError) as error:
        raise ArtifactError(f"{path}: inconsistent calibration ({error})") from None


def read_int8_calibration(path: str | Path) -> Calibration | None:
    """:func:`read_calibration` of the file's int8 scorer (:mod:`padim.models.scoring.reduced`); ``None`` where it has
    no usable one."""
    tensors, header = _calibration_tensors(path)
    try:
        int8 = _read_int8_scorer(header, tensors)
    except (KeyError, ValueError) as error:
        raise ArtifactError(f"{path}: inconsistent int8 scorer ({error})") from None
    return None if int8 is None else int8.calibration


def _calibration_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A detector file's tensors but its Gaussians, backbone and statistics, and its header."""
    tensors, header = load_artifact(path, skip_prefixes=("mean", "precision_factor", "backbone.", "statistics."))
    if header.get("kind") != DETECTOR:
        raise ArtifactError(f"{path}: a padim file, but not a detector (kind={header.get('kind')!r})")
    return tensors, header


def load_detector(path: str | Path, device: str = "auto", with_statistics: bool = False) -> PadimDetector:
    """Read a detector's model file, verified (digests) and checked (finite statistics).

    Args:
        with_statistics: also read the streamed statistics (to save the model again with them).

    Raises:
        ArtifactError: missing, damaged, partial, foreign or newer-format file (one line).
    """
    tensors, header = load_artifact(path, skip_prefixes=() if with_statistics else STATISTICS_PREFIXES)
    kind = header.get("kind")
    if kind == PARTIAL:
        raise ArtifactError(f"{path}: a partial fit (train --partial); combine the parts with `padim merge` first")
    if kind != DETECTOR:
        raise ArtifactError(f"{path}: a padim file, but not a detector (kind={kind!r})")
    config, embedding, backbone_weights, weights = _read_common(path, tensors, header)
    for name in ("mean", "precision_factor"):  # checked as stored: packed, and float16 where so saved
        if name in tensors and not bool(torch.isfinite(tensors[name]).all()):
            raise ArtifactError(f"{path}: tensor {name!r} holds NaN or infinite values; this model cannot score")
    try:
        factor = unpack_lower(tensors["precision_factor"], embedding.embedding_dim)  # float16 stays float16
        mean = tensors["mean"]
        calibration = _read_calibration(header, tensors)
        statistics = _read_statistics(tensors, header, embedding.embedding_dim) if with_statistics else None
        int8_scorer = _read_int8_scorer(header, tensors)
        if int8_scorer is not None and int8_scorer.usable and GRAPH_KEY not in backbone_weights:
            raise ValueError(f"an int8 scorer but no backbone.{GRAPH_KEY} (its quantised backbone)")
    except (KeyError, TypeError, ValueError) as error:
        raise _inconsistent(path, error) from None
    provenance = _read_provenance(path, header)
    model = PadimModel(
        FeatureEmbedder(config, backbone_weights, embedding),
        mean,
        factor,
        config.scoring,
    )
    precision_dtype = getattr(torch, header.get("precision_dtype", "float32"))
    target = precision_device(device, config.features.precision)
    check_precision(config.features.precision, target)
    model = model.to(target)
    if model.device.type == "cuda":  # float16 factors: upcast once here, not on every batch
        model.upcast_factors()
    return PadimDetector(
        config,
        weights,
        backbone_weights,
        model,
        calibration,
        provenance,
        statistics,
        tensors.get("image_digests"),
        precision_dtype,
        int8_scorer,
    )


# ---------------------------------------------------------------------- fits
def save_fit(fit: Fit, path: str | Path) -> None:
    """Write a fit's statistics alone (``train --partial``), to be combined by ``padim merge``."""
    assert fit.statistics is not None, "a partial fit keeps its statistics"
    tensors = {
        **_common_tensors(fit.embedding, fit.backbone_weights, fit.image_digests),
        **_statistics_tensors(fit.statistics),
    }
    header = {
        "kind": PARTIAL,
        **_common_header(fit.config, fit.weights, fit.embedding, fit.embedder.grid_shape),
        "has_statistics": True,
        **fit.provenance.to_header(),
    }
    save_artifact(path, tensors, header)


def load_fit(path: str | Path, run_options: PadimConfig | None = None) -> Fit:
    """A fit from a model file with statistics (a detector, or a ``--partial`` file), to go on with.

    Args:
        run_options: batch size, device and workers to use (the rest comes from the file).

    Raises:
        ArtifactError: unreadable file, or one saved without statistics (``--slim``).
    """
    tensors, header = load_artifact(path, skip_prefixes=("mean", "precision_factor"))
    if header.get("kind") not in (DETECTOR, PARTIAL):
        raise ArtifactError(f"{path}: a padim file, but not a detector (kind={header.get('kind')!r})")
    if not header.get("has_statistics", header.get("has_accumulators")):
        raise ArtifactError(
            f"{path}: saved with --slim, without the statistics that resume and merge need; "
            "train a new model on all the images instead"
        )
    config, embedding, backbone_weights, weights = _read_common(path, tensors, header)
    try:
        statistics = _read_statistics(tensors, header, embedding.embedding_dim)
        earlier = _read_calibration(header, tensors) if header.get("calibration") is not None else None
        int8_scorer = _read_int8_scorer(header, tensors)
    except (KeyError, TypeError, ValueError) as error:
        raise _inconsistent(path, error) from None
    if run_options is not None:
        config = config.with_run_options(run_options)
    fit = Fit(
        config,
        weights,
        backbone_weights,
        embedding,
        statistics,
        tensors.get("image_digests"),
        earlier,
        _read_provenance(path, header),
    )
    fit.earlier_int8 = int8_scorer if int8_scorer is not None and int8_scorer.usable else None  # to go on with
    return fit


# ---------------------------------------------------------------------- shared parts
def _common_tensors(
    embedding: Embedding, backbone_weights: dict[str, torch.Tensor], image_digests: torch.Tensor
) -> dict[str, torch.Tensor]:
    if embedding.channel_index is not None:
        reduction = {"embedding.channel_index": embedding.channel_index}
    else:
        assert embedding.projection is not None, "an embedding selects channels or projects them"
        reduction = {"embedding.projection": embedding.projection}
    return {"image_digests": image_digests, **reduction, **{f"backbone.{k}": v for k, v in backbone_weights.items()}}


def _statistics_tensors(statistics: GaussianState) -> dict[str, torch.Tensor]:
    return {
        "statistics.count": statistics.count,
        "statistics.mean": statistics.mean,
        "statistics.comoment": statistics.comoment,
    }  # packed in memory as in the file


def _common_header(config: PadimConfig, weights: WeightsInfo, embedding: Embedding, grid: tuple[int, int]) -> dict:
    return {
        "padim_version": __version__,
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "config": config.stored(embedding.embedding_dim),
        "backbone": backbone_header(config),
        "weights": weights.to_header(),
        "embedding_dim": embedding.embedding_dim,
        "grid": list(grid),
    }


def backbone_header(config: PadimConfig) -> dict:
    """The header's ``backbone``: the family and the stages read, with their channels and strides (format 17)."""
    return {"family": config.spec.family, "stages": config.spec.described(config.features.stages)}


def _read_common(
    path, tensors: dict[str, torch.Tensor], header: dict
) -> tuple[PadimConfig, Embedding, dict, WeightsInfo]:
    """Configuration, embedding, backbone weights and their origin: what every model file holds."""
    try:
        values = dict(header["config"])
        if not header["verified"]:  # format 1: a held-out share instead of folds
            for key in RETIRED:
                values.pop(key, None)
        config = PadimConfig.from_stored(values, str(path), older=header["format_version"] < FORMAT_VERSION)
        if "backbone" in header and header["backbone"] != backbone_header(config):  # format 16 and older: the table's
            raise ValueError(
                f"its backbone {header['backbone']} is not {config.features.backbone}'s as this padim knows it "
                f"({backbone_header(config)})"
            )
        reduction = (
            {"channel_index": tensors["embedding.channel_index"]}
            if "embedding.channel_index" in tensors
            else {"projection": tensors["embedding.projection"]}
        )
        embedding = Embedding.for_layers(
            config.spec, config.features.stages, neighbourhood=config.gaussian.neighbourhood, **reduction
        )
        if embedding.embedding_dim != int(header["embedding_dim"]):
            raise ValueError(f"embedding_dim {header['embedding_dim']} but {embedding.embedding_dim} channels stored")
        backbone_weights = {k.removeprefix("backbone."): v for k, v in tensors.items() if k.startswith("backbone.")}
        if config.features.precision == "int8" and GRAPH_KEY not in backbone_weights:
            raise ValueError(f"precision int8 but no backbone.{GRAPH_KEY} (the quantised backbone)")
        weights = WeightsInfo(**header["weights"])
    except (KeyError, TypeError, ValueError) as error:
        raise _inconsistent(path, error) from None
    return config, embedding, backbone_weights, weights


def _read_statistics(tensors: dict[str, torch.Tensor], header: dict, embedding_dim: int) -> GaussianState | None:
    prefix = "statistics." if header["verified"] else "accumulator."
    if f"{prefix}count" not in tensors:
        return None
    comoment = tensors[f"{prefix}comoment"]
    if comoment.shape[-1] != packed_length(embedding_dim):
        raise ValueError(f"the comoment holds {comoment.shape[-1]} entries a pixel, not {packed_length(embedding_dim)}")
    return GaussianState(tensors[f"{prefix}count"], tensors[f"{prefix}mean"], comoment)


def _read_calibration(header: dict, tensors: dict[str, torch.Tensor]) -> Calibration:
    if header["verified"]:
        return Calibration.from_header(
            header["calibration"],
            tensors["calibration.scores"],
            tensors.get("calibration.input_distances"),
            tensors.get("calibration.taken_scores"),
            tensors.get("calibration.digests"),
            tensors.get("calibration.linked"),
            tensors.get(LINE),
        )
    old = header["calibration"]  # format 1: a quantile of a few held-out scores, kept as it was
    scores = tensors["calibration.normal_scores"].to(torch.float64).sort().values
    return Calibration(
        tuple(scores.tolist()),
        float(old["threshold"]),
        float(old["scale"]),
        "manual" if old.get("quantile") is None else "quantile",
        None,
    )


def _read_provenance(path, header: dict) -> Provenance:
    provenance = Provenance.from_header(header)
    provenance.verified = header["verified"]
    if not provenance.verified:
        log.warning(
            "%s: model format %s has no digests, so its integrity is not verified, and its threshold "
            "comes from a few held-out images; train it again for an honest threshold",
            path,
            header["format_version"],
        )
        provenance.calibration_source = "held_out"
    return provenance


def _inconsistent(path, error: Exception) -> ArtifactError:
    return ArtifactError(f"{path}: incomplete or inconsistent model file ({type(error).__name__}: {error})")
