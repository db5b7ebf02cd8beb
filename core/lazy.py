"""Package attributes imported on first use (PEP 562): ``padim --help`` and ``padim health`` need no torch.

Example:
    >>> names, get, _ = lazy_exports("padim.core", {"calibration": ("fold_of",)})
    >>> names
    ['fold_of']
    >>> get("fold_of").__module__
    'padim.core.calibration'
"""

import importlib


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """``(__all__, __getattr__, __dir__)`` for a package whose ``exports`` maps submodule -> names."""
    module_of = {name: module for module, names in exports.items() for name in names}
    names = sorted(module_of)

    def __getattr__(name: str):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{module_of[name]}", package), name)

    return names, __getattr__, lambda: names
