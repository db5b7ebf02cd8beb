"""The tests' system components (tests/components.py) and their setup script, on a PATH that lacks them.

Where a component is missing, the tests that need it skip with one reason naming it and the
command that provides it; under ``PADIM_TEST_REQUIRE`` they fail instead. ``tests/setup-system.sh``
installs nothing without root and says so, and as root asks apt-get for every missing package
at once. Each case runs in a subprocess with a PATH of its own (fake ``id``, ``apt-get`` and
``dpkg-query`` where the script would reach the system), so nothing here installs anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from components import COMPONENTS

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = """
import pytest

@pytest.mark.docker
def test_needs_docker():
    pass

@pytest.mark.browser
def test_needs_a_browser():
    pass

@pytest.mark.promtool
def test_needs_promtool():
    pass

@pytest.mark.postgres
def test_needs_postgres():
    pass

@pytest.mark.mosquitto
def test_needs_mosquitto():
    pass

@pytest.mark.haproxy
def test_needs_haproxy():
    pass

@pytest.mark.helm
def test_needs_helm():
    pass

@pytest.mark.tmpfs
def test_needs_a_small_disk():
    pass

def test_needs_nothing():
    pass

@pytest.mark.cuda
@pytest.mark.docker
def test_needs_a_gpu_and_docker():
    pass
"""


def bare_path(tmp_path: Path, tools=("bash", "dirname", "grep", "cat", "env")) -> Path:
    """A PATH folder with the shell tools the setup script uses and none of the components."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    (bin_dir / "python3").symlink_to(sys.executable)
    return bin_dir


def fake(bin_dir: Path, name: str, script: str) -> None:
    (bin_dir / name).write_text(f"#!{shutil.which('bash')}\n{script}\n")
    (bin_dir / name).chmod(0o755)


def environment(bin_dir: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADIM_TEST_")}
    # PostgreSQL's server programs are found in /usr/lib/postgresql, not on PATH: point them elsewhere
    return {
        **env,
        "PATH": str(bin_dir),
        "PYTHONPATH": str(ROOT / "tests"),
        "PADIM_TEST_POSTGRES_BIN": str(bin_dir / "no-postgresql"),
        "PADIM_TEST_MOSQUITTO": str(bin_dir / "no-mosquitto"),
        "PADIM_TEST_HAPROXY": str(bin_dir / "no-haproxy"),
        **extra,
    }


def run_sample(tmp_path: Path, *options: str, **extra: str) -> subprocess.CompletedProcess:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    # conftest's pytest_configure would hide GPUs; here the sample needs the marker only
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "components",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rs",
        "--strict-markers",
        *options,
        "test_sample.py",
    ]
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a GPU\n    system: needs a system\n")
    return subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        # the installed plugins (Schemathesis, ...) are not what is tested, and take seconds to import
        env=environment(bare_path(tmp_path), CUDA_VISIBLE_DEVICES="", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **extra),
    )


def test_a_missing_component_skips_its_tests_with_the_reason_and_the_command(tmp_path):
    result = run_sample(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b1 passed, 9 skipped\b", result.stdout), result.stdout
    skipped = re.findall(r"^SKIPPED \[\d+\] \S+ (.*)$", result.stdout, re.M)
    for marker in COMPONENTS:
        (reason,) = [r for r in skipped if r.startswith(f"{marker}: ")]
        assert "bash tests/setup-system.sh" in reason and f"-m 'not {marker}'" in reason, reason
    assert "no CUDA device" in " ".join(skipped)  # the GPU test skips for the GPU, before the engine is looked for
    assert "system components missing" in result.stdout
    assert "no `docker` command" in result.stdout and "no chromium and no chromedriver" in result.stdout


def test_a_test_that_needs_a_component_is_a_system_test(tmp_path):
    inner = run_sample(tmp_path, "-m", "not system", PADIM_TEST_REQUIRE="all")  # nothing looked for, nothing fails
    assert inner.returncode == 0 and re.search(r"\b1 passed, 9 deselected\b", inner.stdout), inner.stdout


def test_under_padim_test_require_a_missing_component_fails(tmp_path):
    every = run_sample(tmp_path / "all", PADIM_TEST_REQUIRE="all")
    assert every.returncode == 1, every.stdout
    assert re.search(r"\b1 passed, 1 skipped, 8 errors\b", every.stdout), every.stdout
    for marker in COMPONENTS:
        assert re.search(rf"^{marker}: .*\[PADIM_TEST_REQUIRE=all: required\]", every.stdout, re.M), marker
    one = run_sample(tmp_path / "one", PADIM_TEST_REQUIRE="promtool")
    assert re.search(r"\b1 passed, 8 skipped, 1 error\b", one.stdout), one.stdout
    wrong = run_sample(tmp_path / "wrong", PADIM_TEST_REQUIRE="dockr")
    assert wrong.returncode == 4 and "PADIM_TEST_REQUIRE names ['dockr']" in wrong.stderr, wrong.stderr


def test_a_component_given_by_its_variable_is_found_and_a_stub_is_not(tmp_path):
    bin_dir = bare_path(tmp_path)
    fake(bin_dir, "chromium-stub", 'echo "Command requires the chromium snap to be installed" >&2; exit 1')
    fake(bin_dir, "chromium-real", 'echo "Chromium 156.0.8078.73 built on Debian GNU/Linux 12 (bookworm)"')
    fake(bin_dir, "driver", "exit 0")
    check = [sys.executable, str(ROOT / "tests" / "components.py"), "report"]
    for chromium, expected in (("chromium-stub", "does not run"), ("chromium-real", "browser   ok")):
        env = environment(
            bin_dir, PADIM_TEST_CHROMIUM=str(bin_dir / chromium), PADIM_TEST_CHROMEDRIVER=str(bin_dir / "driver")
        )
        report = subprocess.run(check, capture_output=True, text=True, env=env, timeout=60)
        assert report.returncode == 0 and expected in report.stdout, report.stdout


def test_setup_without_root_installs_nothing_and_says_what_is_missing(tmp_path):
    bin_dir = bare_path(tmp_path)
    log = tmp_path / "apt.log"
    fake(bin_dir, "id", "echo 1000")
    fake(bin_dir, "apt-get", f'echo "$*" >> {log}; exit 3')
    done = subprocess.run(
        ["bash", str(ROOT / "tests" / "setup-system.sh")],
        capture_output=True,
        text=True,
        env=environment(bin_dir),
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not root" in done.stdout and not log.exists()
    for marker in COMPONENTS:
        assert re.search(rf"^  {marker} +missing: ", done.stdout, re.M), done.stdout
    assert "will be skipped" in done.stdout
    required = subprocess.run(
        ["bash", str(ROOT / "tests" / "setup-system.sh")],
        capture_output=True,
        text=True,
        env=environment(bin_dir, PADIM_TEST_REQUIRE="all"),
        timeout=60,
    )
    assert required.returncode == 1 and "required by PADIM_TEST_REQUIRE but missing: " in required.stderr


def test_setup_as_root_asks_apt_get_for_every_missing_package_at_once(tmp_path):
    bin_dir = bare_path(tmp_path, tools=("bash", "dirname", "grep", "cat", "env", "sleep", "seq", "tail"))
    log = tmp_path / "apt.log"
    fake(bin_dir, "id", "echo 0")
    fake(bin_dir, "dpkg-query", "exit 1")  # nothing installed
    fake(bin_dir, "apt-get", f'echo "$*" >> {log}; case " $* " in *" install "*) exit 3;; esac')
    done = subprocess.run(
        ["bash", str(ROOT / "tests" / "setup-system.sh")],
        capture_output=True,
        text=True,
        env=environment(bin_dir, PADIM_TEST_REQUIRE="all"),
        timeout=60,
    )
    installs = [line.split() for line in log.read_text().splitlines() if "install" in line.split()]
    wanted = {p for component in COMPONENTS.values() for p in component.packages}
    assert installs and wanted <= set(installs[0]), installs  # one apt-get call for all of them
    assert "apt-get install" in done.stderr and "failed" in done.stderr
    assert done.returncode == 1, done.stdout  # the fake install failed, and CI requires every component
