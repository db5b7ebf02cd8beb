"""The installed distribution's name and version, from its metadata (no torch import here).

Example:
    >>> from importlib.metadata import version
    >>> DISTRIBUTION, __version__ == version("padim-inspect")
    ('padim-inspect', True)
"""

from importlib.metadata import PackageNotFoundError, version

#: The distribution name on the package index ("padim" there is an unrelated project).
DISTRIBUTION = "padim-inspect"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
