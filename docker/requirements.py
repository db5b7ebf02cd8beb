"""Print the project's dependencies and those of the extras named, one requirement a line, from pyproject.toml.

The Dockerfile installs these before it copies the sources, so that the layer of the dependencies (about 6 GB,
most of the build's time) is reused by a rebuild after a change to the code, where the engine keeps its cache:

    python3 docker/requirements.py onnxruntime,postgres > requirements.txt
    pip install -c constraints.txt -r requirements.txt

Standard library only (it runs before anything is installed); Python 3.11 or newer (tomllib).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise SystemExit(f"{pyproject}: no extra {', '.join(unknown)} (there are: {', '.join(sorted(optional))})")
    found = list(project["dependencies"])
    for extra in extras:
        found += optional[extra]
    return list(dict.fromkeys(found))


if __name__ == "__main__":
    asked = [e.strip() for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e.strip()]
    print("\n".join(requirements(Path(__file__).resolve().parent.parent / "pyproject.toml", asked)))
