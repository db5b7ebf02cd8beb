"""A warm interpreter that forks one child per ``padim`` command line a test runs, servers included.

Importing torch and torchvision takes about 8 s of CPU on the 2-core CI machines (torchvision imports
``torch._dynamo``), and the suite runs the command line a few hundred times and starts ``padim serve``
dozens of times: most of that time was the same imports again. This process imports those libraries
once, padim's modules included (nothing that reads the environment when imported: see :data:`WARM`) and
builds the exporter's registry (:func:`warm_the_exporter`), then for each request forks a child that
becomes ``python -m padim ARGS``: its own process in a process group of its own, with the request's
working folder, environment, stdin from /dev/null, stdout and stderr to the files named (one file for
both where the two names are the same), the module run as ``-m`` runs it, Python's exit (threads
joined, ``atexit``, streams flushed) and its exit status, which this process reports back.

Protocol on a unix socket, one connection per command line: the client sends one JSON line
``{"args", "env", "cwd", "stdout", "stderr"}`` (and ``"code"`` for ``python -c CODE ARGS``); the zygote answers
the child's pid on a line, then, once the child exits, its exit code as :func:`subprocess.run` reports it
(negative: a signal).
``tests/helpers.py`` is the client (:func:`run_cli` waits for the code; :func:`running_server` holds
the connection as its process's handle); it runs a fresh interpreter instead whenever the environment
it passes holds anything but ``PADIM_*`` settings (read at run time, never at import).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback

#: Imported once, for every child. Not OpenVINO (its thread pools do not survive a fork). padim reads its settings
#: when a command runs, never on import (tests/test_layers.py checks that): what `padim serve` and the other commands
#: import of padim is here (0.7 s of a server's start on an idle 2-core VM). prometheus_client chooses its value class
#: on import, from PROMETHEUS_MULTIPROC_DIR: each child chooses again in the request's environment (:func:`child`),
#: as the service's supervisor does in the children it forks.
WARM = (
    "numpy",
    "PIL.Image",
    "torch",
    "torchvision",
    # the exporter and the runtime a `padim export` and a server's first `--runtime auto` load use
    "torch.onnx",
    "onnx",
    "onnxscript",
    "onnxruntime",
    # what `padim serve` imports beside torch
    "scipy.special",
    "fastapi",
    "uvicorn",
    "pydantic_settings",
    "sqlalchemy",
    "prometheus_client",
    # padim: the command line, the service, and what the commands import when they run
    "padim.cli",
    "padim.service.server",
    "padim.service.record.store",
    "padim.models.fit.training",
    "padim.models.deploy.export",
    "padim.models.deploy.quantise",
    "padim.models.deploy.runtimes",
    "padim.models.evaluation.metrics",
    "padim.models.evaluation.drift",
    "padim.models.evaluation.report",
    "padim.models.repository",
)
for _name in WARM:
    importlib.import_module(_name)


def warm_the_exporter() -> None:
    """One export of a two-operation module, so that each child finds the exporter's operator registry built
    (torch.onnx's first dynamo export in a process takes about 2 s of CPU more than the next, 2-core VM). The
    module's tensors are too small for any parallel region, so no thread pool exists to cross the fork."""
    import contextlib
    import tempfile
    import warnings

    import torch

    class Warm(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.relu(x @ x.transpose(-1, -2)).sum(-1)

    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(), open(os.devnull, "w") as null:
        warnings.simplefilter("ignore")
        with contextlib.redirect_stdout(null):  # the exporter's progress lines; the client reads "ready" here
            torch.onnx.export(Warm(), (torch.randn(2, 4, 4),), os.path.join(folder, "warm.onnx"), dynamo=True)
    from tqdm import tqdm

    if tqdm.monitor is not None:  # the thread the exporter's progress bar started: none may cross the fork
        tqdm.monitor.exit()
        tqdm.monitor = None


warm_the_exporter()


def _open_new(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)


def child(request: dict) -> None:
    """Become ``python -m padim ARGS`` (or ``python -c CODE ARGS`` where the request has ``code``) as the request
    describes; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from prometheus_client import values  # its value class, chosen on import: chosen again in this environment

        values.ValueClass = values.get_value_class()
        os.setpgid(0, 0)  # a group of its own, as a test that stops a process and what it started needs
        null = os.open(os.devnull, os.O_RDONLY)
        out = _open_new(request["stdout"])
        # one file for both where the request names one (a server's log, as `stderr=STDOUT` gives)
        err = os.dup(out) if request["stderr"] == request["stdout"] else _open_new(request["stderr"])
        for source, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(source, target)
            os.close(source)
        sys.path[0] = os.getcwd()  # what ``python -m`` puts first
        try:
            if "code" in request:  # ``python -c``: the code as __main__, its arguments after "-c"
                sys.argv = ["-c", *request["args"]]
                exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - a test's
            else:
                sys.argv = ["padim", *request["args"]]
                runpy.run_module("padim", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:  # as the interpreter reports it
            if exit_.code is None:
                code = 0
            elif isinstance(exit_.code, int):
                code = exit_.code
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: non-daemon threads, then atexit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener], [], [], 0.02)
        if readable:
            connection, _ = listener.accept()
            with connection.makefile("rb") as reader:
                line = reader.readline()
            if not line:
                connection.close()
                continue
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                for other in children.values():
                    other.close()
                child(request)
            children[pid] = connection
            try:
                connection.sendall(f"{pid}\n".encode())
            except OSError:
                pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
