"""The wheel, as `pip install .` builds it: every module of the tree, installed non-editable, runs.

The test suite itself runs on an editable install, which reads the source folders directly and
would hide a module the wheel leaves out. Here the wheel is built, compared file by file with
the tree, installed with ``--no-deps`` into a fresh virtual environment (its dependencies come
from this environment's site-packages through a ``.pth`` line, which does not run the editable
install's import hook), and used: every module imported, ``padim --help``, a fit, a server.

That environment is what ``pip install .`` gives, without the extras: the optional packages and the test
tools (:data:`NOT_INSTALLED`) cannot be imported there, so a module that needed one on import, or a command that
needed one without being asked for what it provides, fails here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest
from helpers import running_server

pytestmark = pytest.mark.system  # a wheel built and installed into a new environment

#: What ``pip install .`` does not install: the extras' packages (pyproject.toml) and the test tools, by import name.
NOT_INSTALLED = (
    "onnx", "onnxscript", "onnxruntime", "openvino", "nncf", "tritonclient", "psycopg", "watchdog", "paho",
    "cv2", "asyncua", "anomalib", "pytest", "selenium", "schemathesis", "mkdocs", "kubernetes_validate",
)  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]
#: Source folder of each top-level package, as setup.py maps them.
FOLDERS = {
    "cli": "padim",
    "core": "padim/core",
    "models": "padim/models",
    "service": "padim/service",
    "configs": "padim/configs",
}


def run(*command, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=600, **kwargs)
    said = f"{' '.join(map(str, command))}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0 or not check, said
    return result


#: What a build needs, as the Dockerfile copies it.
SOURCES = ("pyproject.toml", "setup.py", "README.md", *FOLDERS)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a clean copy of the sources: a build/ folder left in the tree would be reused."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(
            ROOT / name,
            source / name,
            **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
        )
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, source)
    (built,) = out.glob("padim_inspect-*.whl")
    return built


def tree_files() -> set[str]:
    """Every file the package is made of, by its path inside the installed package."""
    files = set()
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.add(f"{package}/{path.relative_to(ROOT / folder).as_posix()}")
    return files


def test_the_wheel_holds_every_file_of_the_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packaged = {n for n in names if n.startswith("padim/")}
    assert packaged == tree_files(), {
        "missing": sorted(tree_files() - packaged),
        "extra": sorted(packaged - tree_files()),
    }
    assert "padim/service/routes/score.py" in packaged
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Name: padim-inspect" in metadata
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "padim = padim.cli:main" in entry_points


def dependencies(folder: Path) -> Path:
    """``folder`` with links to this environment's packages but :data:`NOT_INSTALLED` (and their metadata)."""
    hidden = {name.lower() for name in NOT_INSTALLED}
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        top = entry.name.split("-")[0].split(".")[0].lower()
        if top not in hidden and not entry.name.endswith(".pth"):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", venv)  # with its own pip: the console script must run its own python
    site = Path(
        run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    )
    (site / "dependencies.pth").write_text(f"{dependencies(tmp_path_factory.mktemp('dependencies'))}\n")
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel)
    return venv


def test_every_module_imports_from_the_installed_wheel(installed):
    modules = sorted(
        f.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for f in tree_files()
        if f.endswith(".py") and not f.endswith("__main__.py")
    )
    code = (
        "import importlib, padim, sys\n"
        f"for name in {modules!r}:\n    importlib.import_module(name)\n"
        "print(padim.__file__, padim.__version__)"
    )
    where, version = run(installed / "bin" / "python", "-c", code, cwd=installed).stdout.split()
    assert where.startswith(str(installed)) and "site-packages" in where, where  # not the source tree
    assert version != "0+unknown"


def test_installed_command_trains_predicts_and_serves_without_the_extras(installed, dataset, tmp_path):
    """``pip install .``: train (a preset shipped in the wheel), predict and serve, with no extra installed."""
    hidden = run(installed / "bin" / "python", "-c", "import onnxruntime", check=False)
    assert hidden.returncode == 1 and "No module named 'onnxruntime'" in hidden.stderr
    padim = installed / "bin" / "padim"
    assert "train" in run(padim, "--help").stdout
    model = tmp_path / "weave.padim"
    good = dataset / "train" / "good"
    run(padim, "-q", "train", good, "-o", model, "--config", "paper", "--weights", "random", "--image-size", "64")
    header = json.loads(run(padim, "info", model).stdout)["header"]
    assert header["config"]["neighbourhood"] == 1 and header["config"]["shrinkage"] == 0  # the paper's preset
    said = run(padim, "-q", "predict", model, dataset / "test" / "hole", "-o", tmp_path / "out", "--no-maps").stdout
    assert json.loads(said)["runtime"] == "torch"  # auto, without ONNX Runtime installed
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert rows and all(row["is_anomaly"] for row in rows)
    with running_server(tmp_path, [model], padim=(str(padim),)) as server:
        image = (dataset / "test" / "hole" / "000.png").read_bytes()
        answer = httpx.post(server.url + "/score", content=image, headers={"content-type": "image/png"}, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"]["name"] == "weave"
        for page in ("/", "/console/console.js", "/console/console.css"):  # the console ships in the wheel
            assert httpx.get(server.url + page, timeout=10).status_code == 200, page
