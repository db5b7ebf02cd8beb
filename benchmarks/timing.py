"""Helpers shared by the benchmark scripts (stdlib + torch only, so that the anomalib worker can
use them from an environment without padim): timing, a name for the machine, and the seeded
resnet18 weights every side of a comparison loads."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def work_folder(workdir: Path | None, prefix: str) -> Path:
    """``workdir`` when given (kept), else a new temporary folder removed when the script exits,
    however it exits short of a kill (the benchmarks generate gigabytes of images and models)."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        return workdir
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def wait_ready(url: str, timeout: float, process=None, every: float = 0.2, probe_s: float = 2.0) -> bool:
    """Whether ``url``'s ``/health/ready`` answered 200 within ``timeout`` seconds, asked every ``every`` s; ``False``
    at once when ``process`` (a ``Popen``), given, has exited."""
    import httpx  # the serving benchmarks' client; the others need not have it

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process is not None and process.poll() is not None:
            return False
        try:
            if httpx.get(url + "/health/ready", timeout=probe_s).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(every)
    return False


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after one warm-up run.

    Waits for the GPU when there is one, so that asynchronous CUDA work is counted.
    """
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_name() -> str:
    """``<cores>core-<cpu model>``, e.g. ``2core-AMD-EPYC``: names result files by machine."""
    cpu = "unknown-cpu"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cpu = re.sub(r"\((R|TM)\)|CPU|Processor|@.*", "", cpu, flags=re.I)
    return re.sub(r"[^A-Za-z0-9]+", "-", f"{os.cpu_count()}core-{cpu}").strip("-")[:60]


def seeded_resnet18(path: Path) -> Path:
    """``path``, a resnet18 state_dict of random weights drawn after ``torch.manual_seed(0)`` (written
    once): the same weights for padim, anomalib and AnomaVision in one comparison."""
    return seeded_backbone("resnet18", path)


def seeded_backbone(name: str, path: Path) -> Path:
    """``path``, a torchvision ``name`` state_dict of random weights drawn after ``torch.manual_seed(0)``."""
    if not path.exists():
        import torchvision

        torch.manual_seed(0)
        torch.save(getattr(torchvision.models, name)().state_dict(), path)
    return path
