"""Allowed values of configuration options and the run-option defaults, importable without torch (``padim --help``
lists them). Every default of how a command runs is here, once."""

from __future__ import annotations

from pathlib import Path

REDUCTIONS = ("random", "semi_orthogonal")
#: ``train --standardise``: none, or how each picture's light is set before the backbone
#: (:mod:`padim.models.features.photometric`).
STANDARDISE = ("none", "gain", "channels", "picture")
#: ``neighbourhood``: side of the per-layer feature average (1: none).
NEIGHBOURHOODS = (1, 3, 5)
#: ``resize``: how the region of interest becomes the model's square input (:mod:`padim.models.data.framing`).
RESIZES = ("squash", "crop", "pad")
#: ``tile_statistics``: each tile position its own Gaussians (placed parts), or one set every tile shares (uniform
#: surfaces: textures, webs, sheets) (:mod:`padim.core.tiling`).
TILE_STATISTICS = ("position", "shared")
#: ``expect``: the changes a line makes to its pictures that the calibration covers (:mod:`padim.models.data.changes`),
#: by name; each preset is a list of ``change=bound``. ``typical`` is the small changes every line has, as
#: benchmarks/quality.py draws them (lamp +-10%, contrast +-10%, a part 1-3 px off, 1 degree, slight defocus,
#: JPEG 80); ``stable`` a fixture under controlled light; ``rough`` twice typical.
EXPECT_PRESETS = {
    "stable": "",
    "typical": "brightness=0.1,contrast=0.1,shift=3,rotate=1,blur=1,jpeg=80",
    "rough": "brightness=0.2,contrast=0.2,shift=6,rotate=2,blur=1.5,jpeg=60",
}
#: ``expect``: the cover sized by the training pictures' own spread (:mod:`padim.models.data.spread`), measured when
#: the fit starts and stored as the bounds it chose.
EXPECT_AUTO = "auto"
#: ``expect auto``: each bound is how far the training pictures wander times this, so the edge of what the line
#: showed lies inside the cover (a uniform draw within the bound rarely lands at its own edge).
EXPECT_AUTO_MARGIN = 1.5
DEVICES = ("auto", "cpu", "cuda")
PRECISION_DTYPES = ("auto", "float16", "float32")
#: ``train --precision``: the backbone's arithmetic (the Gaussian part is float32 at every precision); ``int8`` is
#: the backbone quantised from the training pictures, run by ONNX Runtime on the CPU.
PRECISIONS = ("fp32", "bf16", "fp16", "int8")
#: ``train --precision auto``: chosen by the machine the fit runs on (:func:`padim.models.devices.choose_precision`).
PRECISION_AUTO = "auto"


def spelled_precision(precision: str) -> str:
    """``train --precision`` as a description spells it, beside an export's ``float32``, ``int8`` and ``fp16``."""
    return "float32" if precision == "fp32" else precision


#: ``padim export --format``: an ONNX graph, an OpenVINO IR, a Triton model repository.
EXPORT_FORMATS = ("onnx", "openvino", "triton")
#: ``padim export --precision``: the backbone in float32, int8 (CPU: ONNX Runtime, OpenVINO), fp16 (CUDA) or bf16
#: (OpenVINO's bfloat16 inference on CPUs with AVX512-BF16 or AMX).
EXPORT_PRECISIONS = ("float32", "int8", "fp16", "bf16")
#: ... as ``export --precision`` spells them, the way ``train --precision`` does (``fp32``); ``float32`` still read.
EXPORT_PRECISION_FLAGS = {"fp32": "float32", "int8": "int8", "fp16": "fp16", "bf16": "bf16"}
#: What runs the scorer (``--runtime``, ``PADIM_RUNTIME``); ``auto`` is chosen in :mod:`padim.models.deploy.runtimes`.
RUNTIMES = ("auto", "torch", "onnxruntime", "openvino")
#: Images per forward pass (``--batch-size``, :class:`~padim.models.config.PadimConfig`, ``padim.load``).
DEFAULT_BATCH_SIZE = 16
#: Threads decoding images (``--decode-workers``, the config, the Python API, the service's ``PADIM_DECODE_WORKERS``).
DEFAULT_WORKERS = 2


def parse_tiles(text: str) -> tuple[int, int] | str:
    """``"3x2"`` -> ``(3, 2)`` (rows x columns, ``--tiles`` and YAML); anything else is returned as it is (the
    configuration's validation names it)."""
    parts = text.lower().replace(" ", "").split("x")
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        return int(parts[0]), int(parts[1])
    return text


def install_extra(extra: str) -> str:
    """How to install an extra, for the messages that ask for one (the package is not on the package index yet)."""
    return f"pip install '.[{extra}]' in padim's source folder"


#: The presets ``--config NAME`` reads: configs/*.yaml, installed as ``padim/configs/`` (setup.py).
PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs"


def presets() -> dict[str, Path]:
    """The shipped presets by name (``paper``, ``resnet18``, ...): what ``--config NAME`` reads."""
    return {path.stem: path for path in sorted(PRESETS_DIR.glob("*.yaml"))}
