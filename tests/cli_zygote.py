"""A warm interpreter that forks one child per ``padim`` command line a test runs.

Importing torch and torchvision takes about 8 s of CPU on the 2-core CI machines (torchvision imports
``torch._dynamo``), and the suite runs the command line a few hundred times: most of that time was
the same imports again. This process imports those libraries once (and nothing of padim, nor anything
that reads the environment when imported), then for each request forks a child that becomes
``python -m padim ARGS``: its own process with the request's working folder, environment, stdin from
/dev/null, stdout and stderr to the files named, the module run as ``-m`` runs it, Python's exit
(threads joined, ``atexit``, streams flushed) and its exit status, which this process reports back.

Protocol on a unix socket, one connection per command line: the client sends one JSON line
``{"args", "env", "cwd", "stdout", "stderr"}``; the zygote answers the child's pid on a line, then,
once the child exits, its exit code as :func:`subprocess.run` reports it (negative: a signal).
``tests/helpers.py`` (:func:`run_cli`) is the client; it runs a fresh interpreter instead whenever the
environment it passes holds anything but ``PADIM_*`` settings (read at run time, never at import).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback

import numpy  # noqa: F401  (imported once, for every child)
import PIL.Image  # noqa: F401
import torch  # noqa: F401
import torchvision  # noqa: F401


def child(request: dict) -> None:
    """Become ``python -m padim ARGS`` as the request describes; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for source, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(source, target)
            os.close(source)
        sys.path[0] = os.getcwd()  # what ``python -m`` puts first
        sys.argv = ["padim", *request["args"]]
        try:
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
