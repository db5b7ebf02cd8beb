"""A fitted detector scoring pictures: pixels in, scores, maps and verdicts out.

``model`` (:class:`~padim.models.scoring.model.PadimModel`: the embedding, Mahalanobis distances, maps and image
scores, statistics as buffers; CUDA graphs of its forward), ``detector`` (the model with its backbone weights,
calibration and provenance: :class:`~padim.models.scoring.detector.PadimDetector`, the torch scorer),
``reduced`` (the int8 scorer a float32 model carries: its gate and threshold), ``verdicts`` (a score and a
calibration -> the per-image verdict), ``heatmaps`` (the anomaly map drawn over the
picture, for people). Reading and writing it is :mod:`padim.models.fit.model_file`.

May import: :mod:`padim.core`, :mod:`padim.models.errors`, :mod:`padim.models.choices`, :mod:`padim.models.families`,
:mod:`padim.models.options`, :mod:`padim.models.devices`, :mod:`padim.models.data`, :mod:`padim.models.config`,
:mod:`padim.models.features`.
"""
