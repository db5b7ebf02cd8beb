"""An API process: HTTP, limits and keys, decoding into shared memory, verdicts, heat maps, the JSON, its rows.

It answers ``POST /score``, ``/models/{name}/score`` and ``/score/batch`` itself, with the same route code as a
single process (:mod:`padim.service.routes.score`) over :class:`ApiState`, and ``/health/*``; every other route is
passed on to the scoring process's HTTP API on the run folder's socket (:func:`proxy`), so that it answers as the
one service does.

    python -m padim.service.processes.api RUN_FOLDER ROW FD
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ..app import DESCRIPTION
from ..device.admission import SharedPlaces
from ..device.answers import answered, count_verdicts, keep_rows
from ..device.batching import ScoredImage
from ..device.decoding import Decoded, Decoder
from ..edge.errors import ApiError, install_error_handlers
from ..edge.middleware import BodyGuard, RequestContext
from ..edge.protocol import ConnectionLimits, guarded_protocol
from ..edge.running import SERVER_HEADER, DrainingServer, configure_logging, quiet_signals
from ..edge.schemas import LiveResponse
from ..metrics import Metrics
from ..record.recorder import Recorder
from ..record.store import RecordStore, database_url
from ..routes import score, versions
from ..settings import ServiceSettings
from ..state import each
from ..state.surface import ScoreSurface
from .shared import (
    DRAINING,
    PIXELS,
    READY,
    STARTING,
    STOPPED,
    RunFolder,
    ServedView,
    Slot,
    SlotPool,
    Table,
    journal_name,
)
from .supervisor import as_child
from .wire import Link, Stale

log = logging.getLogger("padim.service")

#: A request whose version was let go between the table's reading and the scoring process's: tried again this often.
STALE_TRIES = 3
#: An API process takes no connection off the shared socket until its link to the scoring process is up (a sibling
#: that can serve takes them meanwhile), for this long at most: past it, it accepts and answers 503 with the reason
#: (the scoring process itself is not running, and readiness should say so).
LINK_WAIT_S = 30.0
#: Headers that are the connection's, not the message's (RFC 9110 7.6.1), and those the API process sets itself.
HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"host",
}
ANSWER_OWN = {"connection", "keep-alive", "transfer-encoding", "date", "server", "x-request-id", "x-padim-route"}


def per_process(total: int, workers: int, least: int) -> int:
    """A service-wide bound split between ``workers`` API processes, at least ``least`` each."""
    return max(least, total // workers)


class ApiState(ScoreSurface[ServedView]):
    """What an API process holds: the table of served versions, its slots and link to the scoring process, its
    decoder and record; the score routes' :class:`~padim.service.state.surface.ScoreSurface`, as
    :class:`~padim.service.state.ServiceState` is in a single process."""

    def __init__(self, settings: ServiceSettings, run: RunFolder, row: int):
        self.settings, self.run, self.row = settings, run, row
        self.metrics = Metrics()
        self.table = Table(run)
        self.places = SharedPlaces(run.places, run.workers + 1, row, settings.max_queue, self.table.index)
        self.places.reset_row(row)  # a predecessor's places (it died) went with it
        self.slots = SlotPool(run, row, keep=max(16, 2 * -(-settings.max_queue // max(run.workers, 1))))
        self.link = Link(run, row)
        workers = run.workers
        self.decoder = Decoder(
            per_process(settings.decode_workers, workers, 1),
            per_process(settings.pixel_budget(), workers, settings.max_image_pixels),
            settings.max_image_pixels,
            settings.heatmap_max_side,
        )
        self.decode = self.decoder.pool
        self.recorder: Recorder | None = None  # this process's journal of the record: open_record
        self.draining = False
        self.startup_error: str | None = None

    # ----------------------------------------------------------------- lifecycle
    def open_record(self) -> None:
        """This process's journal of the record (its rows; the scoring process keeps the record itself)."""
        settings = self.settings
        if not settings.record_on:
            return
        folder = settings.record_folder()
        url = settings.record_url.get_secret_value() if settings.record_url is not None else None
        self.recorder = Recorder(
            folder,
            RecordStore(database_url(url, folder)),
            settings.record_journal_max_bytes,
            settings.record_max_bytes,
            settings.record_retention_days,
            settings.record_flagged_retention_days,
            self.metrics,
            journal_name(settings.replica, self.row),
            upkeep=False,
        )
        self.recorder.start()

    async def close(self) -> None:
        self.link.stop()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)
        self.decoder.shutdown()
        self.places.close()

    # ----------------------------------------------------------------- the score routes' surface
    @property
    def record(self) -> Recorder | None:
        return self.recorder

    def model(self, name: str | None) -> ServedView:
        if not self.link.up.is_set():
            raise ApiError(
                "not_ready",
                "the scoring process is not running; it is being started, retry shortly",
                headers={"Retry-After": "2"},
            )
        return self.table.served(name)

    @contextlib.contextmanager
    def using(self, served: ServedView) -> Iterator[ServedView]:
        """The scoring process holds the version for each of the request's pictures it takes."""
        yield served

    async def score_pictures(
        self,
        served: ServedView,
        datas: list[bytes],
        threshold: float | None,
        heatmap: bool,
        mask: bool,
        monitor: bool = True,
    ) -> tuple[ServedView, list[ScoredImage], list[dict], list[tuple[int, int]]]:
        """As :meth:`ServiceState.score_pictures`, the device being another process's: pictures decoded into slots,
        scored by the version ``served`` names or, when it was let go meanwhile, by the one that then serves, which
        comes first in what this returns: the answer, its metrics and its record rows name the version that scored."""
        with self.places.admit(served.name, len(datas)) as admission:
            for attempt in range(STALE_TRIES):
                try:
                    decoded, scored = await self._in_slots(served, datas, threshold, heatmap, mask, monitor, admission)
                    break
                except Stale:
                    if attempt == STALE_TRIES - 1:
                        raise ApiError(
                            "not_ready", "the model changed while this request waited; retry", {"Retry-After": "1"}
                        ) from None
                    served = self.table.served(served.name)
        results = await answered(self.decode, served.name, served.scorer, decoded, scored, threshold, heatmap, mask)
        return served, scored, results, [image.picture for image in decoded]

    async def _in_slots(
        self,
        served: ServedView,
        datas: list[bytes],
        threshold: float | None,
        heatmap: bool,
        mask: bool,
        monitor: bool,
        admission,
    ) -> tuple[list[Decoded], list[ScoredImage]]:
        """One try: the pictures decoded into slots and scored by the scoring process; :class:`Stale` when the version
        ``served`` names was let go meanwhile."""
        height, width = served.scorer.config.input_shape
        device = None if heatmap or mask else served.scorer.device_decode
        # a slot holds the model input (8-bit pixels), or a JPEG left to the scoring device; then the map
        size = (4 if heatmap or mask else 3) * height * width  # a float32 map is 4 bytes a pixel
        slots = [self.slots.take(max(size, len(data) if device else 0)) for data in datas]
        handed = False
        try:
            decoded = await each(
                self.decoder.decoded(served.scorer, data, heatmap, slot.tensor(3, height, width, dtype=PIXELS), device)
                for data, slot in zip(datas, slots, strict=True)
            )
            for image, slot in zip(decoded, slots, strict=True):
                if image.jpeg is not None:
                    slot.memory[: len(image.jpeg)] = image.jpeg
            admission.queued(len(decoded))
            raw_threshold = served.scorer.calibration.raw_threshold(threshold)
            handed = True  # from here the slots are the link's until it answers
            numbers = await self.link.score(
                served.serial,
                (height, width),
                [
                    (slot, 0 if image.jpeg is None else len(image.jpeg))
                    for slot, image in zip(slots, decoded, strict=True)
                ],
                raw_threshold,
                heatmap or mask,
                monitor,
                threshold is not None,
                done=functools.partial(self.slots.give, slots),
            )
            try:
                return decoded, [
                    ScoredImage(*one, map=_map(slot, height, width) if heatmap or mask else None)
                    for one, slot in zip(numbers, slots, strict=True)
                ]
            finally:
                self.slots.give(slots)  # their maps are read (copied): the slots are free again
        finally:
            if not handed:
                self.slots.give(slots)

    def observe(self, model: ServedView, results: list[dict], own_threshold: bool) -> None:
        count_verdicts(self.metrics, model.name, model.version, results, own_threshold)

    def keep(self, model: ServedView, datas, digests, fields, scored, results, pictures) -> list:
        assert self.recorder is not None
        return keep_rows(
            self.recorder,
            self.settings.review_sample,
            model.name,
            model.version,
            datas,
            digests,
            fields,
            scored,
            results,
            pictures,
        )


def _map(slot: Slot, height: int, width: int):
    return slot.tensor(height, width).clone()  # the slot is reused once the answer is built


# --------------------------------------------------------------------------- the app
#: Why an API process cannot serve while its scoring process is gone (readiness's reason, a score request's error).
SCORING_DOWN = "the scoring process is not running; it is being restarted"


def create_api_app(state: ApiState, on_fatal=None) -> FastAPI:
    """The API process's app: the score routes and health here, every other route passed on."""
    client = httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=str(state.run.engine_socket)),
        base_url="http://padim",
        timeout=httpx.Timeout(None, connect=5.0),
    )
    app = FastAPI(
        title="padim",
        description=DESCRIPTION,
        lifespan=_lifespan(state, client, on_fatal),
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.service = state
    app.state.lines = None
    install_error_handlers(app)
    proxy = _proxy(client)

    @app.get("/health/live", include_in_schema=False)
    async def live() -> LiveResponse:
        return LiveResponse(status="alive")

    @app.get("/health/ready", include_in_schema=False)
    async def ready(request: Request):
        reason = _unready(state)
        if reason is None:
            try:
                return await proxy(request)
            except ApiError as error:  # it died before this process's link saw it go: the same answer as after
                if error.code != "not_ready":
                    raise
                reason = "failed: " + SCORING_DOWN
        return JSONResponse({"status": "not_ready", "reason": reason}, status_code=503)

    app.include_router(score.router)
    app.add_api_route(
        "/{path:path}",
        proxy,
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
        include_in_schema=False,
    )
    _add_middleware(app, state)
    return app


def _lifespan(state: ApiState, client: httpx.AsyncClient, on_fatal):
    """The API process's start (its journal of the record, the link to the scoring process) and stop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.run.set_state(state.row, STARTING, os.getpid())
        try:
            await asyncio.to_thread(state.open_record)
        except Exception as error:  # its journal is another process's: one line, and the process exits
            state.startup_error = (str(error).splitlines() or [type(error).__name__])[0]
            log.error("start-up failed: %s", state.startup_error)
            if on_fatal is not None:
                on_fatal()
        state.link.start(asyncio.get_running_loop())
        if state.startup_error is None:
            await _linked(state, LINK_WAIT_S)
        watching = asyncio.create_task(_mark_ready(state), name="ready")
        try:
            yield
        finally:
            watching.cancel()
            state.draining = True
            state.run.set_state(state.row, STOPPED)
            await client.aclose()
            await state.close()

    return lifespan


def _proxy(client: httpx.AsyncClient):
    """The route that passes a request on to the scoring process's HTTP API."""

    async def proxy(request: Request) -> Response:
        """The request as the scoring process's HTTP API answers it, streamed both ways."""
        headers = [(k, v) for k, v in request.scope["headers"] if k not in HOP]
        headers.append((b"x-request-id", request.scope["state"]["request_id"].encode()))
        has_body = request.method not in ("GET", "HEAD", "DELETE", "OPTIONS")
        upstream_request = client.build_request(
            request.method,
            httpx.URL(path=request.url.path, query=request.url.query.encode("latin-1") or None),
            headers=headers,
            content=request.stream() if has_body else None,
        )
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.TransportError:
            raise ApiError("not_ready", f"{SCORING_DOWN}, retry shortly", headers={"Retry-After": "2"}) from None
        route = upstream.headers.get("x-padim-route")
        if route is not None:
            request.scope["state"]["route"] = route
        model = upstream.headers.get("x-padim-model")
        if model is not None:
            request.scope["state"]["model"] = model
        return StreamingResponse(
            upstream.aiter_raw(),
            status_code=upstream.status_code,
            headers={k: v for k, v in upstream.headers.items() if k.lower() not in ANSWER_OWN | {"x-padim-model"}},
            background=BackgroundTask(upstream.aclose),
        )

    return proxy


def _add_middleware(app: FastAPI, state: ApiState) -> None:
    """The score routes' fast path, the body's limits, and the request's context (outermost)."""
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
    app.add_middleware(RequestContext, metrics=state.metrics, draining=lambda: state.draining)


def _unready(state: ApiState) -> str | None:
    """Why this process or a sibling cannot serve, before the scoring process is asked; ``None`` if nothing."""
    if state.draining:
        return "draining"
    if state.startup_error is not None:
        return "failed: " + state.startup_error
    if not state.link.up.is_set():
        return "failed: " + SCORING_DOWN
    table = state.table.current()  # what score requests are admitted against: ready only once it says so too
    if not table.get("ready"):
        return "failed: " + table["failure"] if table.get("failure") else "loading"
    for row in range(1, state.run.workers + 1):
        if row == state.row:
            continue
        status, pid = state.run.state(row)
        if status != READY or not alive(pid):  # a process killed a moment ago still says ready
            return f"failed: API process {row} of {state.run.workers} is not running; it is being replaced"
    return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie waiting for the supervisor to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


async def _linked(state: ApiState, wait_s: float) -> bool:
    """Wait, at most ``wait_s``, for the link to the scoring process. The lifespan's start-up awaits it, and uvicorn
    listens only after the start-up: until then the kernel hands the shared socket's connections to siblings that
    can serve them, so a replacement never answers 503 for a request one of them would have served."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not state.link.up.is_set():
        if loop.time() >= deadline:
            log.warning("no link to the scoring process after %g s: accepting, answering 503 until it is up", wait_s)
            return False
        await asyncio.sleep(0.01)
    return True


async def _mark_ready(state: ApiState) -> None:
    """This process's row says ready while its link to the scoring process is up."""
    while True:
        want = DRAINING if state.draining else (READY if state.link.up.is_set() else STARTING)
        if state.run.state(state.row)[0] != want:
            state.run.set_state(state.row, want)
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------- the process
def main(argv: list[str]) -> int:
    root, row, descriptor, secrets = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    role = f"api-{row}"
    as_child(role)
    run = RunFolder(root)
    settings = run.settings(secrets)
    configure_logging(settings.log_level, role=role)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request passed on: the access log has them
    torch.set_num_threads(1)  # its torch ops are small; the cores are for decoding and the device's process
    state = ApiState(settings, run, row)
    server: DrainingServer | None = None

    def stop() -> None:
        if server is not None:
            server.should_exit = True

    app = create_api_app(state, on_fatal=stop)
    limits = ConnectionLimits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        header_timeout_s=settings.header_timeout_s,
        max_connections=per_process(settings.max_connections, run.workers, 1),
        max_discard_bytes=settings.max_discard_bytes,
    )
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=settings.drain_timeout_s,  # type: ignore[arg-type]  # uvicorn: int, takes float
        lifespan="on",
        http=guarded_protocol(limits),
        timeout_keep_alive=settings.keep_alive_timeout_s,  # type: ignore[arg-type]  # uvicorn: int, takes float
        server_header=False,
        headers=[("server", SERVER_HEADER)],
    )
    server = DrainingServer(config, state)
    listening = socket.socket(fileno=descriptor)
    with quiet_signals():
        server.run(sockets=[listening])
    return 1 if state.startup_error else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
