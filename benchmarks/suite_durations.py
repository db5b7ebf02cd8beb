"""Where a test run's time went: per test, per file and per kind of work, from the run's JUnit XML.

Run the suite with ``--junitxml`` (``--durations=0`` prints the same per-test seconds), then::

    python -m pytest -q --junitxml run.xml
    python benchmarks/suite_durations.py run.xml --save     # benchmarks/results/<date>-<machine>-test-durations.json
    python benchmarks/suite_durations.py run.xml --compare benchmarks/results/OLDER-test-durations.json

Each test's seconds are its setup, call and teardown (pytest's ``junit_duration_report = total``); the kinds
(server start-ups, fits, exports, other command lines, docker, browser start-ups) are what tests/durations.py
timed inside them and left in the XML as properties. A session fixture's cost lands on the first test that
asked for it. With several workers (pytest-xdist) the tests' seconds add up to more than the run's wall time.
It measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import re
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROPERTY = "padim.kinds:"  # tests/durations.py's user property, one a phase
MACHINE_CPU = "machine CPU"  # beside the kinds: CPU seconds of the whole machine during the phase


def machine() -> str:
    """``2core-AMD-EPYC``: the cores and the CPU's model, as the other results here are named."""
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1]
                break
    except OSError:
        pass
    words = [w for w in re.split(r"[^A-Za-z0-9]+", model) if w and w not in ("R", "TM", "CPU", "Processor", "C")]
    name = "-".join(w for w in words if not re.fullmatch(r"\d+(\.\d+)?GHz|@", w))[:40] or "cpu"
    return f"{os.cpu_count()}core-{name}"


def source_file(classname: str) -> str:
    """``tests.service.test_server`` (or ``...test_server.TestClass``) as ``tests/service/test_server.py``."""
    parts = classname.split(".")
    while len(parts) > 1 and parts[-1][:1].isupper():
        parts.pop()
    return "/".join(parts) + ".py"


def summarise(xml: Path) -> dict:
    suites = ElementTree.parse(xml).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    assert suite is not None, f"{xml}: no <testsuite>"
    tests: dict[str, dict] = {}
    for case in suite.iter("testcase"):
        file = source_file(case.get("classname", ""))
        classes = case.get("classname", "").split(".")[len(file[:-3].split("/")) :]
        nodeid = "::".join([file, *classes, case.get("name", "")])
        kinds: dict[str, float] = defaultdict(float)
        for prop in case.iter("property"):
            if prop.get("name", "").startswith(PROPERTY):
                for kind, seconds in ast.literal_eval(prop.get("value", "{}")).items():
                    kinds[kind] += float(seconds)
        outcome = next(
            (tag for tag in ("failure", "error", "skipped") if case.find(tag) is not None),
            "passed",
        )
        cpu = kinds.pop(MACHINE_CPU, 0.0)
        tests[nodeid] = {
            "file": file,
            "seconds": round(float(case.get("time", 0)), 3),
            "cpu_s": round(cpu, 2),
            "outcome": outcome,
            "kinds": {k: round(v, 2) for k, v in sorted(kinds.items())},
        }
    files: dict[str, dict] = defaultdict(
        lambda: {"seconds": 0.0, "cpu_s": 0.0, "tests": 0, "kinds": defaultdict(float)}
    )
    kinds_total: dict[str, float] = defaultdict(float)
    outcomes: dict[str, int] = defaultdict(int)
    for test in tests.values():
        entry = files[test["file"]]
        entry["seconds"] += test["seconds"]
        entry["cpu_s"] += test["cpu_s"]
        entry["tests"] += 1
        outcomes[test["outcome"]] += 1
        for kind, seconds in test["kinds"].items():
            entry["kinds"][kind] += seconds
            kinds_total[kind] += seconds
    tested = sum(t["seconds"] for t in tests.values())
    return {
        "source": xml.name,
        "machine": machine(),
        "date": suite.get("timestamp", "")[:10] or datetime.date.today().isoformat(),
        "wall_s": round(float(suite.get("time", 0)), 1),
        "tests": len(tests),
        "outcomes": dict(outcomes),
        "tests_s": round(tested, 1),
        "cpu_s": round(sum(t["cpu_s"] for t in tests.values()), 1),
        "kinds_s": {k: round(v, 1) for k, v in sorted(kinds_total.items(), key=lambda kv: -kv[1])},
        "files": {
            name: {
                "seconds": round(f["seconds"], 1),
                "cpu_s": round(f["cpu_s"], 1),
                "tests": f["tests"],
                "kinds": {k: round(v, 1) for k, v in sorted(f["kinds"].items(), key=lambda kv: -kv[1])},
            }
            for name, f in sorted(files.items(), key=lambda kv: -kv[1]["seconds"])
        },
        "per_test": dict(sorted(tests.items(), key=lambda kv: -kv[1]["seconds"])),
    }


def show(summary: dict, top: int) -> None:
    print(
        f"{summary['source']} ({summary['machine']}, {summary['date']}): {summary['tests']} tests "
        f"{summary['outcomes']}, wall {summary['wall_s'] / 60:.1f} min, tests' own {summary['tests_s'] / 60:.1f} min, "
        f"machine CPU {summary.get('cpu_s', 0) / 60:.1f} min"
    )
    print("\nby kind (seconds inside the tests):")
    for kind, seconds in summary["kinds_s"].items():
        print(f"  {seconds:8.1f}  {kind}")
    print(f"\n{top} slowest files (seconds, machine CPU seconds, tests):")
    for name, entry in list(summary["files"].items())[:top]:
        print(f"  {entry['seconds']:8.1f}  {entry.get('cpu_s', 0):8.1f}  {entry['tests']:4d}  {name}")
    print(f"\n{top} slowest tests:")
    for nodeid, entry in list(summary["per_test"].items())[:top]:
        print(f"  {entry['seconds']:8.1f}  {nodeid}")


def compare(before: dict, after: dict, top: int) -> None:
    print(f"\n{'':40} {'before':>9} {'after':>9}")
    print(f"{'wall (s)':40} {before['wall_s']:9.1f} {after['wall_s']:9.1f}")
    print(f"{'tests (count)':40} {before['tests']:9d} {after['tests']:9d}")
    print(f"{'tests own seconds (all workers)':40} {before['tests_s']:9.1f} {after['tests_s']:9.1f}")
    print(f"{'machine CPU seconds':40} {before.get('cpu_s', 0):9.1f} {after.get('cpu_s', 0):9.1f}")
    for kind in dict.fromkeys([*before["kinds_s"], *after["kinds_s"]]):
        print(f"{kind:40} {before['kinds_s'].get(kind, 0):9.1f} {after['kinds_s'].get(kind, 0):9.1f}")
    names = sorted(
        set(before["files"]) | set(after["files"]),
        key=lambda n: -max(before["files"].get(n, {}).get("seconds", 0), after["files"].get(n, {}).get("seconds", 0)),
    )
    print(f"\nfiles (seconds; the {top} slowest in either run):")
    for name in names[:top]:
        b, a = before["files"].get(name, {}), after["files"].get(name, {})
        print(f"  {name:60} {b.get('seconds', 0):8.1f} {a.get('seconds', 0):8.1f}")
    gone = sorted(set(before["per_test"]) - set(after["per_test"]))
    if gone:
        print(f"\n{len(gone)} test ids of before not in after:")
        for nodeid in gone:
            print(f"  {nodeid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("xml", type=Path, help="a run's --junitxml file")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/<date>-<machine>-test-durations")
    parser.add_argument("--output", type=Path, help="write the summary here instead")
    parser.add_argument("--label", default="", help="added to the saved file's name (before, after, ...)")
    parser.add_argument("--compare", type=Path, help="a summary saved before: printed side by side")
    parser.add_argument("--top", type=int, default=25, help="how many files and tests to list (default 25)")
    args = parser.parse_args()
    summary = summarise(args.xml)
    show(summary, args.top)
    if args.compare:
        compare(json.loads(args.compare.read_text()), summary, args.top)
    output = args.output
    if args.save and output is None:
        label = f"-{args.label}" if args.label else ""
        output = ROOT / "benchmarks" / "results" / f"{summary['date']}-{summary['machine']}-test-durations{label}.json"
    if output is not None:
        output.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"\nwritten: {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
