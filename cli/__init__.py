"""padim: PaDiM visual anomaly detection (streaming fit, calibrated verdicts, HTTP service).

The Python API (see docs/python-api.md)::

    import padim
    detector = padim.fit("data/train/good", weights="random")   # or padim.load("line3.padim")
    result = detector.predict("part.png")                       # score, is_anomaly, anomaly_map, heatmap()

The package is assembled from the repository's top-level folders: ``padim.core`` is
``core/``, ``padim.models`` is ``models/``, ``padim.service`` is ``service/``, and this
folder (``cli/``) is ``padim`` itself: the command line's entry point (``padim.cli``) and
its commands (``padim.commands``, one module each). Imports point one way: cli -> service ->
models -> core (``tests/test_layers.py`` checks it). The API names are imported on first use,
so that ``padim --help`` and ``padim health`` load no torch.
"""

from padim.core import DISTRIBUTION, __version__, lazy_exports

_API = {"models.api": ("Detector", "Prediction", "fit", "load"), "models.config": ("PadimConfig",)}
_names, __getattr__, _dir = lazy_exports(__name__, _API)
__all__ = ["DISTRIBUTION", "__version__", *_names]


def __dir__():
    return sorted(set(globals()) | set(_names))
