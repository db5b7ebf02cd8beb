"""Running a detector elsewhere: export to one graph, and the inference runtimes that run it.

``export`` (the scorer as one ONNX graph, OpenVINO IR, a Triton model repository),
``runtimes`` (torch, ONNX Runtime or OpenVINO behind the :class:`~padim.models.scorer.Scorer`
protocol; :func:`~padim.models.deploy.runtimes.load_scorer`).

May import: :mod:`padim.core`, every top-level module of :mod:`padim.models` but
:mod:`padim.models.api` and :mod:`padim.models.training`, and :mod:`padim.models.data`,
:mod:`padim.models.features`.
"""
