"""The supervisor's children (service/processes/supervisor.py): forked, or in a new interpreter where the scoring
process may use a GPU. `padim serve --workers 2` runs the forked ones in tests/service/processes/test_processes.py;
here the new interpreter, which a CPU never asks for, is started and drained as the supervisor does it."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import torch

from padim.service.processes.shared import READY, RunFolder
from padim.service.processes.supervisor import SUPERVISOR, Child, Supervisor, may_use_a_gpu
from padim.service.settings import ServiceSettings


def test_a_scoring_process_is_forked_unless_it_may_use_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (may_use_a_gpu("cpu"), may_use_a_gpu("auto"), may_use_a_gpu("cuda")) == (False, False, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (may_use_a_gpu("cpu"), may_use_a_gpu("auto")) == (False, True)


def test_a_scoring_process_in_a_new_interpreter_starts_named_alone_and_drains_to_zero(model_file):
    settings = ServiceSettings(models=[model_file], device="cpu")
    run = RunFolder.create(settings, workers=1)
    listening = socket.create_server(("127.0.0.1", 0))
    listening.set_inheritable(True)
    env = {"PROMETHEUS_MULTIPROC_DIR": str(run.metrics), SUPERVISOR: str(os.getpid())}
    child = Child(
        0, "padim.service.processes.scoring", [str(run.root)], fresh=True, not_inherited=(listening,), env=env
    )
    try:
        child.start(run)
        assert child.process is not None
        deadline = time.monotonic() + 120
        while run.state(0)[0] != READY:
            assert child.process.poll() is None, f"the scoring process exited with {child.process.returncode}"
            assert time.monotonic() < deadline, "the scoring process was not ready in time"
            time.sleep(0.05)
        pid = child.process.pid
        assert Path(f"/proc/{pid}/comm").read_text().strip() == "padim-scoring"
        assert os.getsid(pid) == pid  # a session of its own: a terminal's Ctrl-C is the supervisor's
        inode = f"socket:[{os.fstat(listening.fileno()).st_ino}]"
        assert all(os.readlink(fd) != inode for fd in Path(f"/proc/{pid}/fd").iterdir())
        child.process.send_signal(signal.SIGTERM)
        assert child.process.wait(60) == 0
    finally:
        if child.process is not None and child.process.poll() is None:
            child.process.kill()
            child.process.wait()
        listening.close()
        run.remove()


def test_on_a_cpu_every_child_is_forked_and_only_the_api_processes_get_the_port(model_file, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    settings = ServiceSettings(models=[model_file], device="auto", port=0, host="127.0.0.1")
    supervisor = Supervisor(settings, workers=2)
    try:
        assert [(c.row, c.module.rsplit(".", 1)[1], c.fresh) for c in supervisor.children] == [
            (0, "scoring", False),
            (1, "api", False),
            (2, "api", False),
        ]
        descriptor = supervisor.listening.fileno()
        assert [c.pass_fds for c in supervisor.children] == [(), (descriptor,), (descriptor,)]
    finally:
        supervisor.listening.close()
        supervisor.run.remove()
