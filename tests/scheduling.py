"""How a run spreads over both cores: whole files a worker, the load-sensitive tests one serial group.

pytest-xdist runs the suite on two workers (``-n 2 --dist loadfile``, pyproject.toml). A unit of work is a test file,
so that a module's fixtures (a server, a browser, a fitted model) are made once, except for the tests marked
``load_sensitive`` (timing, concurrency, memory: benchmarks/flakiness.py repeats them under load): those of every file
form one more unit, so that they run one at a time, on one worker, never two of them at once, beside the other
worker's files (as benchmarks/flakiness.py runs them beside a busy core). The workers tell the controller which
tests those are through a file in the run's folder (:func:`helpers.run_folder`), written when they collect.

The units go out in the order that ends a run soonest (:func:`order`): the longest first, as the newest
``benchmarks/results/<date>-<machine>-test-durations.json`` measured them (a test not measured counts a second), and
last the Docker image's tests, whose build runs in the background from the start (tests/docker_image.py). The same
order serves a run in one process (``-n 0``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import run_folder

MARKER = "load_sensitive"
GROUP = "load-sensitive tests"
#: The measured runs that order the next ones.
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
#: Files whose tests wait for something started in the background at the run's start: last, to give it the most time.
LAST = ("tests/docker/test_image.py",)


def unit(nodeid: str, sensitive: set[str] | frozenset[str]) -> str:
    """The unit of work a test belongs to: its file, or the group of load-sensitive tests."""
    return GROUP if nodeid in sensitive else nodeid.split("::", 1)[0]


def measured_seconds() -> dict[str, float]:
    """Each test's seconds in the newest measured run (empty where there is none)."""
    runs = sorted(RESULTS.glob("*-test-durations.json"))
    if not runs:
        return {}
    try:
        tests = json.loads(runs[-1].read_text())["per_test"]
        return {nodeid: float(entry["seconds"]) for nodeid, entry in tests.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def order(items: list, sensitive: set[str]) -> None:
    """The items by unit, longest unit first, :data:`LAST` at the end; within a unit by file, in the files' order.
    Deterministic: every worker must collect the same order."""
    seconds = measured_seconds()
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(unit(item.nodeid, sensitive), []).append(item)

    def cost(name: str) -> tuple[bool, float]:
        return name in LAST, -sum(seconds.get(item.nodeid, 1.0) for item in units[name])

    items[:] = [item for name in sorted(units, key=cost) for item in units[name]]


def _sensitive_file() -> Path:
    return run_folder() / "load-sensitive.json"


def pytest_collection_modifyitems(config, items):
    sensitive = {item.nodeid for item in items if item.get_closest_marker(MARKER) is not None}
    order(items, sensitive)
    if hasattr(config, "workerinput"):  # for the controller's scheduler: the same list from every worker
        path = _sensitive_file()
        temporary = path.with_name(f"{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(sorted(sensitive)))
        os.replace(temporary, path)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent with -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        """xdist's ``loadfile``, with the load-sensitive tests of every file as one more unit."""

        _sensitive: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._sensitive is None:  # read once the workers have collected (they wrote it then)
                path = _sensitive_file()
                self._sensitive = frozenset(json.loads(path.read_text())) if path.exists() else frozenset()
            return unit(nodeid, self._sensitive)

    return Scheduling(config, log)
