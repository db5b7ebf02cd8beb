"""Everything between pictures and verdicts, on :mod:`padim.core`. A table of contents:

At the top, what decides a detector and the doors into the rooms:

- ``options``: every option declared once, in groups (help, check, flag, JSON, what older files computed).
- ``config``, ``choices``: the configuration those groups make, and the allowed values (one place for defaults).
- ``families``: the backbone families (ResNet, VGG, EfficientNet, MobileNetV3, ConvNeXt): each backbone's stages,
  channels and strides, its default stages and ``D``, the keys a detector uses, what the memory plan needs.
- ``errors``: the error family's cases and the one table of what each becomes (exit / HTTP status).
- ``devices``: which device runs what (per runtime), and the CUDA settings (TF32 off).
- ``scorer``: the :class:`~padim.models.scorer.Scorer` protocol every scorer implements (torch,
  ONNX Runtime, OpenVINO), shaped as the service and the command line use it.
- ``repository``: the service's model repository: numbered versions of each model on disk.
- ``api``: the Python API that ``import padim`` exposes (``padim.fit``, ``padim.load``).

Rooms, each opening with what it holds and may import:

- ``data/``: pictures in: decoding, framing (region, resize, tiles), changed copies, generated data sets.
- ``features/``: backbones (networks, weights) and the per-pixel embedding.
- ``scoring/``: a fitted detector scoring pictures: the scoring module, the torch scorer, verdicts, heat maps.
- ``fit/``: a fit in progress, its memory plan and shards, whole training runs, learning from reviews, and
  the model file they write.
- ``deploy/``: export to ONNX / OpenVINO / Triton, quantised exports, and the runtimes that run them.
- ``evaluation/``: metrics on a labelled set, drift, and the HTML reports.

Imports point down the rooms' order (``tests/test_layers.py``: choices, families, errors, options, devices, data,
config, features, scoring, scorer, fit, deploy, evaluation, repository, api), never back.
Names are resolved on first use (PEP 562), so that ``padim.models.choices`` and the command
line's ``--help`` do not import torch.
"""

from padim.core import lazy_exports

EXPORTS = {
    "families": ("BACKBONES", "FAMILIES", "BackboneSpec"),
    "features.backbones": ("WeightsInfo", "build_backbone"),
    "config": ("PadimConfig",),
    "scoring.detector": ("PadimDetector", "Provenance"),
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
    "scoring.model": ("PadimModel", "ScoreOutput"),
    "fit.model_file": ("load_detector", "load_fit", "save_detector", "save_fit"),
    "scorer": ("Scorer",),
    "fit.training": ("FitReport", "fit_detector", "fit_partial", "merge_fits", "train", "training_images"),
    "scoring.verdicts": ("Verdict", "verdict"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
