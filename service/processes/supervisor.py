"""The supervisor: binds the port once, starts the scoring process and the API processes, keeps them running, and
drains them on SIGTERM.

- An API process that dies is replaced in its row (its places, slots and journal are its successor's); one that
  fails :data:`GIVE_UP_AFTER` times in a row before it was ever ready stops the service (exit 1): a start-up error is
  not cured by starting again.
- The scoring process that dies after it was ready is started again (the API processes answer 503 ``not_ready``
  meanwhile, and reconnect); one that fails before it was ready stops the service with its exit code, as one
  process would (a bad model file).
- SIGTERM or SIGINT: the listening socket is closed, the API processes drain (each answers what it admitted, within
  ``PADIM_DRAIN_TIMEOUT_S``), then the scoring process stops; exit 0.

Children run in a session of their own (a terminal's Ctrl-C reaches the supervisor only, which stops them in order)
and die with it (``PR_SET_PDEATHSIG``) should it be killed.

Children are forked from the supervisor, which has imported what they run: a replaced API process is up in the time
its app takes to start, not the seconds a new interpreter takes to import torch, and the pages of the imported modules
are shared until written. A scoring process that may use a GPU is the exception: it starts in a new interpreter, since
CUDA cannot start in a process forked from one that has asked the driver anything (the supervisor asks torch whether
there is a GPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from prometheus_client import multiprocess

from ..settings import ServiceSettings
from .shared import READY, STOPPED, RunFolder, shared_memory_root, sweep

log = logging.getLogger("padim.service")

#: Start-up failures in a row (never ready) after which an API process is not started again.
GIVE_UP_AFTER = 3
#: Seconds between looks at the children.
POLL_S = 0.05
#: A child that lived less than this before dying is started again only after a pause (doubling, to BACKOFF_MAX_S).
QUICK_DEATH_S = 10.0
BACKOFF_MAX_S = 5.0
#: Seconds past the drain timeout a process is given before it is killed.
STOP_GRACE_S = 10.0


#: The supervisor's pid, in its children's environment.
SUPERVISOR = "PADIM_SUPERVISOR_PID"


def as_child(role: str) -> None:
    """A child's first step: named ``padim-ROLE`` (``ps -o comm``, ``top``: ``padim-scoring``, ``padim-api-1``; the
    role its log lines carry), and SIGTERM asked of Linux for when the supervisor dies (nothing elsewhere); exit now
    if it is gone already (the parent is no longer the supervisor: in a container the supervisor is PID 1 itself)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, f"padim-{role}".encode()[:15])  # PR_SET_NAME
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    expected = os.environ.get(SUPERVISOR)
    if expected is not None and os.getppid() != int(expected):
        sys.exit(1)


class Forked:
    """A child forked from this process to run ``target()`` and exit with what it returns; ``poll``, ``wait``,
    ``send_signal``, ``kill``, ``pid`` and ``returncode`` as :class:`subprocess.Popen` has them (a negative code: the
    signal that ended it)."""

    def __init__(self, target: Callable[[], int], env: dict[str, str], close: tuple[socket.socket, ...] = ()):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # what is buffered is the supervisor's to write, not written twice
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; its end is os._exit
            os._exit(_run_child(target, env, close))
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_child(target: Callable[[], int], env: dict[str, str], close: tuple[socket.socket, ...]) -> int:
    """In a forked child: a session of its own, default signal handling, the children's environment, the child's
    copies of the supervisor's sockets in ``close`` closed (not shut down: the supervisor's own stay open), then
    ``target``; its exit code once the threads it left running (not daemons) have ended, as an interpreter's exit
    waits for them."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update(env)
        for sock in close:
            sock.close()
        # prometheus_client chose its value class when the supervisor imported it, before PROMETHEUS_MULTIPROC_DIR
        from prometheus_client import values

        values.ValueClass = values.get_value_class()
        code = target()
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    except SystemExit as stop:  # as the interpreter reports it: a message is printed, and exits 1
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    return code


@dataclass
class Child:
    """One process the supervisor runs: the scoring process (row 0) or an API process; ``python -m module *argv``
    as a fork of the supervisor, or in a new interpreter where ``fresh``. A new interpreter inherits only
    ``pass_fds``; a fork closes its copies of the supervisor's sockets in ``not_inherited`` (the listening socket,
    for the scoring process: a drain closes it, and no process may keep accepting into its backlog)."""

    row: int
    module: str
    argv: list[str]
    fresh: bool = False
    pass_fds: tuple[int, ...] = ()
    not_inherited: tuple[socket.socket, ...] = ()
    process: subprocess.Popen | Forked | None = None
    started: float = 0.0
    ever_ready: bool = False
    failures: int = 0  # deaths in a row before ready
    backoff: float = 0.0
    restart_at: float | None = None
    env: dict = field(default_factory=dict)

    @property
    def role(self) -> str:
        return "scoring process" if self.row == 0 else f"API process {self.row}"

    def start(self, run: RunFolder) -> None:
        """Start it, the keys handed over in a pipe of its own (the last argument: its descriptor), never a file."""
        secrets = run.secrets_pipe()
        argv = [*self.argv, str(secrets)]
        try:
            if self.fresh:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", self.module, *argv],
                    pass_fds=(*self.pass_fds, secrets),
                    start_new_session=True,
                    env={**os.environ, **self.env},
                )
            else:
                main = importlib.import_module(self.module).main
                self.process = Forked(lambda: main(argv), self.env, self.not_inherited)
        finally:
            os.close(secrets)  # the child has its own copy
        self.started = time.monotonic()
        self.restart_at = None
        run.started(self.row)
        log.info(
            f"{self.role} started",
            extra={"row": self.row, "pid": self.process.pid, "how": "new interpreter" if self.fresh else "forked"},
        )


def default_workers(device_type: str, cpus: int) -> int:
    """API processes when ``PADIM_WORKERS`` is not set (docs/sizing.md says why).

    On a CPU the scorer takes every core it is given and is the bottleneck, so one process decodes and scores
    (measured on 2 cores: the same throughput, and lower latency, than two API processes beside a scoring one). On a
    GPU a core decodes and answers a few hundred pictures a second: one API process a core, leaving one for the
    scoring process and one for the rest, at most 16.
    """
    if device_type != "cuda" or cpus < 4:
        return 1
    return max(2, min(16, cpus - 2))


def may_use_a_gpu(device: str) -> bool:
    """Whether a scoring process on ``device`` (``PADIM_DEVICE``) may start CUDA: then it is not forked."""
    if device == "cpu":
        return False
    return device == "cuda" or torch.cuda.is_available()


class Supervisor:
    def __init__(self, settings: ServiceSettings, workers: int):
        self.settings, self.workers = settings, workers
        removed = sweep(shared_memory_root())
        if removed:
            log.info(
                f"removed the run folders of {len(removed)} supervisor(s) that are gone",
                extra={"removed": [folder.name for folder in removed]},
            )
        self.run = RunFolder.create(settings, workers)
        self.stopping = False
        self.exit_code = 0
        self.listening = socket.create_server((settings.host, settings.port), backlog=2048)
        self.listening.set_inheritable(True)
        env = {"PROMETHEUS_MULTIPROC_DIR": str(self.run.metrics), SUPERVISOR: str(os.getpid())}
        run, descriptor = str(self.run.root), self.listening.fileno()
        fresh = may_use_a_gpu(settings.device)
        self.children = [Child(0, f"{__package__}.scoring", [run], fresh, not_inherited=(self.listening,), env=env)] + [
            Child(row, f"{__package__}.api", [run, str(row), str(descriptor)], False, (descriptor,), env=env)
            for row in range(1, workers + 1)
        ]
        for child in self.children:  # imported once, here: each fork starts with them
            if not child.fresh:
                importlib.import_module(child.module)

    def serve(self) -> int:
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        log.info(
            "serving from several processes",
            extra={"workers": self.workers, "run_folder": str(self.run.root), "port": self.listening.getsockname()[1]},
        )
        try:
            for child in self.children:
                child.start(self.run)
            while not self.stopping:
                self._look()
                time.sleep(POLL_S)
            self._drain()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            with contextlib.suppress(OSError):
                self.listening.close()
            self.run.remove()
        return self.exit_code

    def _stop(self, signum, frame) -> None:
        if not self.stopping:
            log.info("draining", extra={"signal": signal.Signals(signum).name})
        self.stopping = True

    def _look(self) -> None:
        now = time.monotonic()
        for child in self.children:
            process = child.process
            if process is None:
                continue
            if not child.ever_ready and self.run.state(child.row)[0] == READY:
                child.ever_ready, child.failures, child.backoff = True, 0, 0.0
            code = process.poll()
            if code is None:
                continue
            if child.restart_at is None:
                self._died(child, code, now)
            if self.stopping:
                return
            if child.restart_at is not None and now >= child.restart_at:
                child.start(self.run)

    def _died(self, child: Child, code: int, now: float) -> None:
        assert child.process is not None
        multiprocess.mark_process_dead(child.process.pid, str(self.run.metrics))
        self.run.set_state(child.row, STOPPED)
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if not child.ever_ready:
            child.failures += 1
            if child.row == 0 or child.failures >= GIVE_UP_AFTER:
                log.error(f"the {child.role} failed to start ({how}); stopping", extra={"row": child.row})
                self.exit_code = code if code > 0 else 1
                self.stopping = True
                return
        lived = now - child.started
        child.backoff = 0.0 if lived > QUICK_DEATH_S else min(BACKOFF_MAX_S, max(0.2, child.backoff * 2))
        child.ever_ready = False
        child.restart_at = now + child.backoff
        log.error(f"the {child.role} stopped ({how}); starting it again", extra={"row": child.row})

    def _drain(self) -> None:
        """API processes first (they answer what they admitted, which needs the scoring process), then scoring."""
        with contextlib.suppress(OSError):
            self.listening.close()  # new connections are refused, not left in a backlog nobody accepts
        api, scoring = self.children[1:], self.children[0]
        timeout = self.settings.drain_timeout_s + STOP_GRACE_S
        _stop_all(api, timeout)
        _stop_all([scoring], timeout)
        if scoring.process is not None and scoring.process.returncode not in (0, None) and self.exit_code == 0:
            if not scoring.ever_ready:
                self.exit_code = 1


def _stop_all(children: list[Child], timeout: float) -> None:
    running = [c.process for c in children if c.process is not None and c.process.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("a process did not stop within the drain timeout; killed", extra={"pid": process.pid})
            process.kill()
            process.wait()
