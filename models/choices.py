"""Allowed values of configuration options and the run-option defaults, importable without torch (``padim --help``
lists them). Every default of how a command runs is here, once."""

REDUCTIONS = ("random", "semi_orthogonal")
#: ``image_score``: how an image's score is read from its map (:func:`padim.core.scoring.image_scores`).
IMAGE_SCORES = ("map_max", "patch_max", "top_mean")
#: ``neighbourhood``: side of the per-layer feature average (1: none).
NEIGHBOURHOODS = (1, 3, 5)
#: ``resize``: how the region of interest becomes the model's square input (:mod:`padim.models.data.framing`).
RESIZES = ("squash", "crop", "pad")
DEVICES = ("auto", "cpu", "cuda")
PRECISION_DTYPES = ("auto", "float16", "float32")
#: ``padim export --format``: an ONNX graph, an OpenVINO IR, a Triton model repository.
EXPORT_FORMATS = ("onnx", "openvino", "triton")
#: What runs the scorer (``--runtime``, ``PADIM_RUNTIME``); ``auto`` is chosen in :mod:`padim.models.deploy.runtimes`.
RUNTIMES = ("auto", "torch", "onnxruntime", "openvino")
#: Images per forward pass (``--batch-size``, :class:`~padim.models.config.PadimConfig`, ``padim.load``).
DEFAULT_BATCH_SIZE = 16
#: Threads decoding images (``--workers``, the config, the Python API, the service's ``PADIM_DECODE_WORKERS``).
DEFAULT_WORKERS = 2
