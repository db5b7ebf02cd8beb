"""Builds the FastAPI application."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from padim.core import __version__
from padim.models.errors import UsageError

from .device.admission import Places
from .edge.errors import install_error_handlers
from .edge.middleware import BodyGuard, RequestContext
from .edge.openapi import truthful_openapi
from .lines.pipeline import Lines
from .routes import health, lines, metrics, models, records, score, updates, versions
from .settings import ServiceSettings, get_settings
from .state import ServiceState

log = logging.getLogger("padim.service")

#: Routers whose routes need the API key when one is set (see deps.require_api_key).
PROTECTED_TAGS = {str(r.tags[0]) for r in (score.router, models.router, lines.router)}

DESCRIPTION = """PaDiM anomaly scoring. `POST /score` with an image (multipart field `file`, or the raw
body with an `image/*` or `application/octet-stream` content type) returns its score (0..1, threshold
at 0.5), the verdict, the anomalous area and, on request, a heat map and a mask. Errors are
`{"error": {"code", "message"}}`. Before a request reaches a route, the connection limits answer 431
(headers over PADIM_MAX_HEADER_BYTES or PADIM_MAX_HEADERS), 408 (headers slower than
PADIM_HEADER_TIMEOUT_S) and 503 `too_many_connections` (over PADIM_MAX_CONNECTIONS)."""


def create_app(
    settings: ServiceSettings | None = None,
    on_fatal: Callable[[], None] | None = None,
    places: Places | None = None,
    front: bool = True,
) -> FastAPI:
    """The app. Models load in the background once it starts; ``/health/ready`` says when they are warm.

    Args:
        settings: defaults to :func:`get_settings` (environment).
        on_fatal: called when start-up fails (the server uses it to exit non-zero).
        places: the queue bound's counts, when shared with other processes (:mod:`padim.service.processes`).
        front: it faces clients; ``False`` in the scoring process of a service in several processes, whose API
            processes count and log the requests they pass on.
    """
    state = ServiceState(settings or get_settings(), places=places)
    running = Lines(state, state.settings.lines) if state.settings.lines is not None else None
    app = FastAPI(
        title="padim", version=__version__, description=DESCRIPTION, lifespan=_lifespan(state, running, on_fatal)
    )
    app.state.service = state
    app.state.lines = running
    install_error_handlers(app)
    _include_routers(app, state.settings, lines_on=running is not None)
    _add_console(app)
    _add_middleware(app, state, front)
    return app


def _lifespan(state: ServiceState, running: Lines | None, on_fatal: Callable[[], None] | None):
    """Start: the record, then the models in the background (and the repository's poll); stop: drain, close."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = None
        try:
            await asyncio.to_thread(state.open_record)
        except UsageError as error:  # its journal is another process's: unready, one line, and the process exits
            _start_failed(state, on_fatal, error)
        else:
            loading = asyncio.create_task(_load(state, on_fatal, running), name="load-models")
        polling = (
            asyncio.create_task(state.changes.poll(), name="repository-poll")
            if state.settings.repository_poll_s is not None
            else None
        )
        try:
            yield
        finally:
            state.draining = True
            for task in (loading, polling):
                if task is not None and not task.done():
                    task.cancel()
            if running is not None:
                await running.stop()
            await state.close()

    return lifespan


def _include_routers(app: FastAPI, settings: ServiceSettings, lines_on: bool) -> None:
    """The routes the settings switch on (a route that is off does not exist: 404, and not in OpenAPI)."""
    for module in (health, models, score, metrics):
        app.include_router(module.router)
    if lines_on:  # the lines' routes exist only when PADIM_LINES is set
        app.include_router(lines.router)
    if settings.admin_key is not None:  # without an admin key the admin routes do not exist
        app.include_router(versions.router)
    if settings.record_on:  # the record's routes exist only when it is on
        app.include_router(records.router)
        app.include_router(updates.jobs)
        if settings.admin_key is not None:
            app.include_router(updates.router)
    any_key = any(k is not None for k in (settings.api_key, settings.admin_key, settings.review_key))
    app.openapi = lambda: truthful_openapi(  # type: ignore[method-assign]  # FastAPI's documented override
        app,
        PROTECTED_TAGS,
        api_key_required=settings.api_key is not None,
        batch_limit=settings.batch_limit(),
        any_key=any_key,
    )


def _add_middleware(app: FastAPI, state: ServiceState, front: bool) -> None:
    """The score routes' fast path, the body's limits and the request's context, innermost first."""
    settings = state.settings
    app.add_middleware(score.ScoreFastPath)  # innermost: behind the body's limits and the request's context
    app.add_middleware(
        BodyGuard,
        max_bytes=settings.max_upload_bytes,
        timeout_s=settings.body_timeout_s,
        max_discard_bytes=settings.max_discard_bytes,
        model_uploads=(versions.UPLOAD_PATH, settings.max_model_upload_bytes, settings.model_upload_timeout_s)
        if settings.admin_key is not None
        else None,
    )
    # outermost: sees every response, and answers the requests a drain timeout cancels
    app.add_middleware(RequestContext, metrics=state.metrics, draining=lambda: state.draining, counted=front)


#: The inspection console: static files in the package, served at ``/`` (no build step, no CDN).
CONSOLE = Path(__file__).parent / "console"
#: The console loads nothing from elsewhere; images it shows are blob: (uploads) and data: (heat maps).
CONSOLE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _add_console(app: FastAPI) -> None:
    """``GET /``: the console page; ``/console/*``: its script and style. Open, like ``/docs``:
    the page holds no data, and its API calls carry the key the user types in."""

    @app.get("/", include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(CONSOLE / "index.html", media_type="text/html", headers=CONSOLE_HEADERS)

    app.mount("/console", StaticFiles(directory=CONSOLE, html=False), name="console")


async def _load(state: ServiceState, on_fatal: Callable[[], None] | None, running: Lines | None = None) -> None:
    """Load the models, then start the lines (which need them)."""
    try:
        await state.load()
        if running is not None:
            await running.start()
    except Exception as error:  # any failure here means the service cannot do its job
        _start_failed(state, on_fatal, error)


def _start_failed(state: ServiceState, on_fatal: Callable[[], None] | None, error: Exception) -> None:
    """The service cannot do its job: unready with the first line of why, logged, and the process told to exit."""
    state.startup_error = (str(error).splitlines() or [type(error).__name__])[0]
    log.error("start-up failed: %s", state.startup_error)
    if on_fatal is not None:
        on_fatal()
