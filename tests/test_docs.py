"""The docs: a README a newcomer reads first, pages that build with no broken link, examples that run.

Every ``python`` block of the README and of ``docs/`` is run as written (on a generated data set
at ``data/weave``, as the examples assume), each page's blocks in order in one namespace; every
``padim ...`` line of a ``bash`` block is parsed by the real command line, so a renamed flag or
command fails here.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from padim.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path, language: str) -> list[str]:
    return blocks_of(path.read_text(), language)


def blocks_of(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as mkdocs' toc makes them."""
    found = set()
    for heading in re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
        found.add(re.sub(r"[-\s]+", "-", slug))
    return found


def test_the_readme_is_a_front_door():
    """Short, every link leads somewhere, the quick start reaches /score within 15 lines, and the docs are a path
    (every page in mkdocs' navigation: its strict build fails on one left out)."""
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 120
    for target in re.findall(r"\]\(([^)#]+\.(?:md|png|txt)|LICENSE)(?:#([\w-]+))?\)", readme):
        path, anchor = target
        assert (ROOT / path).is_file(), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in anchors(ROOT / path), f"README links to {path}#{anchor}, which has no such heading"
    assert "(docs/getting-started.md)" in readme and "(CONTRIBUTING.md)" in readme and "(LICENSE)" in readme
    start = next(i for i, line in enumerate(lines) if line.startswith("## Quick start"))
    assert any("curl" in line and "/score" in line for line in lines[start : start + 15])
    nav = (ROOT / "mkdocs.yml").read_text()
    assert {p.name for p in (ROOT / "docs").glob("*.md")} == set(re.findall(r"([\w-]+\.md)$", nav, re.M))


def test_the_readmes_quick_start_answers_as_it_shows(model_file, dataset, tmp_path):
    """The quick start's serve and curl, run as written against a real server of a model named as there; the
    answer has the keys the README's JSON shows."""
    import json
    import os

    from helpers import running_server

    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") :]
    (block,) = blocks_of(quick, "bash")[:1]
    words = [shlex.split(line, comments=True) for line in block.splitlines()]
    (serve,) = [w for w in words if w[:2] == ["padim", "serve"]]
    (curl,) = [line for line in block.splitlines() if line.startswith("curl ")]
    shown = json.loads(blocks_of(quick, "json")[0])
    shutil.copyfile(model_file, tmp_path / serve[2])
    shutil.copyfile(dataset / "test" / "hole" / "000.png", tmp_path / "part.png")
    with running_server(tmp_path, [tmp_path / serve[2]]) as server:
        command = curl.split(" #")[0].replace("http://127.0.0.1:8000", server.url)
        result = subprocess.run(
            ["bash", "-c", f"set -euo pipefail; {command}"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
            env=os.environ,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert set(answer) == set(shown) and answer["is_anomaly"] is True
    assert answer["model"]["name"] == Path(serve[2]).stem == shown["model"]["name"]


def test_ci_runs_the_readmes_test_command_as_written():
    readme = (ROOT / "README.md").read_text()
    (command,) = re.findall(r"^(.*?)\s+# 3\. tests$", readme, re.M)
    assert "tests/setup-system.sh" in command and "pytest" in command
    ci = (ROOT / ".ci" / "run").read_text()
    assert any(line.startswith(command) for line in ci.splitlines()), f"{command!r} is not a line of .ci/run"
    assert "export PADIM_TEST_REQUIRE=all" in ci


def test_the_site_builds_with_no_broken_link(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    assert mkdocs, "mkdocs is a test dependency (pip install -e '.[test]')"
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "calibration" / "index.html").is_file()


def command_lines(path: Path) -> list[str]:
    """Every ``padim ...`` line of the page's bash blocks (continuations joined, comments dropped)."""
    lines = []
    for block in blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["padim"]:  # up to a redirect or the next command
                ends = [i for i, w in enumerate(words) if w in (">", ">>", "|", "&&", ";")]
                lines.append(words[1 : ends[0] if ends else None])
    return lines


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_in_the_docs_parses(page):
    parser = build_parser()
    for words in command_lines(page):
        if words[-1:] == ["--help"] or not words:
            continue
        try:
            parser.parse_args(words)
        except SystemExit:
            pytest.fail(f"{page.name}: `padim {' '.join(words)}` does not parse")


def test_the_command_checker_catches_a_renamed_flag():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "data", "--output", "m.padim", "--no-such-flag"])


PYTHON_PAGES = [p for p in PAGES if blocks(p, "python")]


def test_the_docs_have_python_examples():
    assert {p.name for p in PYTHON_PAGES} >= {"python-api.md"}


@pytest.fixture(scope="module")
def examples_data(dataset) -> Path:
    """The generated line in the examples' layout (``data/weave``), smaller: 10 training pictures and 2 of each
    test folder. An example's claim is that it runs as written; a fit of 30 pictures at the default 224 px would
    only take three times as long."""
    from helpers import made_once

    def make(root: Path) -> None:
        for folder in sorted(p for p in dataset.rglob("*") if p.is_dir() and not any(p.glob("*/"))):
            target = root / "weave" / folder.relative_to(dataset)
            target.mkdir(parents=True)
            for picture in sorted(folder.glob("*.png"))[: 10 if "train" in folder.parts else 2]:
                shutil.copy(picture, target)

    return made_once("examples-data", make)


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: p.name)
def test_every_python_example_runs(page, examples_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(examples_data)
    namespace: dict = {}
    for number, code in enumerate(blocks(page, "python")):
        exec(compile(code, f"{page.name} block {number + 1}", "exec"), namespace)  # noqa: S102 - our own docs
    if "import padim" in page.read_text():  # a page about padim's API ends with a prediction (not a receiver's code)
        assert any(isinstance(v, object) and type(v).__name__ == "Prediction" for v in namespace.values())


def test_the_admin_curl_examples_run_against_a_live_server(model_file, tmp_path):
    """The curl block of docs/http-api.md marked `run by tests/test_docs.py`, line by line, in order."""
    import os

    import httpx
    from helpers import running_server

    from padim.models.repository import Repository

    page = (ROOT / "docs" / "http-api.md").read_text()
    block = re.search(r"<!-- run by tests/test_docs.py -->\n```bash\n(.*?)^```", page, re.S | re.M).group(1)
    assert block.count("curl ") >= 6
    repository = Repository(tmp_path / "repo")
    repository.activate("weave", repository.add("weave", model_file).version)
    shutil.copyfile(model_file, tmp_path / "weave-retrained.padim")
    env = {"PADIM_ADMIN_KEY": "docs-admin", "PADIM_API_KEY": "docs-scoring"}
    with running_server(tmp_path, [], env=env, args=("--repository", str(tmp_path / "repo"))) as server:
        script = "set -euo pipefail\n" + block.replace("http://127.0.0.1:8000", server.url)
        result = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, **env}
        )
        versions = httpx.get(server.url + "/models/weave/versions", headers={"x-api-key": "docs-admin"}).json()
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"version":2' in result.stdout.replace(" ", "") and '"active":true' in result.stdout.replace(" ", "")
    assert [(v["version"], v["active"]) for v in versions["versions"]] == [(1, True)]  # 2 was deleted at the end


def test_the_record_curl_examples_run_against_a_live_server(model_file, dataset, tmp_path):
    """The curl block of docs/record.md marked `run by tests/test_docs.py (record)`, in order."""
    import os

    import httpx
    from helpers import running_server

    from padim.models.repository import Repository

    page = (ROOT / "docs" / "record.md").read_text()
    block = re.search(r"<!-- run by tests/test_docs.py \(record\) -->\n```bash\n(.*?)^```", page, re.S | re.M).group(1)
    assert block.count("curl ") >= 7
    repository = Repository(tmp_path / "repo")
    repository.activate("weave", repository.add("weave", model_file).version)
    shutil.copyfile(dataset / "test" / "hole" / "000.png", tmp_path / "part.png")
    env = {
        "PADIM_ADMIN_KEY": "docs-admin",
        "PADIM_REVIEW_KEY": "docs-review",
        "PADIM_RUNTIME": "torch",
        "PADIM_RECORD_DIR": str(tmp_path / "record"),
    }
    with running_server(tmp_path, [], env=env, args=("--repository", str(tmp_path / "repo"))) as server:
        script = "set -euo pipefail\n" + block.replace("http://127.0.0.1:8000", server.url)
        result = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, **env}
        )
        versions = httpx.get(server.url + "/models/weave/versions", headers={"x-api-key": "docs-admin"}).json()
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"state":"succeeded"' in result.stdout.replace(" ", "") and '"label":"normal"' in result.stdout
    assert '"code":"too_few_line_pictures"' in result.stdout.replace(" ", "")
    assert (tmp_path / "picture.png").read_bytes() == (tmp_path / "part.png").read_bytes()
    assert (tmp_path / "heatmap.png").read_bytes().startswith(b"\x89PNG")
    assert [(v["version"], v["active"]) for v in versions["versions"]] == [(1, True), (2, False)]
    assert len(versions["versions"][1]["update"]["learned_from"]) == 1
