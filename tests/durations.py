"""Where the suite's time goes: each test's seconds by kind of work, kept with its report.

Most of a test's time is not its assertions but the processes it starts and the work it redoes. The
helpers that do that work time it here (:func:`timed`): a ``padim serve`` until it answers ready, a
``padim train`` (a fit), a ``padim export``, any other ``padim`` command line, a ``docker`` command,
a browser's start. Each test's report carries what was timed during it (as the user property
``padim.kinds:setup``, ``:call`` and ``:teardown``), so that it travels to pytest-xdist's controller and
into ``--junitxml``; a session fixture's cost lands on the first test that asked for it.

Beside the kinds, each phase records what it cost the whole machine: the CPU seconds of every process on
every core while it ran (``machine CPU``). In a run in one process (``-n 0``) that is the test's own cost,
the processes it started included; on several workers it is theirs together.

At the end of a run this prints the seconds of each kind beside the run's wall time, under pytest's
own ``--durations`` list. ``python benchmarks/suite_durations.py JUNIT.xml`` turns a run's XML into
the per-test, per-file and per-kind table kept in ``benchmarks/results/*-test-durations.json``; the newest
such table orders the next runs (tests/scheduling.py).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import psutil
import pytest

#: The kinds of work timed, in the order the summary prints them.
KINDS = (
    "server start-ups",
    "fits",
    "exports",
    "other command lines",
    "docker",
    "browser start-ups",
)
#: Not a kind of work but what the phase cost the machine: CPU seconds of every process on every core while it ran
#: (a test's own cost in a run in one process, ``-n 0``; with several workers, theirs together).
MACHINE_CPU = "machine CPU"
#: The user property that holds a phase's seconds by kind, as ``padim.kinds:PHASE``.
PROPERTY = "padim.kinds"

_lock = threading.Lock()  # tests time work from threads too (a server per client thread, a background build)
_phase: dict[str, float] = defaultdict(float)  # the running phase's seconds by kind
_totals: dict[str, float] = defaultdict(float)  # the whole run's, as the reports come in (xdist: the controller)
_started = time.monotonic()


def record(kind: str, seconds: float) -> None:
    """Add ``seconds`` of ``kind`` (one of :data:`KINDS`) to the running test's phase."""
    if kind not in KINDS and kind != MACHINE_CPU:
        raise ValueError(f"unknown kind {kind!r}: one of {KINDS}")
    with _lock:
        _phase[kind] += seconds


@contextmanager
def timed(kind: str):
    """Time the block as ``kind``, failed or not."""
    started = time.perf_counter()
    try:
        yield
    finally:
        record(kind, time.perf_counter() - started)


def command_kind(argv: list[str]) -> str:
    """The kind of a ``padim`` command line: its verb (the first word that is not an option)."""
    verb = next((word for word in argv if not word.startswith("-")), "")
    return {"train": "fits", "export": "exports", "serve": "server start-ups"}.get(verb, "other command lines")


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent (every core, every process) since it started."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


@pytest.hookimpl(hookwrapper=True)
def _timed_phase(item):
    started = machine_cpu_seconds()
    yield
    record(MACHINE_CPU, machine_cpu_seconds() - started)


pytest_runtest_setup = pytest_runtest_call = pytest_runtest_teardown = _timed_phase


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    with _lock:
        spent = {kind: round(seconds, 3) for kind, seconds in _phase.items() if seconds}
        _phase.clear()
    if spent:
        # on the item too: the teardown's report then holds every phase's, and that is the one --junitxml keeps
        entry = (f"{PROPERTY}:{call.when}", spent)
        item.user_properties.append(entry)
        outcome.get_result().user_properties.append(entry)


def pytest_runtest_logreport(report):
    for name, spent in report.user_properties:
        if name == f"{PROPERTY}:{report.when}" and isinstance(spent, dict):
            for kind, seconds in spent.items():
                _totals[kind] += seconds


def pytest_terminal_summary(terminalreporter):
    if not _totals:
        return
    wall = time.monotonic() - _started
    terminalreporter.section("where the time went (tests/durations.py)")
    for kind in KINDS:
        if _totals.get(kind):
            terminalreporter.write_line(f"{_totals[kind]:8.1f} s  {kind}")
    if _totals.get(MACHINE_CPU):
        terminalreporter.write_line(
            f"{_totals[MACHINE_CPU]:8.1f} s  machine CPU while tests ran (in one process the tests' own; on several "
            "workers each counts the others' too)"
        )
    terminalreporter.write_line(f"{wall:8.1f} s  the run's wall time (several workers add up to more)")
