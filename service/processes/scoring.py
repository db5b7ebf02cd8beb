"""The scoring process: the models, their versions and batchers on the device, the monitor, lines, update jobs and
the record's upkeep; the whole HTTP API on the run folder's ``engine.sock`` for what API processes pass on; and
pictures to score from them on ``score.sock`` (:class:`~.wire.Intake`).

It tells the API processes what it serves through the run folder's table (:class:`Publisher`): after every change of
a version at once, and its readiness within :data:`PUBLISH_EVERY_S`.

    python -m padim.service.processes.scoring RUN_FOLDER
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import uvicorn

from ..app import create_app
from ..device.admission import MAX_MODELS, SharedPlaces
from ..edge.running import DrainingServer, configure_logging, quiet_signals
from .shared import READY, STARTING, RunFolder, journal_name, view_of
from .supervisor import as_child
from .wire import Intake

log = logging.getLogger("padim.service")

#: Seconds between two looks at the readiness the table shows.
PUBLISH_EVERY_S = 0.1


class Publisher:
    """Writes the table of what the scoring process serves, and numbers its models for the queue bound.

    A model keeps its number for the run folder's life (a restarted scoring process reads the numbers back), since
    the API processes' counts are kept by number.
    """

    def __init__(self, run: RunFolder):
        self.run = run
        previous = run.table()
        self.indices: dict[str, int] = dict(previous.get("indices", {}))
        self.first_serial = int(previous.get("last_serial", 0))  # serials go on from the previous process's
        self.state = None
        self._shown: tuple | None = None
        self._written: set[int] = set()
        self._lock = threading.Lock()
        for stale in (run.root / "views").glob("*.json"):  # a previous process's views
            stale.unlink(missing_ok=True)

    def index(self, name: str) -> int:
        with self._lock:
            if name not in self.indices:
                if len(self.indices) >= MAX_MODELS:
                    raise RuntimeError(f"more than {MAX_MODELS} models in one service")
                self.indices[name] = len(self.indices)
            return self.indices[name]

    def readiness(self) -> tuple:
        state = self.state
        assert state is not None
        failure = state.failure or (state.startup_error and f"start-up failed: {state.startup_error}")
        return state.ready and not state.draining and state.failure is None, failure, state.default_name

    def check(self) -> None:
        """On the event loop: publish when readiness changed since the last table."""
        if self.readiness() != self._shown:
            self.publish()

    def publish(self) -> None:
        """On the event loop: the table as the state is now (after a version changed, or readiness)."""
        state = self.state
        assert state is not None
        ready, failure, default = self._shown = self.readiness()
        models = {name: {"serial": m.serial, "version": m.version} for name, m in state.models.items()}
        for name in models:
            self.index(name)
        loaded = {m.serial: m for m in [*state.models.values(), *state.retired] if m.scorer is not None}
        views = {
            serial: view_of(m.name, m.version, serial, m.sha256, m.scorer, m.batcher.device is not None)
            for serial, m in loaded.items()
            if serial not in self._written
        }
        table = {
            "engine": os.getpid(),
            "ready": ready,
            "failure": failure,
            "default": default,
            "models": models,
            "indices": dict(self.indices),
            "last_serial": state.versions.serials,
        }
        self.run.publish(table, views)
        self._written = set(loaded)
        self.run.forget_views(keep=set(loaded))
        self.run.set_state(0, READY if ready else STARTING, os.getpid())


def main(argv: list[str]) -> int:
    as_child("scoring")
    run = RunFolder(Path(argv[0]))
    settings = run.settings(int(argv[1]))
    configure_logging(settings.log_level, role="scoring")
    run.set_state(0, STARTING, os.getpid())
    publisher = Publisher(run)
    places = SharedPlaces(run.places, run.workers + 1, 0, settings.max_queue, publisher.index)
    places.reset_row(0)
    server: DrainingServer | None = None

    def stop() -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=stop, places=places, front=False)
    state = app.state.service
    state.versions.serials = publisher.first_serial
    state.recording.siblings = tuple(journal_name(settings.replica, row) for row in range(1, run.workers + 1))
    publisher.state = state
    state.versions.on_change = publisher.publish
    intake = Intake(run, state)
    watching = threading.Event()

    def watch() -> None:  # readiness, lost a GPU, a drain: into the table within PUBLISH_EVERY_S
        while not watching.wait(PUBLISH_EVERY_S):
            loop = state.versions.loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(publisher.check)
                except RuntimeError:
                    return

    threading.Thread(target=watch, name="publish", daemon=True).start()
    run.engine_socket.unlink(missing_ok=True)
    config = uvicorn.Config(
        app,
        uds=str(run.engine_socket),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=settings.drain_timeout_s,  # type: ignore[arg-type]  # uvicorn: int, takes float
        lifespan="on",
        # the API processes keep their connections
        timeout_keep_alive=max(settings.keep_alive_timeout_s, 60.0),  # type: ignore[arg-type]  # uvicorn: int, takes float
        server_header=False,
    )
    server = DrainingServer(config, state)
    try:
        with quiet_signals():
            server.run()
    finally:
        watching.set()
        intake.close()
        places.close()
    return 1 if state.startup_error else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
