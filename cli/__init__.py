"""padim: PaDiM visual anomaly detection (streaming fit, calibrated verdicts, HTTP service).

The package is assembled from the repository's top-level folders: ``padim.core`` is
``core/``, ``padim.models`` is ``models/``, ``padim.service`` is ``service/``, and this
folder (``cli/``) is ``padim`` itself, which holds the command line (``padim.cli``).
Imports point one way: cli -> service -> models -> core.
"""

from padim.core.version import DISTRIBUTION, __version__

__all__ = ["DISTRIBUTION", "__version__"]
