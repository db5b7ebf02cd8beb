"""Run a Python module or script in this very process and write its peak RSS at exit.

    python benchmarks/peak_rss.py OUT_FILE -m padim train ...
    python benchmarks/peak_rss.py OUT_FILE script.py args ...

Why not ``getrusage``/``wait4`` from the parent: Linux carries a process's RSS high-water
mark across ``execve``, so a child's ``ru_maxrss`` is at least its parent's RSS at fork time,
and a parent that holds a model inflates every child's figure. ``VmHWM`` in
``/proc/self/status`` belongs to the address space made by ``execve``: this process's own peak.
"""

import atexit
import runpy
import sys


def _report(path: str) -> None:
    with open("/proc/self/status") as status:
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    with open(path, "w") as out:
        out.write(str(peak_kb))


if __name__ == "__main__":
    out_file, target = sys.argv[1], sys.argv[2:]
    atexit.register(_report, out_file)
    if target[0] == "-m":
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        runpy.run_path(target[0], run_name="__main__")
