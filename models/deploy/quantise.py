"""Quantised scorers: an INT8 or FP16 backbone, checked against float32 and given a threshold of its own.

Only the backbone is quantised; the embedding, the Mahalanobis distance (float16 factors where
``train`` chose them, cast to float32 in the graph), the map and the image score stay as in the
float32 graph. Three precisions (:data:`padim.models.choices.EXPORT_PRECISIONS`):

- ``int8`` for ONNX Runtime: static quantisation in the QDQ format (``onnxruntime.quantization``),
  per-channel int8 weights, uint8 activations, ``reduce_range`` (7-bit weights: what ONNX Runtime
  advises for CPUs with AVX2 or AVX-512 but no VNNI, whose u8 x s8 products otherwise saturate),
  MinMax ranges, on the backbone's convolutions and the ReLUs after them (each convolution's output quantised
  once, over the range its ReLU leaves: :data:`padim.models.features.quantised.QUANTISED_OPERATIONS`).
- ``int8`` for OpenVINO: NNCF post-training quantisation of the OpenVINO model, its convolutions only
  (NNCF would otherwise also quantise the embedding's pooling and the Mahalanobis step).
- ``fp16``: the backbone's weights and activations in float16 inside the graph (input float32,
  features cast back to float32 for the statistics), for ONNX Runtime's CUDA and TensorRT
  providers and Triton. Unverified on a GPU so far (docs/quantisation.md).
- ``bf16`` for OpenVINO on a CPU with bfloat16 (AVX512-BF16, AMX): the float32 IR, compiled with OpenVINO's
  ``bf16`` inference precision (which runs what OpenVINO chooses in bfloat16: the convolutions and most else).
  The file is the float32 graph; ``padim.json`` asks for bf16. It is made, gated and given its threshold only
  where OpenVINO does run bf16 (:func:`openvino_runs`): elsewhere OpenVINO silently runs float32, and a gate
  there would measure nothing.

The calibration folder (``--calibration-images``, normal images only, never the test set) is split
once, by a seeded permutation of its sorted file names (:func:`split_calibration`): the first
``quantiser_images`` calibrate the quantiser's ranges (int8 only), the rest give the quantised
scorer's threshold and are the held-out normals of the accuracy gate. The threshold is
:meth:`padim.core.calibration.Calibration.from_scores` of the quantised scorer's scores of those
images, for the model's false-alarm rate: the same promise and bound ``train`` reports (about 99
images to promise 1%, 1,000 for the empirical quantile).

The gate (:func:`compare`) scores the held-out normals (and ``--check-images``, defects, when
given) with the float32 and the quantised graph on the same runtime. It refuses the export when
the largest relative difference of raw scores passes ``max_score_error``
(:data:`MAX_SCORE_ERROR`, chosen by measurement: docs/quantisation.md).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from padim.core.calibration import Calibration, images_needed
from padim.models.choices import EXPORT_PRECISIONS, install_extra
from padim.models.data.changes import apply, seeded
from padim.models.data.images import iter_for_model, list_images
from padim.models.deploy.export import (
    ONNX_FILE,
    OPENVINO_FILE,
    _convert_openvino,
    _export_onnx,
    export_detector,
    require,
)
from padim.models.deploy.runtimes import (
    OnnxRuntimeSession,
    OpenVinoSession,
    bfloat16_native,
    openvino_capabilities,
    openvino_runs,
)
from padim.models.errors import AccuracyGateFailed, ExportError, ImageError
from padim.models.features.embedding import model_input_array
from padim.models.features.quantised import HEADROOM, quantise_static

log = logging.getLogger(__name__)

#: Images of the calibration folder that calibrate an INT8 quantiser's ranges (the rest: the threshold).
QUANTISER_IMAGES = 32
#: Fewest images left for the threshold and the gate.
MIN_THRESHOLD_IMAGES = 20
#: The gate: largest relative difference of raw scores on held-out images (measured: docs/quantisation.md).
MAX_SCORE_ERROR = 0.25
#: Images a batch while calibrating and checking.
BATCH = 8
#: Seed of the permutation that splits the calibration folder.
SPLIT_SEED = 0


@dataclass(frozen=True)
class QuantiseOptions:
    """How to quantise (``padim export --precision``).

    Attributes:
        precision: ``int8`` or ``fp16``.
        calibration_images: folder of normal images (never the test set).
        check_images: optional folder of defect images the gate also compares.
        quantiser_images: images of ``calibration_images`` that calibrate the int8 quantiser.
        max_score_error: the gate's tolerance on the largest relative raw-score difference.
        force: write the export even when the gate fails (the report says so).
        false_alarm_rate: the threshold's rate (default: the model's).
    """

    precision: str
    calibration_images: Path
    check_images: Path | None = None
    quantiser_images: int = QUANTISER_IMAGES
    max_score_error: float = MAX_SCORE_ERROR
    force: bool = False
    false_alarm_rate: float | None = None

    def __post_init__(self):
        if self.precision not in EXPORT_PRECISIONS or self.precision == "float32":
            raise ExportError(f"unknown quantised precision {self.precision!r}; choose int8, fp16 or bf16")
        if self.quantiser_images < 1:
            raise ExportError(f"--quantiser-images must be at least 1, got {self.quantiser_images}")
        if not self.max_score_error > 0:
            raise ExportError(f"--max-score-error must be positive, got {self.max_score_error}")


def check_combination(precision: str, fmt: str, triton_device: str) -> None:
    """Refuse a precision where its graph cannot run.

    Raises:
        ExportError: ``fp16`` for OpenVINO (CPU here: use float32 or int8), ``int8`` for Triton on a GPU, ``bf16``
            for anything but OpenVINO.
    """
    if precision == "bf16" and fmt != "openvino":
        raise ExportError(
            "--precision bf16 is OpenVINO's bfloat16 inference on CPUs with AVX512-BF16 or AMX: use --format "
            "openvino; for CUDA use --precision fp16"
        )
    if precision == "fp16" and fmt == "openvino":
        raise ExportError(
            "--precision fp16 is for CUDA (ONNX Runtime, TensorRT, Triton): use --format onnx or triton; "
            "for OpenVINO on a CPU use --precision int8 or float32"
        )
    if precision == "int8" and fmt == "triton" and triton_device == "gpu":
        raise ExportError(
            "--precision int8 graphs run on ONNX Runtime's CPU provider: use --triton-device cpu, or "
            "--precision fp16 for a GPU"
        )


@dataclass(frozen=True)
class CalibrationSplit:
    """The calibration folder, split: ``quantiser`` images calibrate the ranges, ``threshold`` images the threshold."""

    quantiser: tuple[Path, ...]
    threshold: tuple[Path, ...]

    def describe(self, folder: Path) -> dict:
        return {
            "folder": str(folder),
            "quantiser_images": len(self.quantiser),
            "threshold_images": len(self.threshold),
            "split": f"seeded permutation (seed {SPLIT_SEED}) of the sorted file names: the first "
            f"{len(self.quantiser)} calibrate the quantiser, the other {len(self.threshold)} the threshold "
            "and the accuracy gate",
        }


def split_calibration(paths: list[Path], quantiser_images: int, precision: str) -> CalibrationSplit:
    """Split ``paths`` (sorted first) into disjoint quantiser and threshold parts; fp16 and bf16 need no quantiser
    part.

    Raises:
        ExportError: fewer than ``quantiser_images + MIN_THRESHOLD_IMAGES`` images.
    """
    paths = sorted(paths)
    quantiser_images = quantiser_images if precision == "int8" else 0
    needed = quantiser_images + MIN_THRESHOLD_IMAGES
    if len(paths) < needed:
        raise ExportError(
            f"--calibration-images has {len(paths)} image(s); {precision} needs at least {needed}: "
            + (f"{quantiser_images} to calibrate the quantiser (--quantiser-images) and " if quantiser_images else "")
            + f"{MIN_THRESHOLD_IMAGES} more for the threshold (about 99 to promise 1% false alarms, 1,000 for the "
            "empirical quantile)"
        )
    order = np.random.default_rng(SPLIT_SEED).permutation(len(paths))
    shuffled = [paths[i] for i in order]
    return CalibrationSplit(tuple(shuffled[:quantiser_images]), tuple(shuffled[quantiser_images:]))


# ---------------------------------------------------------------------- the gate
def relative_differences(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``(N,)`` ``|other - reference| / |reference|`` of image scores (0 where both are 0)."""
    reference, other = np.asarray(reference, np.float64), np.asarray(other, np.float64)
    return np.abs(other - reference) / np.maximum(np.abs(reference), np.finfo(np.float64).tiny)


def map_differences(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``(N,)`` largest ``|other - reference|`` over each map, relative to the reference map's largest value."""
    reference = np.asarray(reference, np.float64).reshape(len(reference), -1)
    other = np.asarray(other, np.float64).reshape(len(other), -1)
    return np.abs(other - reference).max(1) / np.maximum(np.abs(reference).max(1), np.finfo(np.float64).tiny)


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties); ``nan`` for fewer than 2 values or no spread."""
    from scipy.stats import spearmanr  # scipy loads in about a second: only for an export that needs it

    if len(a) < 2:
        return math.nan
    value = spearmanr(a, b).statistic
    return float(value)


@dataclass(frozen=True)
class Agreement:
    """How far the quantised scorer's answers are from the float32 scorer's on the same images.

    Attributes:
        images: held-out normal images compared (and ``check_images`` defect images).
        rank_correlation: Spearman's of image scores over every compared image.
        max_score_error: largest relative raw-score difference (the gate's statistic).
        median_score_error: its median.
        max_map_error: largest map difference relative to the map's own largest value.
        verdict_changes: images whose verdict at the model's float32 threshold differs between the two.
        verdict_changes_normal / verdict_changes_check: of these, held-out normals and check images.
        tolerance, passed, forced: the gate.
        auroc_float32 / auroc_quantised: normals against check images (``None`` without check images).
    """

    images: int
    check_images: int
    rank_correlation: float
    max_score_error: float
    median_score_error: float
    max_map_error: float
    verdict_changes: int
    verdict_changes_normal: int
    verdict_changes_check: int
    tolerance: float
    passed: bool
    forced: bool = False
    auroc_float32: float | None = None
    auroc_quantised: float | None = None
    threshold: float = field(default=math.nan)

    def to_dict(self) -> dict:
        out = asdict(self)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}

    def sentence(self) -> str:
        verdicts = (
            f"{self.verdict_changes} of {self.images + self.check_images} verdicts changed at the float32 threshold"
        )
        return (
            f"largest relative raw-score difference {self.max_score_error:.2%} (median {self.median_score_error:.2%}; "
            f"tolerance {self.tolerance:.2%}), maps {self.max_map_error:.2%}, rank correlation "
            f"{self.rank_correlation:.4f}, {verdicts}"
        )


@dataclass
class GraphScores:
    """A folder as scored by one graph: ``(N,)`` raw scores and input distances, ``(N, S, S)`` maps."""

    raw_scores: np.ndarray
    maps: np.ndarray
    input_distances: np.ndarray


def compare(
    reference_normal: GraphScores,
    quantised_normal: GraphScores,
    threshold: float,
    tolerance: float,
    reference_check: GraphScores | None = None,
    quantised_check: GraphScores | None = None,
) -> Agreement:
    """The accuracy gate: the quantised scorer's answers against float32's at the model's ``threshold``."""
    from sklearn.metrics import roc_auc_score  # as scipy: only for an export that needs it

    normal_n = len(reference_normal.raw_scores)
    parts = [(reference_normal, quantised_normal)]
    if reference_check:
        assert quantised_check is not None, "both scorers score the check pictures"
        parts.append((reference_check, quantised_check))
    reference = np.concatenate([r.raw_scores for r, _ in parts]).astype(np.float64)
    quantised = np.concatenate([q.raw_scores for _, q in parts]).astype(np.float64)
    maps = np.concatenate([map_differences(r.maps, q.maps) for r, q in parts])
    errors = relative_differences(reference, quantised)
    changed = (reference >= threshold) != (quantised >= threshold)
    check_n = len(reference) - normal_n
    auroc: tuple[float | None, float | None] = (None, None)
    if check_n:
        labels = np.r_[np.zeros(normal_n), np.ones(check_n)]
        auroc = (float(roc_auc_score(labels, reference)), float(roc_auc_score(labels, quantised)))
    worst = float(errors.max())
    return Agreement(
        images=normal_n,
        check_images=check_n,
        rank_correlation=rank_correlation(reference, quantised),
        max_score_error=worst,
        median_score_error=float(np.median(errors)),
        max_map_error=float(maps.max()),
        verdict_changes=int(changed.sum()),
        verdict_changes_normal=int(changed[:normal_n].sum()),
        verdict_changes_check=int(changed[normal_n:].sum()),
        tolerance=tolerance,
        passed=bool(np.isfinite(quantised).all()) and worst <= tolerance,
        auroc_float32=auroc[0],
        auroc_quantised=auroc[1],
        threshold=threshold,
    )


# ---------------------------------------------------------------------- graphs
def widen_openvino_ranges(model, factor: float) -> int:
    """The same for an OpenVINO model's activation ``FakeQuantize`` nodes (their input is not a constant): the
    input and output low and high limits times ``factor``. Returns how many."""
    import openvino as ov  # an optional extra ([openvino]): imported only when asked for

    widened = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "FakeQuantize":
            continue
        source = op.input_value(0).get_node()
        if source.get_type_name() == "Constant" or source.get_type_name() == "Convert":  # a weight's quantiser
            continue
        for port in range(1, 5):
            limit = op.input_value(port).get_node()
            values = np.array(limit.get_data(), dtype=np.float32)  # 0-d for a per-tensor range
            values *= np.float32(factor)
            op.input(port).replace_source_output(ov.op.Constant(values).output(0))
        widened += 1
    return widened


def quantise_openvino(float_graph: Path, output: Path, batches: list[np.ndarray]) -> dict:
    """NNCF post-training quantisation of the backbone's convolutions, saved as an OpenVINO IR at ``output``."""
    try:
        import nncf  # an optional extra ([openvino]): imported only when asked for
    except ImportError:
        raise ExportError(f"nncf is not installed; install it with: {install_extra('openvino')}") from None
    import openvino as ov  # as nncf

    model = ov.Core().read_model(str(float_graph))
    others = sorted({op.get_type_name() for op in model.get_ops()} - {"Convolution"})
    # only convolutions: NNCF would also put its quantisers on the embedding's pooling and the statistics
    logging.getLogger("nncf").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()):  # its progress bars: keep stdout for JSON
        quantised = nncf.quantize(
            model,
            nncf.Dataset(batches),
            subset_size=sum(len(b) for b in batches),
            ignored_scope=nncf.IgnoredScope(types=others, validate=False),
        )
    widened = widen_openvino_ranges(quantised, HEADROOM)
    ov.save_model(quantised, str(output), compress_to_fp16=False)
    return {
        "runtime": "openvino",
        "headroom": f"activation ranges x{HEADROOM} ({widened} quantisers)",
        "tool": f"nncf.quantize (nncf {nncf.__version__})",
        "format": "FakeQuantize",
        "weights": "int8, per channel",
        "activations": "uint8",
        "preset": "performance",
        "quantised": "the convolutions (every other operation in nncf's ignored scope)",
    }


# ---------------------------------------------------------------------- scoring folders
def load_inputs(
    detector, paths: tuple[Path, ...], what: str, progress: bool, changed: bool = False
) -> list[np.ndarray]:
    """``paths`` decoded, framed and normalised as ``train`` did: a list of ``(b, 3, S, S)`` float32 batches
    (``changed``: each picture after its seeded draw of the model's expected changes, as ``train`` draws them).

    Raises:
        ExportError: an image that cannot be read (named).
    """
    config = detector.config
    batches = []
    with tqdm(total=len(paths), desc=what, unit="img", disable=not progress, leave=False) as bar:
        try:
            for chunk, images in iter_for_model(list(paths), config, BATCH):
                if changed:
                    images = [
                        apply(image, config.expected.draw(seeded(path.name)))
                        for path, image in zip(chunk, images, strict=True)
                    ]
                batches.append(model_input_array(detector.preprocess(images)))
                bar.update(len(chunk))
        except ImageError as error:  # the export needs every image it was given
            raise ExportError(f"{what}: {error}") from None
    return batches


def run_graph(session, batches: list[np.ndarray]) -> GraphScores:
    """Every batch through a runtime session (``OnnxRuntimeSession``/``OpenVinoSession``)."""
    outs = [session.run(batch) for batch in batches]
    return GraphScores(
        np.concatenate([o[1] for o in outs]), np.concatenate([o[0] for o in outs]), np.concatenate([o[2] for o in outs])
    )


def folder_images(folder: Path, flag: str) -> list[Path]:
    if not folder.is_dir():
        raise ExportError(f"{flag} {folder}: not a folder")
    paths = list_images(folder)
    if not paths:
        raise ExportError(f"{flag} {folder}: no images in it")
    return paths


def recalibrate(scored: GraphScores, false_alarm_rate: float, changed: GraphScores | None = None) -> Calibration:
    """The quantised scorer's threshold for ``false_alarm_rate`` from its scores of the threshold images (of their
    changed copies, ``changed``, for a model that expects the line's changes; the images' own are kept beside)."""
    own = torch.from_numpy(scored.raw_scores.astype(np.float64))
    return Calibration.from_scores(
        own if changed is None else torch.from_numpy(changed.raw_scores.astype(np.float64)),
        false_alarm_rate,
        input_distances=torch.from_numpy(scored.input_distances.astype(np.float64)),
        taken_scores=None if changed is None else own,
    )


def promise_line(calibration: Calibration) -> str:
    shortfall = calibration.shortfall()
    if shortfall:
        return shortfall
    return (
        f"{calibration.count} held-out normal images promise {calibration.promised_false_alarm_rate:.2%} false "
        f"alarms (at most {calibration.false_alarm_bound:.2%} with 95% confidence"
        + (
            f"; {images_needed(calibration.false_alarm_rate)} images are the fewest for this rate)"
            if calibration.false_alarm_rate is not None
            else ")"
        )
    )


# ---------------------------------------------------------------------- the export
@dataclass(frozen=True)
class Quantised:
    """What a quantised export wrote and measured (``padim.json``'s ``quantisation``).

    Attributes:
        files: the graph's files, relative to its folder.
        calibration: the quantised scorer's own, from the threshold images.
        agreement: the accuracy gate's reading.
    """

    precision: str
    files: list[str]
    calibration: Calibration
    agreement: Agreement
    settings: dict
    split: dict
    check_folder: str | None

    @property
    def threshold_of(self) -> str:
        return (
            f"{self.precision} scorer ({self.settings['runtime']}) on {self.calibration.count} held-out normal images "
            f"of {self.split['folder']} (not used to quantise)"
        )

    def describe(self, float32: Calibration) -> dict:
        return {
            "precision": self.precision,
            **self.settings,
            "calibration_images": self.split,
            "check_images": self.check_folder,
            "agreement": self.agreement.to_dict(),
            "float32_calibration": float32.summary(),
            "promise": promise_line(self.calibration),
            "verified": "unverified: built to ONNX Runtime's CUDA/TensorRT documentation; checked here on the CPU "
            "provider only"
            if self.precision == "fp16"
            else "checked on this runtime by the gate",
        }


def export_quantised_detector(
    detector,
    output: str | Path,
    fmt: str,
    source: str | Path,
    options: QuantiseOptions,
    source_sha256: str | None = None,
    name: str | None = None,
    external_data: bool | None = None,
    triton_device: str = "gpu",
    progress: bool = False,
) -> Path:
    """:func:`~padim.models.deploy.export.export_detector` with a quantised backbone: gated, then given its threshold.

    Returns:
        The directory holding the graph and ``padim.json``.

    Raises:
        ExportError: a precision where its graph cannot run, a missing runtime, a calibration folder too small,
            an unreadable image, or a hand-set threshold without ``options.false_alarm_rate``.
        AccuracyGateFailed: scores moved past ``options.max_score_error`` (and no ``options.force``); nothing written.
    """
    check_combination(options.precision, fmt, triton_device)
    require("openvino" if fmt == "openvino" else "onnxruntime")
    if options.precision == "bf16" and not bfloat16_native():
        how = "emulated, slower than float32" if openvino_runs("bf16") == "bf16" else "at float32"
        raise ExportError(
            f"this CPU has no native bfloat16 (OpenVINO offers {', '.join(openvino_capabilities())}), so a bf16 "
            f"export would run, be gated and be calibrated {how} here: export it on the CPU that will score it "
            "(AVX512-BF16 or AMX), or use --precision int8 or float32 here"
        )
    if options.false_alarm_rate is None and detector.calibration.false_alarm_rate is None:
        raise ExportError(
            "the model's threshold was set by hand (evaluate --calibrate), so it names no false-alarm "
            "rate: give the quantised scorer's with --false-alarm-rate"
        )
    return export_detector(
        detector,
        output,
        fmt,
        source,
        source_sha256=source_sha256,
        name=name,
        external_data=external_data,
        triton_device=triton_device,
        write_graph=lambda graph_dir, staging: export_quantised(
            detector, graph_dir, fmt, options, staging, external_data, progress
        ),
    )


def export_quantised(
    detector,
    graph_dir: Path,
    fmt: str,
    options: QuantiseOptions,
    staging: Path,
    external_data: bool | None,
    progress: bool,
) -> Quantised:
    """Write the quantised graph of ``detector`` into ``graph_dir`` and gate and recalibrate it.

    The float32 graph is exported into a scratch folder under ``staging`` (removed), scored beside
    the quantised one on the same runtime (OpenVINO for ``openvino``, ONNX Runtime otherwise, on the CPU).

    Raises:
        ExportError: a calibration folder too small, or an unreadable image.
        AccuracyGateFailed: scores moved past ``options.max_score_error`` and ``options.force`` is off.
    """
    split = split_calibration(
        folder_images(options.calibration_images, "--calibration-images"), options.quantiser_images, options.precision
    )
    check = folder_images(options.check_images, "--check-images") if options.check_images else []
    rate = options.false_alarm_rate if options.false_alarm_rate is not None else detector.calibration.false_alarm_rate
    work = staging / ".work"
    work.mkdir()
    runtime = "openvino" if fmt == "openvino" else "onnxruntime"
    session = _sessions(detector, runtime)
    float_graph = _export_onnx(detector, work / "float32.onnx", external_data)
    quantiser, normal, changed, defects = _inputs(detector, split, check, progress)
    reference = session(float_graph)
    reference_normal = run_graph(reference, normal)
    reference_check = run_graph(reference, defects) if defects else None
    del reference
    log.info("quantising the backbone: %s on %s", options.precision, runtime)
    graph, settings = _quantised_graph(
        detector, float_graph, graph_dir, options.precision, runtime, quantiser, work, external_data
    )
    quantised = session(graph, options.precision)
    quantised_normal = run_graph(quantised, normal)
    quantised_changed = run_graph(quantised, changed) if changed else None
    quantised_check = run_graph(quantised, defects) if defects else None
    del quantised
    threshold = detector.calibration.threshold
    compared = compare(
        reference_normal, quantised_normal, threshold, options.max_score_error, reference_check, quantised_check
    )
    agreement = _gated(compared, options)
    calibration = recalibrate(quantised_normal, rate, quantised_changed)
    shutil.rmtree(work)
    files = sorted(p.name for p in graph_dir.iterdir() if p.is_file())
    return Quantised(
        options.precision,
        files,
        calibration,
        agreement,
        settings,
        split.describe(options.calibration_images),
        None if options.check_images is None else str(options.check_images),
    )


def _inputs(detector, split, check: list[Path], progress: bool) -> tuple[list, list, list, list]:
    """The model inputs of the quantiser's pictures, the threshold's (and their changed copies, where the model
    expects the line's changes) and the check's defects."""
    quantiser = load_inputs(detector, split.quantiser, "quantiser images", progress) if split.quantiser else []
    normal = load_inputs(detector, split.threshold, "threshold images", progress)
    changed = (
        load_inputs(detector, split.threshold, "threshold images, changed as the model expects", progress, changed=True)
        if detector.config.gaussian.expect
        else []
    )
    defects = load_inputs(detector, tuple(check), "check images", progress) if check else []
    return quantiser, normal, changed, defects


def _sessions(detector, runtime: str):
    """``(graph, precision) -> session`` on the CPU of ``runtime``: the precision is OpenVINO's inference precision
    (bf16); ONNX Runtime's graphs carry their own."""
    cpu = torch.device("cpu")
    if runtime == "openvino":
        return lambda graph, precision="float32": OpenVinoSession(graph, cpu, precision)
    return lambda graph, precision="float32": OnnxRuntimeSession(graph, cpu, detector.config.input_shape)


def _quantised_graph(
    detector,
    float_graph: Path,
    graph_dir: Path,
    precision: str,
    runtime: str,
    quantiser: list,
    work: Path,
    external_data: bool | None = None,
) -> tuple[Path, dict]:
    """The graph at ``precision`` written into ``graph_dir``, and the settings that made it (``padim.json``)."""
    if precision == "fp16":
        graph = _export_onnx(detector, graph_dir / ONNX_FILE, external_data, backbone_dtype=torch.float16)
        settings = {
            "runtime": runtime,
            "tool": "torch.onnx.export of the backbone in float16",
            "weights": "float16",
            "activations": "float16 (input and features float32)",
            "quantised": "the backbone",
        }
    elif precision == "bf16":
        graph = graph_dir / OPENVINO_FILE
        _convert_openvino(float_graph, graph)
        settings = {
            "runtime": runtime,
            "tool": "OpenVINO inference precision bf16 (INFERENCE_PRECISION_HINT) on the float32 IR",
            "weights": "float32 in the file; bfloat16 where OpenVINO runs bf16",
            "activations": "bfloat16 where OpenVINO runs bf16 (its choice of operations)",
            "quantised": "what OpenVINO runs in bf16: the backbone and most of the graph",
            "inference_precision": "bf16",
        }
    elif runtime == "openvino":
        graph = graph_dir / OPENVINO_FILE
        settings = quantise_openvino(float_graph, graph, quantiser)
    else:
        graph = graph_dir / ONNX_FILE
        settings = quantise_static(float_graph, graph, quantiser, work)  # as train --precision int8 quantises
    return graph, settings


def _gated(agreement: Agreement, options: QuantiseOptions) -> Agreement:
    """The gate's verdict: a failed gate refuses the export, unless ``options.force`` (then it says so)."""
    if agreement.passed:
        return agreement
    if not options.force:
        raise AccuracyGateFailed(
            f"the {options.precision} scorer is not accurate enough: {agreement.sentence()}; nothing was written. "
            "Raise --max-score-error if this is acceptable for your line, or --force to write it anyway"
        )
    forced = Agreement(**{**asdict(agreement), "forced": True})
    log.warning("accuracy gate failed, written anyway (--force): %s", forced.sentence())
    return forced
