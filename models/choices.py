"""Allowed values of configuration options and the run-option defaults, importable without torch (``padim --help``
lists them). Every default of how a command runs is here, once."""

REDUCTIONS = ("random", "semi_orthogonal")
#: ``image_score``: how an image's score is read from its map (:func:`padim.core.scoring.image_scores`).
IMAGE_SCORES = ("map_max", "patch_max", "top_mean")
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
DEVICES = ("auto", "cpu", "cuda")
PRECISION_DTYPES = ("auto", "float16", "float32")
#: ``padim export --format``: an ONNX graph, an OpenVINO IR, a Triton model repository.
EXPORT_FORMATS = ("onnx", "openvino", "triton")
#: ``padim export --precision``: the backbone in float32, int8 (CPU: ONNX Runtime, OpenVINO) or fp16 (CUDA).
EXPORT_PRECISIONS = ("float32", "int8", "fp16")
#: What runs the scorer (``--runtime``, ``PADIM_RUNTIME``); ``auto`` is chosen in :mod:`padim.models.deploy.runtimes`.
RUNTIMES = ("auto", "torch", "onnxruntime", "openvino")
#: Images per forward pass (``--batch-size``, :class:`~padim.models.config.PadimConfig`, ``padim.load``).
DEFAULT_BATCH_SIZE = 16
#: Threads decoding images (``--workers``, the config, the Python API, the service's ``PADIM_DECODE_WORKERS``).
DEFAULT_WORKERS = 2


def parse_tiles(text: str) -> tuple[int, int] | str:
    """``"3x2"`` -> ``(3, 2)`` (rows x columns, ``--tiles`` and YAML); anything else is returned as it is (the
    configuration's validation names it)."""
    parts = text.lower().replace(" ", "").split("x")
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        return int(parts[0]), int(parts[1])
    return text
