"""padim: PaDiM visual anomaly detection (streaming fit, calibrated scores, HTTP service).

The package is assembled from the repository's top-level folders: ``padim.core`` is
``core/``, ``padim.models`` is ``models/``, ``padim.service`` is ``service/``, and this
folder (``cli/``) is ``padim`` itself: the command line and its helpers.
"""

from importlib.metadata import PackageNotFoundError, version

#: The distribution name on the package index ("padim" there is an unrelated project).
DISTRIBUTION = "padim-inspect"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
