"""Allowed values of configuration options, importable without torch (``padim --help`` lists them)."""

REDUCTIONS = ("random", "semi_orthogonal")
DEVICES = ("auto", "cpu", "cuda")
PRECISION_DTYPES = ("auto", "float16", "float32")
