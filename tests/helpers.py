"""Helpers shared by the test modules: the real CLI and a real server process."""

from __future__ import annotations

import atexit
import functools
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import durations
import httpx
import numpy as np
from PIL import Image

IMAGE_SIZE = 64  # model input: the fits stay small (a few seconds each on 2 cores)

#: Relative tolerance for scores of one image that went through different batch compositions,
#: thread counts, processes or runtimes: a batched matmul, a convolution or a threaded reduction
#: sums in another order there, which moves the last bits (measured: up to about 1e-7). Exact
#: equality is kept only where it holds by construction (tensors read back, integers, the same
#: stored value), and says so.
SCORE_RTOL = 1e-5
#: The same for calibrated scores (0..1), in absolute terms: the logistic's slope is at most
#: 1 / (4 scale) and its scale at least 1% of the threshold, so near the threshold a score moves
#: up to 25 times the raw score's relative change.
SCORE_ATOL = 25 * SCORE_RTOL


#: The run's identity, shared with pytest-xdist's workers through the environment they inherit (tests/conftest.py
#: names it in the run's first process).
RUN_ENV = "PYTEST_PADIM_RUN"


def run_folder() -> Path:
    """A folder that every process of this test run shares (pytest-xdist's workers too), removed at its end."""
    folder = Path(tempfile.gettempdir()) / f"padim-test-run-{os.environ[RUN_ENV]}"
    folder.mkdir(exist_ok=True)
    return folder


def made_once(name: str, make) -> Path:
    """``name`` in the run's shared folder, made by ``make(path)`` once for the whole run: by the first of its
    processes (pytest-xdist's workers) to ask, while the others wait for it, then used by all. What it makes is the
    tests' to read: a test that changes it changes a copy."""
    from padim.core.artifact import locked_file

    folder = run_folder() / "shared"
    folder.mkdir(exist_ok=True)
    path, done = folder / name, folder / f"{name}.made"
    with locked_file(folder / f"{name}.lock"):
        if not done.exists():
            make(path)
            done.touch()
    return path


def assert_same_verdict(got: dict, expected: dict, rel: float = SCORE_RTOL) -> None:
    """Equal verdicts, unless the raw score lies within ``rel`` of the raw threshold.

    Two scores that agree to ``rel`` may still fall on either side of a threshold between them;
    there the verdict is not a property of the image but of the last bits, and is not compared.
    """
    threshold = expected.get("raw_threshold")
    if threshold is not None and abs(expected["raw_score"] - threshold) <= rel * abs(threshold):
        return
    assert got["is_anomaly"] == expected["is_anomaly"], (got, expected)


def run_cli(
    *args, check: bool = True, env: dict | None = None, timeout: int = 300, cwd=None
) -> subprocess.CompletedProcess:
    """Run the real ``padim`` command line in its own process.

    The process is forked from a warm interpreter that has torch and torchvision imported
    (tests/cli_zygote.py: 8 s of imports saved per call on 2 cores); a fresh interpreter runs it
    instead when ``env`` sets anything a library may read on import (:func:`forkable`).
    """
    argv = [str(a) for a in args]
    merged = {**os.environ, **(env or {})}
    with durations.timed(durations.command_kind(argv)):
        if not forkable(env):
            result = subprocess.run(
                [sys.executable, "-m", "padim", *argv],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=merged,
                cwd=cwd,
            )
        else:
            result = _zygote().run(argv, merged, os.fspath(cwd or os.getcwd()), timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"padim {' '.join(argv)} failed ({result.returncode}):\n{result.stderr}")
    return result


def python_forked(code: str, *args, output: Path) -> ForkedProcess:
    """``python -c CODE ARGS`` forked from the warm interpreter (torch and the rest imported: a kill -9 test's writer
    starts in a fraction of a second, not the seconds of a new interpreter's imports), stdout and stderr to
    ``output``; :func:`wait_for_line` reads it."""
    return _zygote().spawn([str(a) for a in args], dict(os.environ), os.getcwd(), output, output, code=code)


def wait_for_line(output: Path, line: str, process: ForkedProcess, timeout: float = 120) -> None:
    """Until ``output`` holds ``line`` (a process's "ready"); fails if the process exits first."""

    def written() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode} before {line!r}:\n{output.read_text()}")
        return output.exists() and line in output.read_text().splitlines()

    wait_until(written, timeout, f"{line!r} in {output.name}")


#: Variables that the libraries read when they are used, not when imported: torch.hub's folder, urllib's proxies.
READ_WHEN_USED = frozenset({"TORCH_HOME", "http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"})


def forkable(env: dict | None) -> bool:
    """Whether a command line with ``env`` added may fork from the warm interpreter: only ``PADIM_*`` settings
    (read when the command runs) and :data:`READ_WHEN_USED`, nothing a library reads when it is imported."""
    return all(key.startswith("PADIM_") or key in READ_WHEN_USED for key in env or {})


class ForkedProcess:
    """A ``padim`` process forked by the zygote, with what tests use of :class:`subprocess.Popen`: ``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill`` (it is the zygote's child, so its
    exit status comes over the zygote's connection, read by a thread of this object)."""

    def __init__(self, args: list[str], pid: int, connection: socket.socket):
        self.args, self.pid = ["padim", *args], pid
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._connection = connection
        threading.Thread(target=self._await_exit, daemon=True, name=f"padim-{pid}").start()

    def _await_exit(self) -> None:
        with self._connection, self._connection.makefile("r") as answers:
            line = answers.readline().strip()
        # no code: the zygote itself died (its children are then killed with it, see _Zygote.stop)
        self.returncode = int(line) if line else -signal.SIGKILL
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode if self._exited.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if not self._exited.is_set():  # as Popen: never a signal to a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """The client of tests/cli_zygote.py, started on the first call and stopped with the session."""

    _lock = threading.Lock()  # the session's zygote and each call's number (tests call the CLI from threads too)

    def __init__(self, folder: Path):
        self.folder = folder
        self.socket = folder / "zygote.sock"
        self.calls = 0
        self.children: list[ForkedProcess] = []
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("cli_zygote.py")), str(self.socket)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the command line's zygote did not start")

    def spawn(
        self, argv: list[str], env: dict, cwd: str, stdout: Path, stderr: Path, code: str | None = None
    ) -> ForkedProcess:
        """``padim ARGV`` (``python -c CODE ARGV`` with ``code``) forked, its output into ``stdout`` and ``stderr``
        (the same path: one file for both)."""
        request = {"args": argv, "env": env, "cwd": cwd, "stdout": str(stdout), "stderr": str(stderr)}
        if code is not None:
            request["code"] = code
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(str(self.socket))
            connection.sendall(json.dumps(request).encode() + b"\n")
            pid = b""
            while not pid.endswith(b"\n"):  # the pid's line alone: the exit code's is the handle's to read
                byte = connection.recv(1)
                if not byte:
                    raise RuntimeError(f"the zygote did not start padim {' '.join(argv)}")
                pid += byte
        except BaseException:
            connection.close()
            raise
        child = ForkedProcess(argv, int(pid), connection)
        with self._lock:
            self.children = [c for c in self.children if c.poll() is None] + [child]
        return child

    def run(self, argv: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
        with self._lock:
            self.calls += 1
            stdout, stderr = self.folder / f"{self.calls}.out", self.folder / f"{self.calls}.err"
        process = self.spawn(argv, env, cwd, stdout, stderr)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise subprocess.TimeoutExpired(["padim", *argv], timeout, *self._read(stdout, stderr)) from None
        return subprocess.CompletedProcess(["padim", *argv], code, *self._read(stdout, stderr))

    @staticmethod
    def _read(*paths: Path) -> tuple[str, ...]:
        texts = tuple(p.read_text(errors="replace") if p.exists() else "" for p in paths)
        for p in paths:
            p.unlink(missing_ok=True)
        return texts

    def stop(self) -> None:
        for child in self.children:  # a server a test left running (an error before its own cleanup)
            child.kill()
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    """The session's zygote: started on first use, and again if it died."""
    global _ZYGOTE
    with _Zygote._lock:
        if _ZYGOTE is None or _ZYGOTE.process.poll() is not None:
            _ZYGOTE = _Zygote(Path(tempfile.mkdtemp(prefix="padim-zygote-")))
            atexit.register(_ZYGOTE.stop)
        return _ZYGOTE


def wait_until(condition, timeout: float, what: str) -> None:
    """Poll ``condition()`` every 0.1 s until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen | ForkedProcess, url: str, log: Path):
        self.process, self.url, self.log = process, url, log

    def logs(self) -> str:
        return self.log.read_text()


@contextmanager
def running_server(
    tmp_path: Path,
    models: list[Path],
    env: dict | None = None,
    args: tuple = (),
    wait_ready: bool = True,
    padim: tuple[str, ...] | None = None,
    port: int | None = None,
    fresh: bool = False,
):
    """A real ``padim serve`` process on 127.0.0.1, its output in ``tmp_path/server-PORT.log``.

    It is forked from the warm interpreter the command lines use (tests/cli_zygote.py), a process of its own
    with its own pid, signals, exit code and process group; a fresh interpreter runs it instead where ``padim``
    names another command line (an installed wheel's), ``env`` sets what a library may read on import, or ``fresh``
    asks for one (a claim about the process itself: what it holds in memory from its first byte).
    """
    port = port or free_port()
    log = tmp_path / f"server-{port}.log"
    argv = ["serve", "--port", str(port), *(str(a) for a in args)]
    for model in models:
        argv += ["--model", str(model)]
    merged = {**os.environ, **(env or {})}
    started = time.perf_counter()
    process: subprocess.Popen | ForkedProcess
    if padim is None and not fresh and forkable(env):
        process = _zygote().spawn(argv, merged, os.getcwd(), log, log)
    else:
        with open(log, "w") as handle:
            process = subprocess.Popen(
                [*(padim or (sys.executable, "-m", "padim")), *argv],
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=merged,
            )
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        if wait_ready:
            deadline = time.time() + 120
            with httpx.Client(timeout=2) as probe:  # one client: the polls take no CPU from the starting server
                while time.time() < deadline:
                    if process.poll() is not None:
                        raise AssertionError(f"server exited with {process.returncode}:\n{server.logs()}")
                    try:
                        if probe.get(server.url + "/health/ready").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.1)
                else:
                    raise AssertionError("server not ready in time:\n" + server.logs())
        durations.record("server start-ups", time.perf_counter() - started)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def closed_loop(
    url: str,
    pictures: list[bytes],
    clients: int,
    seconds: float,
    answers: list,
    stop: threading.Event,
    limit: int | None = None,
) -> list[threading.Thread]:
    """``clients`` started threads, each posting ``pictures`` in turn to ``url``/score, one after the other, until
    ``stop``, ``seconds`` or ``limit`` requests each (bounded, whatever the caller does); each answer appends
    ``(answered, status or 0 for none, the version that scored it or None)`` to ``answers``."""

    def client(offset: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline, sent = time.monotonic() + seconds, 0
            while not stop.is_set() and time.monotonic() < deadline and (limit is None or sent < limit):
                picture = pictures[(offset + sent) % len(pictures)]
                sent += 1
                try:
                    response = http.post("/score", content=picture, headers={"content-type": "image/png"})
                    version = response.json()["model"]["version"] if response.status_code == 200 else None
                    answers.append((time.monotonic(), response.status_code, version))
                except httpx.TransportError:
                    answers.append((time.monotonic(), 0, None))

    threads = [threading.Thread(target=client, args=(i * len(pictures) // clients,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    return threads


def tensor_byte_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Byte range of every tensor's data in a safetensors file, read from its own header."""
    raw = Path(path).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    entries = json.loads(raw[8 : 8 + length])
    return {
        name: (8 + length + e["data_offsets"][0], 8 + length + e["data_offsets"][1])
        for name, e in entries.items()
        if name != "__metadata__"
    }


def metric(url: str, name: str, **labels) -> float:
    """The value of one sample in the server's /metrics (0 when it is not there yet)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def seed_export_cache(model: Path, export: Path) -> Path:
    """``export`` (``padim export`` of ``model``'s bytes) placed where a first ``--runtime auto`` load of ``model``
    caches its export: the same bytes, the same graph (the cache is keyed by the file's name and sha256), so that a
    test about names, folders or what happens to a cache does not pay for an export (4-8 s on 2 cores). The folder
    is the one this process's environment gives (``PADIM_CACHE_DIR``, else beside ``model``); returns it."""
    from padim.core.artifact import file_sha256
    from padim.models.deploy.runtimes import cache_dir

    cached = cache_dir(model, file_sha256(model), "onnx")
    shutil.copytree(export, cached)
    return cached


def copy_model(source: Path, target: Path, export: Path | None = None) -> Path:
    """``source`` copied to ``target``, with ``export`` (``padim export`` of ``source``) as its cached export."""
    shutil.copyfile(source, target)
    if export is not None:
        seed_export_cache(target, export)
    return target


@functools.cache
def large_png(side: int = 6300) -> bytes:
    """A ~160 KB PNG that decodes to side x side pixels (about 160 MB as Pillow holds it); made once a session (its
    compression takes seconds)."""
    rng = np.random.default_rng(0)
    pixels = np.full((side, side, 3), (120, 110, 100), dtype=np.uint8)
    pixels[rng.integers(0, side, 2000), rng.integers(0, side, 2000)] = rng.integers(0, 255, (2000, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def reference_maps(squared: np.ndarray, tiling, sigma: float) -> np.ndarray:
    """Stitch by hand (the mean of the tiles covering each cell), then F.interpolate and gaussian_blur."""
    import torch
    import torch.nn.functional as F

    from padim.core.scoring import gaussian_blur

    height, width = tiling.grid
    step = height - tiling.overlap
    rows, cols = height + (tiling.rows - 1) * step, width + (tiling.cols - 1) * step
    distance = np.sqrt(np.maximum(squared, 0)).reshape(-1, tiling.rows, tiling.cols, height, width)
    total = np.zeros((len(distance), rows, cols))
    count = np.zeros((rows, cols))
    for r in range(tiling.rows):
        for c in range(tiling.cols):
            total[:, r * step : r * step + height, c * step : c * step + width] += distance[:, r, c]
            count[r * step : r * step + height, c * step : c * step + width] += 1
    stitched = torch.from_numpy(total / count)[:, None]
    upsampled = F.interpolate(stitched, size=tiling.input_shape, mode="bilinear", align_corners=False)
    return gaussian_blur(upsampled, sigma)[:, 0].numpy()


def pooled(x: np.ndarray) -> np.ndarray:
    """The mean over pixels of every pixel's np.cov of ``(N, P, D)`` rows: the target of ``--shrinkage``."""
    return np.mean([np.cov(x[:, p], rowvar=False) for p in range(x.shape[1])], axis=0)


def refit_squared(
    x: np.ndarray, folds: list[int], epsilon: float, shrinkage: float = 0.0, target: np.ndarray | None = None
) -> np.ndarray:
    """``(N, P)`` squared distances of each fold's rows under a model fitted from scratch on the others, float64;
    with ``shrinkage``, each covariance shrunk toward ``target``, by default the pooled covariance of every row
    (the fitted model's)."""
    n, pixels, dim = x.shape
    target = pooled(x) if shrinkage and target is None else target
    squared = np.empty((n, pixels))
    start = 0
    for m in folds:
        rest = np.delete(x, np.arange(start, start + m), axis=0)
        mean = rest.mean(axis=0)  # (P, D)
        for p in range(pixels):
            centred = rest[:, p] - mean[p]
            cov = centred.T @ centred / (len(rest) - 1)
            if shrinkage:
                cov = (1 - shrinkage) * cov + shrinkage * target
            cov = cov + epsilon * np.eye(dim)
            delta = x[start : start + m, p] - mean[p]
            squared[start : start + m, p] = np.einsum("id,de,ie->i", delta, np.linalg.inv(cov), delta)
        start += m
    return squared


def normal_and_shifted(root: Path, count: int) -> tuple[list[Path], list[Path]]:
    """``count`` new normal weave images (96 px, unseen by the session's model) and the same under a warmer lamp:
    green at three quarters, blue at half. A change of colour, which the default ``--standardise gain`` (one gain
    for a picture's brightness) leaves for the model to see, as a monitor, a drift report or a gate must."""
    from padim.models.data.synthetic import generate

    (category,) = generate(root, ("weave",), train=count, test_good=0, test_defect=0, size=96, seed=7)
    normal = sorted((category / "train" / "good").glob("*.png"))
    shifted = root / "shifted"
    shifted.mkdir()
    for path in normal:
        pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)
        warmer = pixels * np.array([1.0, 0.75, 0.5])
        Image.fromarray(np.clip(warmer, 0, 255).astype(np.uint8)).save(shifted / path.name)
    return normal, sorted(shifted.glob("*.png"))


def score_in_batches(url: str, paths, **params) -> None:
    """POST ``paths`` to ``url``'s ``/score/batch``, eight images a request, each answered 200."""
    for first in range(0, len(paths), 8):
        files = [("file", (p.name, p.read_bytes(), "image/png")) for p in paths[first : first + 8]]
        answer = httpx.post(url + "/score/batch", files=files, params=params, timeout=60)
        assert answer.status_code == 200, answer.text


def roles(supervisor: int) -> dict[str, int]:
    """The supervisor's children by role: ``scoring``, ``api-1``, ``api-2``, ... (by the names they give themselves,
    ``padim-scoring``, ``padim-api-1``, as ``ps -o comm`` shows them)."""
    found = {}
    for task in Path(f"/proc/{supervisor}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                name = Path(f"/proc/{child}/comm").read_text().strip()
            except OSError:
                continue
            if name.startswith("padim-"):
                found[name.removeprefix("padim-")] = int(child)
    return found


def older_format(path, target, version: int) -> None:
    """``path`` as format ``version`` wrote it: the safetensors library's layout, that version's header."""
    from padim.core.artifact import load_artifact

    older_format_of(*load_artifact(path), target, version)


def defaults_as(monkeypatch, **options) -> None:
    """As if today's defaults were ``options``: every :class:`~padim.models.config.PadimConfig` built without them
    takes them (the older-format tests read a file with what it computed, whatever the defaults)."""
    from padim.models.config import PadimConfig

    init = PadimConfig.__init__

    def changed(self, *args, **kwargs):
        for name, value in options.items():
            kwargs.setdefault(name, value)
        init(self, *args, **kwargs)

    monkeypatch.setattr(PadimConfig, "__init__", changed)


def older_format_of(tensors, header, target, version: int) -> None:
    """A file of ``tensors`` and ``header`` as format ``version`` wrote it."""
    from safetensors.torch import save_file

    from padim.core import artifact

    old = {k: v for k, v in header.items() if k not in ("tensor_sha256", "header_sha256", "verified")}
    old["format_version"] = version
    old["tensor_sha256"] = {name: artifact.tensor_sha256(t) for name, t in tensors.items()}
    old["header_sha256"] = artifact._header_sha256(old)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(target),
        metadata={"padim": json.dumps(old, sort_keys=True)},
    )


class SmallDisk:
    """A real file system of ``size`` bytes (a tmpfs mounted at ``path``, as root: the ``tmpfs`` component) that a
    test fills and frees: what the service and a fit do on a full disk, with the kernel's own ENOSPC."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = Path(path), size
        self._filler = self.path / ".filler"

    def fill(self, leave: int = 0) -> int:
        """Take every free byte but ``leave`` (a file written until the kernel refuses, then cut back): the bytes
        taken."""
        taken = 0
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for block in (1 << 16, 512, 1):
                data = b"\0" * block
                while True:
                    try:
                        taken += os.write(fd, data)
                    except OSError:
                        break
            if leave:
                taken = max(0, taken - leave)
                os.ftruncate(fd, taken)
        finally:
            os.close(fd)
        assert shutil.disk_usage(self.path).free < 4096 + leave, "the small disk still has room"
        return taken

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)


@contextmanager
def small_disk(path: Path, size: int):
    """A :class:`SmallDisk` mounted at ``path`` (made) for the block; unmounted after it (lazily: a server that
    still holds a file there lets go when it stops)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield SmallDisk(path, size)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class Receiver:
    """A webhook receiver on 127.0.0.1: the verdicts a line delivers. While ``refusing``, it answers 503 and keeps
    nothing (a sink that is down)."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.bodies: list[dict] = []
        self.refusing = False
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if receiver.refusing:
                    self.send_response(503)
                else:
                    receiver.bodies.append(body)
                    self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
