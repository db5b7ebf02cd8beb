"""A throwaway PostgreSQL cluster for the record's tests: ``initdb`` and ``pg_ctl`` from Debian's server programs.

The server refuses to run as root, so as root it runs as Debian's ``postgres`` user, in a folder under /tmp that
user can enter (pytest's base folder, /tmp/pytest-of-root, is mode 0700). It listens on 127.0.0.1 at a free port
with ``trust`` authentication for the ``padim`` role, and is stopped and removed at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import components
from helpers import free_port


class Cluster:
    def __init__(self):
        self.bin = Path(components.postgres_bin())
        self.folder = Path(tempfile.mkdtemp(prefix="padim-pg-", dir="/tmp"))
        os.chmod(self.folder, 0o755)
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.folder, "postgres", "postgres")
        self.data = self.folder / "data"
        self.port = free_port()
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "padim", "-E", "UTF8", "--no-sync")
        self.start()

    def _run(self, program: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(self.bin / program), *args]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"{program} failed ({result.returncode}): {result.stderr or result.stdout}")
        return result

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.folder / "server.log"), "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://padim@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = f"record_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=padim dbname=postgres", autocommit=True) as db:
            db.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def wait_accepting(self, timeout: float = 30.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self._run("pg_isready", "-h", "127.0.0.1", "-p", str(self.port), check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError("PostgreSQL did not accept connections in time")

    def remove(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.folder, ignore_errors=True)
