"""Running a detector elsewhere: export to one graph, quantised exports, and the runtimes that run them.

``export`` (the scorer as one ONNX graph, OpenVINO IR, a Triton model repository), ``quantise`` (INT8, float16
and bfloat16 exports, gated against float32 with their own threshold), ``runtimes`` (torch, ONNX Runtime or
OpenVINO behind the :class:`~padim.models.scorer.Scorer` protocol; :func:`~padim.models.deploy.runtimes.load_scorer`).

May import: :mod:`padim.core`, :mod:`padim.models.errors`, :mod:`padim.models.choices`, :mod:`padim.models.families`,
:mod:`padim.models.options`, :mod:`padim.models.devices`, :mod:`padim.models.data`, :mod:`padim.models.config`,
:mod:`padim.models.features`, :mod:`padim.models.scoring`, :mod:`padim.models.scorer`, :mod:`padim.models.fit`.
"""
