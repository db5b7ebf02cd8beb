"""What runs the scorer: torch, ONNX Runtime or OpenVINO, behind one interface.

:func:`load_scorer` is what ``predict``, ``evaluate`` and ``serve`` call. It gives a
:class:`~padim.models.scoring.detector.PadimDetector` for ``torch``, and a :class:`DeployedDetector`
(the exported graph of :mod:`padim.models.deploy.export` in ONNX Runtime or OpenVINO) otherwise. Both
answer ``preprocess``, ``score``, ``calibration``, ``describe``, ``config``, ``weights`` and
``provenance`` alike, so callers never ask which one they hold.

A ``.padim`` file asked for with another runtime is verified and loaded as usual, exported once
and the export cached (:func:`cache_dir`), keyed by the file's sha256: the next load reads the
cache, and a changed file (``evaluate --calibrate``, a new fit) gets a new export.

**Default** (``auto``, :func:`runtime_choice`, which says why): for a float32 ``.padim`` file, ONNX Runtime on a
CPU when it is installed, torch otherwise (and torch on a GPU); for a file fitted at int8, its own int8 graph on
ONNX Runtime (the CPU); at bf16 or fp16, torch; for an export directory, the runtime its graph was made for
(ONNX Runtime for ``model.onnx``, OpenVINO for ``model.xml``). The device of ``auto`` is chosen per
runtime (:func:`padim.models.devices.runtime_device`): a GPU only where that runtime can use it
here. Measured on
a 2-core AMD EPYC (docs/runtimes.md): ONNX Runtime scored 1.24x torch at batch 16 and 1.45x
at batch 1 (the scorer alone; 1.17x and 1.26x end to end), equal to 1e-6 relative. OpenVINO in float32 was behind ONNX
Runtime there; in its default bfloat16 on CPUs that have it, scores moved by 0.7%, so padim
always asks it for float32. On a GPU, torch runs CUDA and stays the default.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from padim.core.artifact import ArtifactError, file_sha256, locked_file, read_header
from padim.core.calibration import Calibration
from padim.models.choices import RUNTIMES, install_extra
from padim.models.config import PadimConfig
from padim.models.data.framing import Framing
from padim.models.data.images import to_pixels
from padim.models.deploy.export import (
    GRAPH_VERSION,
    INPUT_NAME,
    METADATA_FILE,
    ONNX_FILE,
    OPENVINO_FILE,
    OUTPUT_NAMES,
    ExportError,
    export_detector,
    export_int8_scorer,
    read_export,
    require,
)
from padim.models.devices import (
    CPU_FLAGS,
    INT8_FLAGS,
    check_precision,
    cpu_features,
    int8_flag,
    onnxruntime_installed,
    runtime_device,
)
from padim.models.features.backbones import WeightsInfo
from padim.models.features.embedding import model_input_array
from padim.models.fit.model_file import load_detector
from padim.models.scorer import Scorer
from padim.models.scoring.detector import Provenance, calibration_options, shown_options
from padim.models.scoring.model import ScoreOutput
from padim.models.scoring.reduced import KEY as INT8_KEY

log = logging.getLogger(__name__)

#: Where exports of ``.padim`` files are cached when the model's own folder is read-only.
CACHE_ENV = "PADIM_CACHE_DIR"
_export_lock = threading.Lock()


def is_export(path: str | Path) -> bool:
    """Whether ``path`` is an export directory (``padim export``)."""
    return Path(path).is_dir() and (Path(path) / METADATA_FILE).is_file()


def runtime_choice(
    runtime: str, device: str, precision: str = "fp32", int8_scorer: dict | None = None
) -> tuple[str, str]:
    """The runtime of a ``.padim`` file fitted at ``precision``, and why in a few words: ``auto`` is the fastest
    scorer whose scores the model's threshold was computed from.

    - fp32 with a usable int8 scorer (``int8_scorer``: the file header's, :mod:`padim.models.scoring.reduced`), on a
      CPU that computes int8 faster, ONNX Runtime installed: that scorer (:func:`int8_scorer_choice`), its own
      threshold with it.

    - int8: ONNX Runtime on the CPU, the model's own int8 backbone in one graph with the rest (``torch`` runs the
      same backbone, through ONNX Runtime too, beside torch's statistics: slower at batch 1).
    - bf16, fp16: torch, the one runtime that computes the backbone at that arithmetic.
    - fp32: torch on a GPU (``device`` ``cuda``, or ``auto`` where torch sees one), else ONNX Runtime where installed
      (1.2-1.45x torch on a CPU), else torch. On a CPU with bfloat16 or int8 arithmetic the reason also names the
      gated export that scores faster there (:func:`faster_here`): the model's own threshold is float32's, so
      ``auto`` does not switch to it by itself.

    Other names are checked and returned as they are.
    """
    if runtime not in RUNTIMES:
        raise ExportError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if runtime != "auto":
        return runtime, "asked for"
    if precision == "fp32":
        chosen, why = int8_scorer_choice(device, int8_scorer)
        if chosen:
            return "onnxruntime", why
    if precision == "int8":
        return "onnxruntime", (
            "the model's int8 backbone, with which its threshold was computed, runs on ONNX Runtime's int8 kernels "
            "(the CPU), in one graph with the statistics"
        )
    if precision != "fp32":
        return "torch", f"the model scores at {precision}, which torch computes; its threshold is those scores"
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return "torch", "torch on the GPU (ONNX Runtime's CPU path would leave it idle)"
    if not onnxruntime_installed():
        faster = f"it scores 1.2-1.45x faster on a CPU: {install_extra('onnxruntime')}"
        return "torch", f"ONNX Runtime is not installed ({faster})"
    not_int8 = f"; {why}" if why else ""
    return "onnxruntime", (
        "float32 on ONNX Runtime: the fastest runtime of a float32 model on a CPU (1.2-1.45x torch)"
        + not_int8
        + faster_here()
    )


def runs_int8_scorer(device: str, precision: str, int8_scorer: dict | None) -> bool:
    """Whether ``--runtime auto`` scores a model fitted at ``precision`` with its int8 scorer on ``device``
    (:func:`int8_scorer_choice`; only a float32 model has one)."""
    return precision == "fp32" and int8_scorer_choice(device, int8_scorer)[0]


def int8_scorer_choice(device: str, int8_scorer: dict | None, flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether ``--runtime auto`` runs a float32 model's int8 scorer (``int8_scorer``: its file header's entry,
    :mod:`padim.models.scoring.reduced`) on ``device``, and why (or why not: ``""`` where the model has none). It
    does on a CPU whose int8 kernels ONNX Runtime runs faster than float32 (``flags``: this CPU's by default), where
    ONNX Runtime is installed and the scorer's gate passed, whichever machine fitted the model."""
    if int8_scorer is None:
        return False, ""
    check = int8_scorer.get("check") or {}
    gate = (
        f"largest image-score difference from float32 {check.get('max_score_error', float('nan')):.1%} on "
        f"{check.get('images')} training pictures, tolerance {check.get('tolerance', float('nan')):.0%}"
    )
    if int8_scorer.get("calibration") is None:
        return False, f"its int8 scorer was refused by its gate at fit time ({gate})"
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return False, "its int8 scorer runs on the CPU, and this machine has a GPU"
    flag = int8_flag(flags)
    if flag is None:
        return False, "its int8 scorer is not faster on this CPU (no AVX2, VNNI or AMX)"
    if not onnxruntime_installed():
        return False, f"its int8 scorer runs on ONNX Runtime, which is not installed ({install_extra('onnxruntime')})"
    return True, (
        f"the model's int8 scorer on ONNX Runtime: this CPU has {flag}, whose int8 kernels score 1.5-2x float32; its "
        f"own threshold from its out-of-fold int8 scores at fit time, gated against float32 ({gate})"
    )


def faster_here(features: tuple[str, ...] | None = None) -> str:
    """What a float32 model could score faster with on this CPU (``features``: :func:`~padim.models.devices.
    cpu_features` by default), each with a threshold of its own: ``""`` where nothing is known to be faster.

    bfloat16 arithmetic (AVX512-BF16, AMX) runs OpenVINO's gated bf16 export; int8 dot products (VNNI, AMX) its
    int8 one. Measured on a 2-core Intel Xeon with AMX (docs/performance.md, 2026-12-03): bf16 78.3 img/s at batch 1
    and 287.3 at 16, int8 68.6 and 204.4, float32 ONNX Runtime 52.4 and 90.8.
    """
    found = cpu_features() if features is None else features
    bf16 = [flag for flag in CPU_FLAGS["bf16"] if flag in found]  # the flags check_precision and --precision auto read
    int8 = [flag for flag in INT8_FLAGS if flag in found]
    if bf16:
        precision, flag, gain = "bf16", bf16[0], "1.5x at batch 1, 3.2x at 16"
    elif int8:
        precision, flag, gain = "int8", int8[0], "1.3x at batch 1, 2.3x at 16"
    else:
        return ""
    return (
        f"; this CPU has {flag}: `padim export --format openvino --precision {precision} --calibration-images DIR` "
        f"(more normal pictures) makes a scorer checked against float32 with a threshold of its own, {gain} on a "
        "2-core Xeon with AMX (docs/performance.md)"
    )


def export_runtime(path: Path, runtime: str) -> str:
    """The runtime of an export directory: ``auto`` -> the one its graph is for; others are checked."""
    if runtime not in RUNTIMES:
        raise ExportError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if runtime == "torch":
        raise ExportError(f"{path}: an export runs on onnxruntime or openvino; torch needs the .padim file")
    if runtime == "auto":
        return "onnxruntime" if (path / ONNX_FILE).is_file() else "openvino"
    return runtime


def load_scorer(
    path: str | Path,
    runtime: str = "auto",
    device: str = "auto",
    with_statistics: bool = False,
    cache: Path | None = None,
) -> Scorer:
    """The :class:`~padim.models.scorer.Scorer` on ``runtime``: a ``PadimDetector`` (torch) or ``DeployedDetector``.

    Args:
        path: a ``.padim`` model file, or an export directory (``padim export``).
        runtime: one of :data:`padim.models.choices.RUNTIMES`.
        device: ``auto``, ``cpu`` or ``cuda``; ``auto`` is a GPU only where ``runtime`` can use one here.
        with_statistics: torch only: also read the streamed statistics.
        cache: the folder for the export a ``.padim`` is turned into for another runtime (a model repository
            keeps it outside the version's folder); by default :func:`cache_dir` chooses.

    Raises:
        ArtifactError: a damaged or foreign file or export.
        ExportError: a runtime that is not installed or cannot read ``path``.
        UsageError: ``cuda`` asked for where this runtime cannot use it.
    """
    path = Path(path)
    if is_export(path):
        return _export_scorer(path, runtime, device)
    header = read_header(path)
    precision = header.get("config", {}).get("precision", "fp32")
    if precision == "int8" and device == "cuda":  # its backbone is ONNX Runtime's int8 kernels: the CPU's
        check_precision(precision, torch.device("cuda"))
    int8_scorer = header.get(INT8_KEY) if precision == "fp32" else None
    chosen, reason = runtime_choice(runtime, device, precision, int8_scorer)
    scorer = "int8" if runtime == "auto" and runs_int8_scorer(device, precision, int8_scorer) else None
    if runtime == "auto":
        log.debug("runtime auto: %s (%s)", chosen, reason)
    if chosen == "torch":
        detector = load_detector(path, device=device, with_statistics=with_statistics)
        detector.runtime_reason = reason
        return detector
    if precision == "int8" and chosen == "openvino":
        raise ExportError(
            f"{path}: an int8 model's threshold is its ONNX Runtime int8 scores: run it with --runtime onnxruntime "
            "(or auto), or export an OpenVINO graph with its own threshold (padim export --format openvino "
            "--precision int8 --calibration-images DIR)"
        )
    require(chosen)
    # the int8 graph runs on ONNX Runtime's CPU kernels, whatever GPU there is
    int8 = precision == "int8" or scorer == "int8"
    target = runtime_device(chosen, "cpu" if int8 and device == "auto" else device)
    log.debug("%s: %s on %s", path, chosen, target)
    sha256 = file_sha256(path)
    cached = _cache_of(path, sha256, scorer, cache)
    metadata = _cached_export(path, sha256, cached, chosen, pruned=cache is None, scorer=scorer)
    if metadata is None:  # stale or damaged, and removed: made again as today's
        return load_scorer(path, runtime, device, cache=cache)
    if metadata["model"]["sha256"] != sha256:
        raise ArtifactError(f"{cached}: cached export of another file; remove it")
    deployed = DeployedDetector(cached, metadata, chosen, target, source=path)
    deployed.runtime_reason = reason
    return deployed


def _cache_of(path: Path, sha256: str, scorer: str | None, cache: Path | None) -> Path:
    """Where the ONNX export of the model file ``path`` (both runtimes read it) waits: in ``cache`` when given, else
    :func:`cache_dir`'s; its int8 scorer's graph (``scorer``) apart from the float32 one."""
    fmt = "onnx" if scorer is None else f"onnx-{scorer}"
    return cache / f"{path.name}.{fmt}-{sha256[:16]}" if cache is not None else cache_dir(path, sha256, fmt)


def _export_scorer(path: Path, runtime: str, device: str) -> DeployedDetector:
    """An export directory on ``runtime`` (``auto``: the runtime its graph is for)."""
    metadata = read_export(path)
    chosen = export_runtime(path, runtime)
    require(chosen)
    target = runtime_device(chosen, device)
    log.debug("%s: %s on %s", path, chosen, target)
    return DeployedDetector(path, metadata, chosen, target)


def _cached_export(
    path: Path, sha256: str, cached: Path, runtime: str, pruned: bool, scorer: str | None = None
) -> dict | None:
    """The metadata of the model file ``path``'s export in ``cached``, exported first when there is none; ``None``
    when the one there is an older padim's graph or damaged (removed: the caller exports it again). ``pruned``:
    older exports of the same file beside it are removed (a given cache folder's owner prunes it instead).
    ``scorer`` ``int8``: the graph of the model's int8 scorer, with its threshold (:func:`export_int8_scorer`)."""
    with _exclusive(cached):  # replicas sharing a repository's cache export a version once, and read it whole
        if not is_export(cached):
            detector = load_detector(path, device="cpu")
            log.info("exporting %s for %s into %s (once; later loads read it)", path, runtime, cached)
            if scorer == "int8":
                export_int8_scorer(detector, cached, path, source_sha256=sha256)
            else:
                export_detector(detector, cached, "onnx", path, source_sha256=sha256)
            del detector
            if pruned:
                _prune(cached)
        try:
            metadata = read_export(cached)
            version = int(metadata.get("export_version", 0))
            # an older padim's graph (still servable) is made again as today's, which is faster
            stale = f"cached by an older padim (export version {version})" if version < GRAPH_VERSION else None
        except ArtifactError:  # a damaged cache is not the model's fault: make it again
            stale = "cached export damaged"
        if stale is not None:
            log.warning("%s: %s; exporting again", cached, stale)
            shutil.rmtree(cached, ignore_errors=True)
            return None
    return metadata


@contextlib.contextmanager
def _exclusive(cached: Path) -> Iterator[None]:
    """The export of ``cached`` to this thread alone, and to this process alone among those that share its folder
    (an ``flock`` on the folder's ``.export.lock``: the replicas of a service on one repository volume)."""
    with _export_lock:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with locked_file(cached.parent / ".export.lock"):
            yield


def cache_dir(model_path: Path, sha256: str, fmt: str) -> Path:
    """Where the export of ``model_path`` for ``fmt`` is cached.

    ``$PADIM_CACHE_DIR`` when set; else ``.padim-cache/`` beside the model file when that folder
    is writable; else ``~/.cache/padim`` or, failing that, the temporary directory.
    """
    leaf = Path(f"{model_path.name}.{fmt}-{sha256[:16]}")
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / leaf
    beside = model_path.resolve().parent
    if os.access(beside, os.W_OK):
        return beside / ".padim-cache" / leaf
    for root in (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "padim",
        Path(tempfile.gettempdir()) / "padim-cache",
    ):
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK):
            return root / leaf
    raise ExportError(f"no writable folder to cache the export of {model_path}; set {CACHE_ENV}")


def _prune(current: Path) -> None:
    """Remove older cached exports of the same model file and format."""
    stem = current.name.rsplit("-", 1)[0]
    for other in current.parent.glob(f"{stem}-*"):
        if other != current and other.is_dir():
            shutil.rmtree(other, ignore_errors=True)


#: Folder of TensorRT engines; when set, ONNX Runtime on a GPU tries TensorRT first.
TENSORRT_ENV = "PADIM_TENSORRT_CACHE"
#: Largest batch of the TensorRT optimisation profile (the service's default max batch is 32).
TENSORRT_MAX_BATCH = 64


def onnxruntime_providers(
    available: list[str], device: torch.device, image_size: int | tuple[int, int] | None, tensorrt_cache: str | None
) -> list:
    """ONNX Runtime's providers, best first, for ``device`` (see :class:`OnnxRuntimeSession`).

    Raises:
        ExportError: ``cuda`` without the CUDA provider (onnxruntime-gpu).
    """
    if device.type != "cuda":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in available:
        raise ExportError(
            "--device cuda with --runtime onnxruntime needs onnxruntime-gpu "
            f"(this onnxruntime has {', '.join(available)}); or use --runtime torch"
        )
    cuda = (
        "CUDAExecutionProvider",
        {"device_id": device.index or 0, "cudnn_conv_algo_search": "EXHAUSTIVE", "use_tf32": 0},
    )
    providers: list = [cuda, "CPUExecutionProvider"]
    if tensorrt_cache and "TensorrtExecutionProvider" in available and image_size:
        Path(tensorrt_cache).mkdir(parents=True, exist_ok=True)
        height, width = (image_size, image_size) if isinstance(image_size, int) else image_size

        def shape(batch: int) -> str:
            return f"{INPUT_NAME}:{batch}x3x{height}x{width}"

        providers.insert(
            0,
            (
                "TensorrtExecutionProvider",
                {
                    "device_id": device.index or 0,
                    "trt_engine_cache_enable": True,
                    "trt_engine_cache_path": str(tensorrt_cache),
                    "trt_timing_cache_enable": True,
                    "trt_timing_cache_path": str(tensorrt_cache),
                    "trt_fp16_enable": False,
                    "trt_profile_min_shapes": shape(1),
                    "trt_profile_opt_shapes": shape(16),
                    "trt_profile_max_shapes": shape(TENSORRT_MAX_BATCH),
                },
            ),
        )
    return providers


class DeployedDetector:
    """A detector whose scorer is an exported graph, run by ONNX Runtime or OpenVINO.

    Attributes:
        directory: the export directory.
        runtime: ``onnxruntime`` or ``openvino``.
        config, weights, calibration, provenance: as on :class:`PadimDetector`, from ``padim.json``.
        precision_dtype: dtype of the precision factors in the graph.
        precision: the backbone's: ``float32``, ``int8``, ``fp16`` or ``bf16`` (``padim export --precision``).
        runs_at: what it runs at here where that is not ``precision`` (a bf16 export on a CPU without bfloat16:
            ``float32``), else ``None``.
        threshold_of: which scorer's scores set the threshold: ``float32 scorer`` (the model file's), or the
            quantised scorer's own on held-out normal images (export version 5).
    """

    def __init__(self, directory: Path, metadata: dict, runtime: str, device: torch.device, source: Path | None = None):
        self.directory, self.runtime, self.source = Path(directory), runtime, source
        self.metadata = metadata
        try:
            # an export from before the scoring options computes what they were then (its graph says so too)
            self.config = PadimConfig.from_stored(metadata["config"], str(directory / METADATA_FILE), older=True)
            self.weights = WeightsInfo(**metadata["weights"])
            self.provenance = Provenance.from_header(metadata["provenance"])
            distances = metadata.get("calibration_input_distances")  # export version 4
            taken = metadata.get("calibration_taken_scores")  # export version 6
            line = metadata.get("calibration_line_scores")  # export version 10
            self.calibration = Calibration.from_header(
                metadata["calibration"],
                torch.tensor(metadata["calibration_scores"], dtype=torch.float64),
                None if distances is None else torch.tensor(distances, dtype=torch.float64),
                None if taken is None else torch.tensor(taken, dtype=torch.float64),
                line_scores=None if line is None else torch.tensor(line, dtype=torch.float64),
            )
            self.precision_dtype = getattr(torch, metadata["precision_dtype"])
            self.precision = metadata.get("precision", "float32")  # export version 5
            self.threshold_of = metadata.get("threshold_of", "float32 scorer")  # export version 5
            # a model file's int8 scorer (export version 16), else the model's own
            self.file_scorer = (metadata.get("quantisation") or {}).get("model_scorer", "float32")
        except (KeyError, TypeError, ValueError) as error:
            raise ArtifactError(
                f"{directory}: inconsistent {METADATA_FILE} ({type(error).__name__}: {error})"
            ) from None
        self.statistics = None
        self.runs_at: str | None = None  # the arithmetic here where it is not ``precision``
        self.runtime_reason: str | None = None  # why ``--runtime auto`` chose it (a model file's cached export)
        self.image_size = self.config.features.image_size
        self.framing = Framing.of(self.config)
        self._device = device
        self._session = self._open(runtime, device)

    def _open(self, runtime: str, device: torch.device) -> OnnxRuntimeSession | OpenVinoSession:
        """The session that runs the graph on ``runtime``; a bf16 export where OpenVINO runs another precision is said
        (``runs_at``)."""
        directory = self.directory
        graph = self.directory / (ONNX_FILE if (self.directory / ONNX_FILE).is_file() else OPENVINO_FILE)
        if runtime == "onnxruntime":
            if graph.suffix != ".onnx":
                raise ExportError(
                    f"{directory}: an OpenVINO export; run it with --runtime openvino, "
                    "or export with --format onnx for onnxruntime"
                )
            return OnnxRuntimeSession(graph, device, self.config.input_shape)
        elif runtime == "openvino":
            session = OpenVinoSession(graph, device, self.precision)
            if self.precision == "bf16" and session.precision == "bf16" and not bfloat16_native():
                log.warning(
                    "%s: a bf16 export on a CPU without native bfloat16 (OpenVINO offers %s): OpenVINO emulates "
                    "bfloat16 here, so it scores as bf16 (its threshold holds) but slower than float32 (0.2-0.3x "
                    "measured on an AVX-512 Xeon); score it on the CPU it was made for",
                    directory,
                    ", ".join(openvino_capabilities()),
                )
            if session.precision != self.precision:  # a bf16 export where OpenVINO runs float32
                self.runs_at = session.precision
                agreement = self.metadata.get("quantisation", {}).get("agreement", {})
                log.warning(
                    "%s: a bf16 export on a CPU without bfloat16 (OpenVINO offers %s): it scores correctly at "
                    "float32 here, slower than on the CPU it was made for; its threshold is bf16's, whose scores "
                    "differed from float32's by at most %s on its calibration pictures",
                    directory,
                    ", ".join(openvino_capabilities()),
                    f"{agreement['max_score_error']:.2%}" if "max_score_error" in agreement else "the gate's",
                )
            return session
        else:
            raise ExportError(f"an export cannot run on {runtime!r}; choose onnxruntime or openvino")

    @property
    def device(self) -> torch.device:
        """Where the graph runs; the outputs are always CPU tensors (the runtimes return host arrays)."""
        return self._device

    @property
    def providers(self) -> list[str]:
        return self._session.providers

    def preprocess(self, images) -> torch.Tensor:
        """PIL images -> ``(B, 3, S, S)`` uint8 pixels, framed exactly as training framed them."""
        return to_pixels(images, self.framing)

    def score(self, batch: torch.Tensor) -> ScoreOutput:
        """``(B, 3, S, S)`` pixels (or normalised float32 input, the graph's) -> raw image scores ``(B,)``, maps
        ``(B, S, S)`` and input distances ``(B,)`` (CPU tensors; no input distances from an export older than
        version 4)."""
        maps, raw_scores, *rest = self._session.run(model_input_array(batch))
        return ScoreOutput(
            torch.from_numpy(raw_scores), torch.from_numpy(maps), torch.from_numpy(rest[0]) if rest else None
        )

    def capture_graphs(self, largest: int) -> tuple[int, ...]:
        """None: an exported graph runs on its runtime's own terms."""
        return ()

    def describe(self) -> dict:
        """As :meth:`PadimDetector.describe`, plus the runtime."""
        quantisation = self.metadata.get("quantisation")
        own = self.file_scorer != "float32"  # a model file's int8 scorer: its threshold out-of-fold, as float32's
        return {
            **self.metadata["description"],
            **shown_options(self.config),
            # an export of version 12 or older describes neither: the table's, for its stored stages
            "backbone_family": self.config.spec.family,
            "stages": self.config.spec.described(self.config.features.stages),
            "runtime": self.runtime,
            **({"runtime_reason": self.runtime_reason} if self.runtime_reason else {}),
            "precision": self.precision,
            **({"runs_at": self.runs_at} if self.runs_at is not None else {}),
            "calibration": {
                **self.metadata["description"]["calibration"],
                **self.calibration.summary(),
                **calibration_options(
                    self.config,
                    len(self.calibration.line_scores),
                    self.metadata["description"]["calibration"].get("measured"),
                ),
                "threshold_of": self.threshold_of,
                **({"source": "held_out"} if quantisation and not own else {}),
            },
            **(
                {
                    "quantisation": {
                        k: quantisation[k] for k in ("agreement", "float32_calibration", "promise", "verified", "tool")
                    }
                }
                if quantisation and not own
                else {}
            ),
            **(
                {
                    "int8_scorer": {
                        k: quantisation[k] for k in ("check", "quantiser", "float32_calibration", "promise", "verified")
                    }
                }
                if quantisation and own
                else {}
            ),
        }


class OnnxRuntimeSession:
    """An ONNX Runtime inference session of the exported graph (thread-safe ``run``).

    On ``cuda`` the CUDA provider runs it (``onnxruntime-gpu``; :func:`runtime_device` only picks
    ``cuda`` where it is installed), with cuDNN's convolution search done once per shape and TF32
    off, as padim's torch path. TensorRT is opt-in: with ``$PADIM_TENSORRT_CACHE`` set to a folder,
    the TensorRT provider goes first, with one optimisation profile for batches 1 to
    :data:`TENSORRT_MAX_BATCH` and its engines cached in that folder (built once, not per new batch
    size or process start). Unverified on a GPU so far (docs/gpu.md).
    """

    def __init__(self, graph: Path, device: torch.device, image_size: int | tuple[int, int] | None = None):
        ort = require("onnxruntime")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        # Its threads otherwise spin after each run, taking the cores from image decoding and
        # torch's own ops around it (measured, 2 cores: end to end at batch 1, 47.5 -> 53.4 img/s).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = onnxruntime_providers(
            ort.get_available_providers(), device, image_size, os.environ.get(TENSORRT_ENV)
        )
        self.session = ort.InferenceSession(str(graph), options, providers=providers)
        self.providers = self.session.get_providers()

    def run(self, images: np.ndarray) -> list[np.ndarray]:
        """``anomaly_map``, ``raw_score`` and, from export version 4, ``input_distance``."""
        return self.session.run(None, {INPUT_NAME: images})


@functools.cache
def openvino_capabilities() -> tuple[str, ...]:
    """What OpenVINO's CPU plugin can run here (``OPTIMIZATION_CAPABILITIES``: ``FP32``, ``INT8``, ``BF16``, ...)."""
    ov = require("openvino")
    return tuple(str(c) for c in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


def bfloat16_native() -> bool:
    """Whether this CPU has bfloat16 arithmetic OpenVINO uses (AVX512-BF16, AMX: ``BF16`` in its capabilities).
    Without it OpenVINO runs a bf16 request at float32 (AVX2) or emulated, slower than float32 (AVX-512)."""
    return "BF16" in openvino_capabilities()


@functools.cache
def openvino_runs(precision: str) -> str:
    """The precision OpenVINO runs on this CPU when asked for ``precision``; ``int8`` graphs are int8 everywhere.

    For ``bf16``, read back from a one-convolution model compiled with that hint: OpenVINO runs bfloat16 where the
    CPU has it (AVX512-BF16, AMX) and on some with AVX-512 alone, whose ``OPTIMIZATION_CAPABILITIES`` do not list
    BF16 (an Intel Xeon with AVX512-VNNI: scores move by about 1%, as on a bfloat16 CPU); elsewhere (AVX2) it
    falls back to float32 silently. What it reports is what it runs, so the capabilities are not asked.
    """
    if precision != "bf16":
        return precision
    ov = require("openvino")
    opset = ov.opset13
    picture = opset.parameter([1, 3, 8, 8], np.float32)
    weights = opset.constant(np.ones((4, 3, 3, 3), dtype=np.float32))
    probe = ov.Model([opset.convolution(picture, weights, [1, 1], [0, 0], [0, 0], [1, 1])], [picture])
    return compiled_precision(ov.Core().compile_model(probe, "CPU", {"INFERENCE_PRECISION_HINT": "bf16"}))


def compiled_precision(compiled) -> str:
    """``bf16`` or ``float32``: the inference precision an OpenVINO compiled model reports (``bfloat16``, ``f32``)."""
    reported = str(compiled.get_property("INFERENCE_PRECISION_HINT")).lower()
    return "bf16" if "bf16" in reported or "bfloat16" in reported else "float32"


class OpenVinoSession:
    """An OpenVINO compiled model of the exported graph: in float32 (OpenVINO's default, bfloat16 on CPUs that have
    it, would move the scores off the threshold calibrated for them), or bf16 for a ``bf16`` export.

    Attributes:
        precision: what the compiled model runs at here, read back from OpenVINO for a bf16 export (one on a CPU
            without bfloat16 runs at float32); the export's own precision otherwise.
    """

    def __init__(self, graph: Path, device: torch.device, precision: str = "float32"):
        ov = require("openvino")
        if device.type == "cuda":
            raise ExportError("--runtime openvino runs on the CPU here; use --device cpu, or --runtime torch for CUDA")
        core = ov.Core()
        self.model = core.compile_model(
            core.read_model(str(graph)),
            "CPU",
            {"INFERENCE_PRECISION_HINT": "bf16" if precision == "bf16" else "f32", "PERFORMANCE_HINT": "LATENCY"},
        )
        if precision == "bf16":
            self.precision = compiled_precision(self.model)
        else:  # float32 and int8 graphs: what they are
            self.precision = precision
        self.providers = ["CPU"]
        self._outputs = {name for output in self.model.outputs for name in output.get_names()}
        self._local = threading.local()

    def run(self, images: np.ndarray) -> list[np.ndarray]:
        """``anomaly_map``, ``raw_score`` and, from export version 4, ``input_distance``."""
        request = getattr(self._local, "request", None)
        if request is None:  # an infer request serves one thread at a time
            request = self._local.request = self.model.create_infer_request()
        results = request.infer({INPUT_NAME: images})
        names = [name for name in OUTPUT_NAMES if name in self._outputs]
        return [np.array(results[self.model.output(name)]) for name in names]
