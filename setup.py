"""Package discovery from the source tree (metadata is in pyproject.toml).

The import package ``padim`` is assembled from the top-level folders the project is laid out
in: ``cli/`` is ``padim`` itself, ``core/`` is ``padim.core``, ``models/`` is ``padim.models``,
``service/`` is ``padim.service``. Every folder with an ``__init__.py`` below them becomes a
subpackage, so a new module or subpackage cannot be left out of the wheel
(``tests/test_packaging.py`` builds the wheel and compares it with the tree). The inspection
console's static files (``service/console/``) and the report's template
(``models/evaluation/report.html``) ship as package data, and so do the presets
(``configs/*.yaml``, as ``padim/configs/``: ``padim train --config paper``).
"""

from setuptools import find_packages, setup

ROOTS = {"padim": "cli", "padim.core": "core", "padim.models": "models", "padim.service": "service"}
#: Folders of data only, installed beside them: the presets `padim train --config NAME` reads.
DATA = {"padim.configs": "configs"}


def discover() -> list[str]:
    packages = []
    for package, folder in ROOTS.items():
        packages += [package, *(f"{package}.{sub}" for sub in find_packages(folder))]
    return packages + list(DATA)


setup(
    packages=discover(),
    package_dir={**ROOTS, **DATA},
    package_data={
        "padim.service": ["console/*.html", "console/*.js", "console/*.css"],
        "padim.models.evaluation": ["*.html"],
        "padim.configs": ["*.yaml"],
    },
)
