"""Allowed values of configuration options, importable without torch (``padim --help`` lists them)."""

REDUCTIONS = ("random", "semi_orthogonal")
DEVICES = ("auto", "cpu", "cuda")
PRECISION_DTYPES = ("auto", "float16", "float32")
#: ``padim export --format``: an ONNX graph, an OpenVINO IR, a Triton model repository.
EXPORT_FORMATS = ("onnx", "openvino", "triton")
#: What runs the scorer (``--runtime``, ``PADIM_RUNTIME``); ``auto`` is chosen in :mod:`padim.models.runtimes`.
RUNTIMES = ("auto", "torch", "onnxruntime", "openvino")
