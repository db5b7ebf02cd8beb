"""A real load balancer for the replicas' tests and benchmark: Debian's haproxy on 127.0.0.1 at a free port.

It sends each request to a replica whose ``/health/ready`` answers 200 (checked every 300 ms, so a draining or
killed replica is taken out within a second), and **retries** a request that failed before an answer came (the
connection refused or reset, no response, a 502/503/504) on another replica: ``retry-on all-retryable-errors``
with the body buffered (``option http-buffer-request``; bodies up to ``tune.bufsize``, 1 MiB here). This is
what docs/kubernetes.md recommends in front of padim where Kubernetes' Service (which does not retry) is not
enough.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import components
from helpers import free_port

CONFIG = """\
global
    maxconn 512
    tune.bufsize 1048576
defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch 1
    retry-on all-retryable-errors
    option http-buffer-request
    default-server inter 300ms fall 2 rise 2
frontend padim
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /health/ready
    http-check expect status 200
{servers}
"""


class Balancer:
    """haproxy in front of the replicas at ``ports`` (name -> port); one not started yet is down until it is."""

    def __init__(self, folder: Path, ports: dict[str, int]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        servers = "\n".join(f"    server {name} 127.0.0.1:{port} check" for name, port in ports.items())
        config = folder / "haproxy.cfg"
        config.write_text(CONFIG.format(port=self.port, servers=servers))
        self.log = folder / "haproxy.log"
        with open(self.log, "w") as handle:
            self.process = subprocess.Popen(
                [components.haproxy_path(), "-f", str(config), "-db"], stdout=handle, stderr=subprocess.STDOUT
            )
        deadline = time.time() + 10
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.log.read_text()}")
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("haproxy did not listen in time")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def __enter__(self) -> Balancer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
