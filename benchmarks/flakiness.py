"""Make flakiness visible: run tests again and again while other processes load the CPU.

Tests whose outcome may depend on the machine (timeouts, concurrency, memory, batch grouping)
carry the ``load_sensitive`` marker. This runs them (or any pytest selection) ``--rounds``
times in a row, each round in a fresh pytest process, while ``--load`` busy processes keep
that many cores at 100%, and prints how many rounds passed and which tests failed in which
round. It measures; it asserts nothing, and it is not part of the test suite.

    python benchmarks/flakiness.py                       # 10 rounds of -m load_sensitive, 1 core loaded
    python benchmarks/flakiness.py --rounds 3 --load 2 -- tests/service/test_limits.py
    python benchmarks/flakiness.py --rounds 2 --load 0 --marker "" -- -q      # the whole suite, twice
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def busy() -> None:  # pragma: no cover - runs in a child process until killed
    while True:
        pass


def run_round(marker: str, extra: list[str]) -> tuple[bool, list[str], str, float]:
    """One pytest run: whether it passed, the failed test ids, its last line, its wall time."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *(["-m", marker] if marker else []),
        *extra,
    ]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", result.stdout, re.M)))
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return result.returncode == 0, failed, lines[-1] if lines else result.stderr[-300:], seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="pytest runs in a row (default 10)")
    parser.add_argument("--load", type=int, default=1, help="busy processes beside the tests (default 1: one core)")
    parser.add_argument("--marker", default="load_sensitive", help="pytest -m expression ('' for no marker)")
    parser.add_argument("--json", type=Path, help="also write the rounds here")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()

    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
    for hog in hogs:
        hog.start()
    rounds = []
    try:
        for i in range(1, args.rounds + 1):
            passed, failed, last, seconds = run_round(args.marker, args.pytest_args)
            rounds.append(
                {"round": i, "passed": passed, "failed": failed, "summary": last, "seconds": round(seconds, 1)}
            )
            print(
                f"round {i}/{args.rounds}: {'pass' if passed else 'FAIL'} in {seconds:.0f} s: {last}"
                + (f" [{', '.join(failed)}]" if failed else ""),
                flush=True,
            )
    finally:
        for hog in hogs:
            hog.kill()
    good = sum(r["passed"] for r in rounds)
    print(
        f"\n{good} of {len(rounds)} rounds passed with {args.load} busy process(es) beside the tests "
        f"(selection: {args.marker or 'all'} {' '.join(args.pytest_args)})"
    )
    counts: dict[str, int] = {}
    for r in rounds:
        for test in r["failed"]:
            counts[test] = counts.get(test, 0) + 1
    for test, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  failed {count}x: {test}")
    if args.json:
        args.json.write_text(json.dumps({"load": args.load, "marker": args.marker, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
