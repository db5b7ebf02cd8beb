"""Everything between pictures and verdicts, on :mod:`padim.core`. A table of contents:

At the top, what a detector *is* and how it is kept:

- ``config``, ``choices``: what decides a detector, and the allowed values (one place for defaults).
- ``errors``: the error family's cases and the one table of what each becomes (exit / HTTP status).
- ``model``: the scoring ``nn.Module`` (embedding, Mahalanobis distance, maps), statistics as buffers.
- ``detector``: the model with its calibration and provenance (:class:`PadimDetector`).
- ``scorer``: the :class:`~padim.models.scorer.Scorer` protocol every scorer implements (torch,
  ONNX Runtime, OpenVINO), shaped as the service and the command line use it.
- ``devices``: which device runs what (per runtime), and the CUDA settings (TF32 off).
- ``verdicts``: the per-image result from a score and a calibration.
- ``heatmaps``: the anomaly map drawn over the picture, for people.
- ``model_file``: the file format, above the types it saves (detectors, fits in progress).
- ``training``: whole training runs (new, resumed, partial, merged) that end in a model file.
- ``api``: the Python API that ``import padim`` exposes (``padim.fit``, ``padim.load``).

Rooms, each opening with what it holds and may import:

- ``features/``: backbones (networks, weights) and the per-pixel embedding.
- ``data/``: decoding images, generated data sets.
- ``fit/``: a fit in progress (one backbone pass, the finish), its memory plan, distributed shards.
- ``deploy/``: export to ONNX / OpenVINO / Triton, and the inference runtimes that run exports.
- ``evaluation/``: metrics on a labelled set, and the HTML report.

Imports point down this list's dependencies, never back (``tests/test_layers.py`` checks it).
Names are resolved on first use (PEP 562), so that ``padim.models.choices`` and the command
line's ``--help`` do not import torch.
"""

from padim.core.lazy import lazy_exports

EXPORTS = {
    "features.backbones": ("BACKBONES", "BackboneSpec", "WeightsInfo", "build_backbone"),
    "config": ("PadimConfig",),
    "detector": ("PadimDetector", "Provenance"),
    "devices": ("CROSS_DEVICE_RTOL", "resolve_device", "runtime_device"),
    "deploy.export": ("export_detector",),
    "deploy.runtimes": ("DeployedDetector", "load_scorer"),
    "errors": (
        "ConfigError",
        "DoesNotFit",
        "ExportError",
        "FitError",
        "ImageError",
        "ImageTooLarge",
        "NonFiniteScoreError",
        "UsageError",
        "WeightsError",
    ),
    "features.embedding": ("Embedding", "FeatureEmbedder", "FeatureExtractor"),
    "fit.in_progress": ("Fit", "TrainingImage"),
    "data.images": ("list_images", "open_image"),
    "model": ("PadimModel", "ScoreOutput"),
    "model_file": ("load_detector", "load_fit", "save_detector", "save_fit"),
    "scorer": ("Scorer",),
    "training": ("FitReport", "fit_detector", "fit_partial", "merge_fits", "train", "training_images"),
    "verdicts": ("Verdict", "verdict"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
