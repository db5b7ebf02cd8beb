"""Backbones, features, the scoring model, the detector, and how it is fitted, on :mod:`padim.core`.

Where things are: ``backbones`` (which networks, which weights), ``config`` and ``choices``
(what decides a detector), ``images`` (reading pictures), ``features`` (backbone stages and the
embedding), ``model`` (the scoring ``nn.Module``), ``detector`` (model + calibration +
provenance), ``verdicts`` (the per-image result), ``fitting`` (a fit in progress), ``training``
(whole runs: fit, resume, partial, merge), ``distributed`` (torchrun), ``serialization`` (the
model file), ``export`` (the scorer as one ONNX / OpenVINO graph), ``runtimes`` (torch,
onnxruntime or OpenVINO behind one interface), ``evaluation`` (metrics), ``report`` (the HTML evaluation report), ``synthetic`` (generated data
sets), ``visualize`` (heat maps), ``api`` (the Python API that ``import padim`` exposes).

Names are resolved on first use (PEP 562), so that ``padim.models.choices`` and the command
line's ``--help`` do not import torch.
"""

from padim.core.lazy import lazy_exports

EXPORTS = {
    "backbones": ("BACKBONES", "BackboneSpec", "WeightsError", "WeightsInfo", "build_backbone"),
    "config": ("ConfigError", "PadimConfig"),
    "detector": ("PadimDetector", "Provenance", "resolve_device"),
    "export": ("ExportError", "export_detector"),
    "features": ("Embedding", "FeatureEmbedder", "FeatureExtractor"),
    "fitting": ("Fit", "TrainingImage"),
    "images": ("ImageError", "ImageTooLarge", "list_images", "open_image"),
    "model": ("PadimModel", "ScoreOutput"),
    "runtimes": ("DeployedDetector", "load_scorer"),
    "training": ("FitError", "FitReport", "fit_detector", "fit_partial", "merge_fits", "train", "training_images"),
    "verdicts": ("NonFiniteScoreError", "Verdict", "verdict"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
