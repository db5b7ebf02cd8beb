"""The tests' Docker image, built in the background from the start of a run.

Building the image is mostly waiting on the package index and unpacking wheels (minutes on 2 cores), so it
starts as soon as a run has collected a Docker test (:func:`start`, from tests/conftest.py), in a process of
its own, while the other tests use the CPU; tests/docker/test_image.py's ``image`` fixture waits for it
(:func:`wait`). Under pytest-xdist the first worker to collect starts it and whichever runs the Docker tests
waits for it: the build's state is in the folder the run's processes share (:func:`state`), and the build is
stopped at the run's end if nobody waited for it (:func:`finish`).

Two builds, one after the other: the Dockerfile's ``deps`` stage, tagged :data:`DEPS` and kept between runs
(the ~6 GB of dependencies: a run after a change to the code reuses it where the engine keeps its images),
then the image itself, :data:`IMAGE`, removed after the tests. The legacy builder: BuildKit needs the buildx
plugin in recent clients, and the Dockerfile builds either way.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import durations
from helpers import run_folder

ROOT = Path(__file__).resolve().parents[1]
BASE = os.environ.get("PADIM_TEST_BASE_IMAGE", "padim-test-base:bookworm")
IMAGE = "padim:test"
DEPS = "padim:test-deps"


def docker(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    with durations.timed("docker"):
        result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])} ... failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def remove_leftovers() -> None:
    """What an earlier run stopped half-way (a CI job killed, kill -9) left behind: its containers, the image they
    hold, build-stage images and dependency images no longer tagged. Each can be 6 GB, and the next build needs the
    room. The tagged dependency image stays: it is the cache."""
    names = docker("ps", "-aq", "--filter", "name=^padim-test-", check=False).stdout.split()
    if names:
        docker("rm", "-f", *names, check=False)
    docker("rmi", "-f", IMAGE, check=False)
    for stage in ("build", "deps"):
        docker("image", "prune", "-f", "--filter", f"label=padim.stage={stage}", check=False)


def free_disk() -> str:
    """The free space where the engine keeps its images: the build needs about 16 GB of it at its peak from an
    empty cache (the 6 GB environment in the deps stage, in the final stage's copy and in that copy's commit)."""
    root = docker("info", "-f", "{{.DockerRootDir}}", check=False).stdout.strip() or "/var/lib/docker"
    try:
        return f"free disk at {root}: {shutil.disk_usage(root).free / 1e9:.1f} GB"
    except OSError as error:
        return f"free disk at {root}: unknown ({error})"


def build_commands() -> list[list[str]]:
    common = ["--force-rm", "--network", "host", "--build-arg", f"CUDA_IMAGE={BASE}", "--build-arg", "BAKE_WEIGHTS="]
    return [
        ["docker", "build", *common, "--target", "deps", "-t", DEPS, str(ROOT)],
        ["docker", "build", *common, "-t", IMAGE, str(ROOT)],
    ]


def state() -> Path:
    """The folder of this run's build: ``pid`` (its process group), ``log``, ``status`` (its exit code and seconds,
    once done)."""
    return run_folder() / "docker-build"


def start() -> bool:
    """Start the build unless this run already did (another worker); whether this call started it."""
    folder = state()
    try:
        folder.mkdir()  # atomic: one worker starts it
    except FileExistsError:
        return False
    remove_leftovers()
    script = " && ".join(shlex.join(command) for command in build_commands())
    # its exit code and seconds, written whole (a rename) for the waiting test to read
    script = f'started=$(date +%s); {script}; echo "$? $(( $(date +%s) - started ))" > status.tmp; mv status.tmp status'
    with open(folder / "log", "w") as log:
        process = subprocess.Popen(
            ["sh", "-c", script],
            cwd=folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "DOCKER_BUILDKIT": "0"},
            start_new_session=True,  # its own group: stopped as a whole at the run's end
        )
    (folder / "pid").write_text(str(process.pid))
    return True


def wait(timeout: float = 1800) -> float:
    """Wait for the build (started here if no one did); its seconds. Raises AssertionError with the end of its log
    and the engine's free disk when it failed."""
    if not state().exists():
        start()
    folder = state()
    deadline = time.monotonic() + timeout
    with durations.timed("docker"):
        while not (folder / "status").exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"the image's build took over {timeout:.0f} s:\n{log_tail(folder)}")
            time.sleep(1)
    code, seconds = (folder / "status").read_text().split()
    if code != "0":
        raise AssertionError(f"docker build failed ({code}):\n{log_tail(folder)}\n{free_disk()}")
    return float(seconds)


def report(line: str) -> None:
    """A line for the run's summary (what the build measured): kept in the run's folder, where the run's first
    process reads it (:func:`reported`), since under pytest-xdist the Docker tests run in a worker."""
    with open(run_folder() / "docker-report.txt", "a") as handle:
        handle.write(line + "\n")


def reported() -> list[str]:
    try:
        return (run_folder() / "docker-report.txt").read_text().splitlines()
    except OSError:
        return []


def log_tail(folder: Path) -> str:
    try:
        return (folder / "log").read_text(errors="replace")[-3000:]
    except OSError:
        return "(no log)"


def finish() -> None:
    """At the run's end: stop a build nobody waited for (an interrupted run, a failed collection)."""
    pid = state() / "pid"
    if pid.exists() and not (state() / "status").exists():
        try:
            os.killpg(int(pid.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
