"""padim: PaDiM visual anomaly detection (streaming fit, calibrated scores, HTTP service).

The package is assembled from the repository's top-level folders: ``padim.core`` is
``core/``, ``padim.models`` is ``models/``, ``padim.service`` is ``service/``, and this
folder (``cli/``) is ``padim`` itself: the command line and its helpers.
"""

__version__ = "0.1.0"
