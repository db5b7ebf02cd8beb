"""``padim serve``: the model files checked, then the app under uvicorn in this process, or a supervisor and its
processes (:mod:`padim.service.processes`)."""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

from padim.core.artifact import read_header
from padim.models.deploy.export import METADATA_FILE, read_export
from padim.models.devices import resolve_device, usable_cpus
from padim.models.errors import UsageError
from padim.models.repository import Repository

from .app import create_app
from .edge.protocol import ConnectionLimits, guarded_protocol
from .edge.running import SERVER_HEADER, DrainingServer, configure_logging, quiet_signals
from .lines.pipeline import check_file
from .processes.supervisor import Supervisor, default_workers
from .settings import ServiceSettings
from .state import model_name

GIL_SWITCH_INTERVAL = 0.0005  # seconds


def served_files(settings: ServiceSettings) -> list[Path]:
    """The model files (or export directories) the settings serve, each checked now: a missing, truncated,
    foreign or newer one is a one-line ArtifactError before anything starts."""
    if settings.repository is not None:  # the active version of each model: checked as any model file, now
        repository = Repository(settings.repository)
        files = []
        for name in repository.names():
            active = repository.active(name)
            assert active is not None
            files.append(repository.version(name, active).path)
    else:
        files = settings.model_files()
        if not files:
            raise UsageError(
                "no model to serve: pass --model FILE (repeatable), set PADIM_MODEL_DIR, or serve a "
                "repository (--repository DIR)"
            )
    for path in files:
        if (path / METADATA_FILE).is_file():
            read_export(path)
        else:
            read_header(path)
    return files


def check_lines(settings: ServiceSettings, files: list[Path]) -> None:
    """PADIM_LINES against the models these settings serve (``padim serve --check-lines``, and every start).

    Raises:
        LineConfigError: naming the line and the field.
    """
    if settings.lines is None:
        return
    if settings.repository is not None:
        names = Repository(settings.repository).names()
    else:
        names = [model_name(p) for p in files]
    default = settings.default_model or (names[0] if names else None)
    check_file(settings.lines, names, default)


def workers_for(settings: ServiceSettings) -> int:
    """API processes: ``PADIM_WORKERS``, else :func:`~.processes.supervisor.default_workers` for this machine."""
    if settings.workers is not None:
        return settings.workers
    return default_workers(resolve_device(settings.device).type, usable_cpus())


def serve(settings: ServiceSettings) -> int:
    """Validate the model files (and lines), then serve until a signal; returns the exit code.

    With more than one worker, a supervisor runs API processes beside one scoring process
    (:mod:`padim.service.processes`); with one, this process does everything.
    """
    check_lines(settings, served_files(settings))
    workers = workers_for(settings)
    if workers > 1:
        configure_logging(settings.log_level, role="supervisor")
        return Supervisor(settings, workers).serve()
    configure_logging(settings.log_level)
    # The scoring thread needs the GIL between every torch op of a forward pass; with the event
    # loop and decode threads busy, the default 5 ms switch interval makes it wait for the GIL
    # between ops (measured on 2 cores: a batch of 8 beside a busy Python thread took 1464 ms
    # with 5 ms, 765 ms with 0.5 ms; 200 ms alone).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    server: DrainingServer | None = None

    def stop() -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=stop)
    limits = ConnectionLimits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        header_timeout_s=settings.header_timeout_s,
        max_connections=settings.max_connections,
        max_discard_bytes=settings.max_discard_bytes,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=settings.drain_timeout_s,  # type: ignore[arg-type]  # uvicorn: int, takes float
        lifespan="on",
        http=guarded_protocol(limits),
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn: int, takes float
        server_header=False,
        headers=[("server", SERVER_HEADER)],
    )
    server = DrainingServer(config, app.state.service)
    with quiet_signals():
        server.run()
    return 1 if app.state.service.startup_error else 0
