"""Runs lines: each picture through the served model's micro-batcher (as ``POST /score``), into the journal and its
outboxes, to the sinks; and into the inspection record when it is on.

One picture, in order (each step's crash leaves the next run to finish it, and nothing twice):

1. the picture is complete (:mod:`.sources`); its key is its source and its content's sha256;
2. a key the journal has is not scored again; otherwise it is scored, and its verdict journaled **and** put in every
   sink's outbox in one transaction (:meth:`.LineJournal.add`);
3. with the record on, its row (whose id comes from the key, so a second attempt inserts nothing) is made durable;
4. the file is moved to ``done/`` or ``flagged/`` (a picture left in its folder, or found again after a crash,
   is not scored again: its key is in the journal).

Each sink's deliverer takes its outbox oldest first, and removes a message only once the sink confirmed it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import signal
import sqlite3
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

from ..device.batching import ScoredImage
from ..edge.errors import ApiError
from ..record.rows import make_row
from ..state import ServedModel, ServiceState
from .config import CameraSource, Line, LinesFile, check_lines, read_lines
from .journal import LineJournal, OutboxFull
from .outboxes import Outboxes
from .sinks import MqttTrigger, Sink, make_sink
from .sources import Camera, HotFolder, Picture

log = logging.getLogger("padim.lines")

#: Seconds the record may take to make a line picture's row durable before the picture is tried again later.
RECORD_TIMEOUT_S = 30.0
#: How long a full queue (the batcher's) makes the line wait before it looks again.
BUSY_WAIT_S = 0.05
#: How long a journal that cannot be written (its disk is full) makes the line wait before it tries a picture again.
UNWRITABLE_WAIT_S = 1.0


class LineRunner:
    """One line: its source, its journal, its sinks and their deliverers."""

    def __init__(self, state: ServiceState, config: Line, state_dir: Path):
        self.state, self.config = state, config
        self.metrics = state.metrics
        self.sink_names = config.sink_names()
        self.journal = LineJournal(
            state_dir / f"{config.name}.sqlite", self.sink_names, config.outbox.max_messages, config.outbox.when_full
        )
        self.heatmaps = state_dir / "heatmaps" / config.name
        self.source: HotFolder | Camera = (
            Camera(config.source) if isinstance(config.source, CameraSource) else HotFolder(config.source)
        )
        self.trigger_client: MqttTrigger | None = None
        self.sinks: list[Sink] = [
            make_sink(s, n, config.name) for s, n in zip(config.sinks, self.sink_names, strict=True)
        ]
        self._tasks: list[asyncio.Task] = []
        self._in_flight: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self._turn: asyncio.Event | None = None  # set once the latest picture taken is journaled (or dropped)
        self.seen_times: deque[float] = deque(maxlen=600)
        self.counts = dict.fromkeys(("received", "scored", "flagged", "late", "rejected", "deferred"), 0)
        self.last: dict | None = None  # the latest message
        self.last_picture: bytes | None = None
        self.outboxes = Outboxes(
            config.name, self.journal, self.sinks, self.metrics, config.outbox.max_messages, self._delivered_first
        )
        for outcome in self.counts:
            self.metrics.line_pictures.labels(config.name, outcome)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.config.heatmaps:
            self.heatmaps.mkdir(parents=True, exist_ok=True)
        for sink in self.sinks:
            await sink.start()
        self.source.start()
        source = self.config.source
        if isinstance(source, CameraSource) and source.trigger is not None:
            camera = self.source
            assert isinstance(camera, Camera)
            self.trigger_client = MqttTrigger(source.trigger, self.config.name, camera.trigger)
            self.trigger_client.start()
        name = self.config.name
        self._tasks = [asyncio.create_task(self._take(), name=f"line-{name}")]
        self._tasks += [
            asyncio.create_task(self.outboxes.deliver(sink), name=f"line-{name}-{sink.name}") for sink in self.sinks
        ]
        self._tasks.append(asyncio.create_task(self._show(), name=f"line-{name}-metrics"))
        log.info(
            "line started", extra={"line": name, "source": self.source.describe()["type"], "sinks": self.sink_names}
        )

    async def stop(self) -> None:
        """Stop taking pictures, finish those being scored, give the sinks a last chance to deliver, close."""
        self._tasks[0].cancel()
        await asyncio.gather(self._tasks[0], return_exceptions=True)
        if self._in_flight:
            await asyncio.wait(self._in_flight, timeout=10)
        self.source.stop()
        if self.trigger_client is not None:
            self.trigger_client.stop()
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks[1:], return_exceptions=True)
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                await sink.close()
        await asyncio.to_thread(self.journal.close)

    # ------------------------------------------------------------------ pictures in
    async def _take(self) -> None:
        async for picture in self.source.pictures():
            self.count("received")
            await self.outboxes.room()
            if self.outboxes.unwritable is not None:  # tried again, a picture at a time, until the journal takes one
                await asyncio.sleep(UNWRITABLE_WAIT_S)
            await self._slots.acquire()
            # scored side by side (the batcher batches them), journaled in the order they came: verdicts leave in
            # the order of the parts on the belt
            previous, self._turn = self._turn, asyncio.Event()
            task = asyncio.create_task(self._in_turn(picture, previous, self._turn))
            self._in_flight.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._in_flight.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("a line picture failed", exc_info=task.exception(), extra={"line": self.config.name})

    def key(self, picture: Picture) -> str:
        return f"{self.config.name}:{picture.source_id}:{picture.sha256}"

    async def _in_turn(self, picture: Picture, previous: asyncio.Event | None, turn: asyncio.Event) -> None:
        try:
            await self._one(picture, previous, turn)
        finally:
            turn.set()

    async def _one(self, picture: Picture, previous: asyncio.Event | None, turn: asyncio.Event) -> None:
        self.seen_times.append(picture.seen)
        key = self.key(picture)
        entry = await asyncio.to_thread(self.journal.get, key)
        if entry is None:  # not scored yet (or scored by a run that crashed before journaling it)
            try:
                message, row = await self._score(picture, key)
            except _Rejected as error:
                await self._reject(picture, str(error))
                return
            if previous is not None:
                await previous.wait()
            try:
                entry = await asyncio.to_thread(self.journal.add, key, message, row)
            except OutboxFull:  # filled meanwhile: the picture is taken again once there is room
                self._give_back(picture)
                return
            except (sqlite3.Error, OSError) as error:  # a full disk: the picture waits in its folder, unscored
                self._deferred(picture, error)
                return
            self.outboxes.written()
            self.outboxes.wake()
            self.outboxes.show_depths()
            if not self.sinks:
                self._delivered_first(message, time.time())
        turn.set()
        self.last, self.last_picture = entry.message, picture.data
        if entry.row is not None and not entry.recorded and self.state.record is not None:
            if not await _recorded(self.state.record, entry.row, picture, self.config.name):
                self._give_back(picture)
                return
            try:
                await asyncio.to_thread(self.journal.recorded, key)
            except (sqlite3.Error, OSError) as error:  # recorded again next time: the record inserts a row once
                self._deferred(picture, error)
                return
        if isinstance(self.source, HotFolder):
            await asyncio.to_thread(self.source.finish, picture, bool(entry.message["is_anomaly"]))

    def _deferred(self, picture: Picture, error: Exception) -> None:
        """The journal could not take the picture's verdict: nothing of it is kept or sent, and the picture is taken
        again later (a hot folder's stays in its folder; a camera's frame cannot wait, and is counted)."""
        self.outboxes.cannot_write(error)
        self.count("deferred")
        self._give_back(picture)

    def _give_back(self, picture: Picture) -> None:
        if isinstance(self.source, HotFolder):
            self.source.release(picture)

    async def _reject(self, picture: Picture, reason: str) -> None:
        if isinstance(self.source, HotFolder) and self.source.retry(picture):
            return  # written in several goes, perhaps: taken again once its size settles
        self.count("rejected")
        log.warning(
            "picture rejected", extra={"line": self.config.name, "picture": picture.source_id, "reason": reason}
        )
        if isinstance(self.source, HotFolder):
            await asyncio.to_thread(self.source.reject, picture, reason)

    async def _score(self, picture: Picture, key: str) -> tuple[dict, dict | None]:
        """The picture's message (and record row), scored by the served model's batcher as ``POST /score`` is."""
        state = self.state
        served, scored, result, size = await self._scored(picture)
        now = time.time()
        self.count("scored")
        if result["is_anomaly"]:
            self.count("flagged")
        heatmap = result.pop("heatmap", None)
        heatmap_path = None
        if heatmap is not None:
            heatmap_path = self.heatmaps / f"{picture.sha256[:16]}.png"
            await asyncio.to_thread(heatmap_path.write_bytes, base64.b64decode(heatmap))
        config = self.config
        named = (("line", config.name), ("station", config.station), ("camera", config.camera), ("part", picture.part))
        fields = {k: v for k, v in named if v is not None}
        message = _message(key, fields, served, result, picture, heatmap_path, now)
        if state.record is None:
            return message, None
        row = _row(served, result, scored, size, picture, fields, state.settings.review_sample, key)
        return {**message, "record_id": row["id"]}, row

    async def _scored(self, picture: Picture) -> tuple[ServedModel, ScoredImage, dict, tuple[int, int]]:
        """The picture scored and answered; a busy or loading service is waited for (a line cannot drop a part)."""
        state = self.state
        threshold = self.config.threshold
        while True:
            model = state.model(self.config.model)  # 503 not_ready while models load: the loop waits below
            try:
                with state.using(model) as held:
                    served, (scored,), (result,), (size,) = await state.score_pictures(
                        held, [picture.data], threshold, self.config.heatmaps, False
                    )
                    break
            except ApiError as error:
                if error.status in (413, 415, 422):  # the picture, not the service
                    raise _Rejected(error.message) from None
                if error.code not in ("overloaded", "not_ready"):  # a full queue: wait, as a line cannot drop a part
                    raise
            await asyncio.sleep(BUSY_WAIT_S)
        state.observe(served, [result], own_threshold=threshold is not None)
        return served, scored, result, size

    # ------------------------------------------------------------------ verdicts out
    def _delivered_first(self, message: dict, now: float) -> None:
        if (now - message["seen"]) * 1000 > self.config.latency_budget_ms:
            self.count("late")

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self.metrics.line_pictures.labels(self.config.name, outcome).inc()

    async def _show(self) -> None:
        """The outboxes, and the source's state and queue, as metrics (every second)."""
        line = self.config.name
        while True:
            await self.outboxes.show()
            up = self.source.describe()["state"] in ("watching", "connected")
            self.metrics.line_source_up.labels(line).set(1.0 if up else 0.0)
            waiting = len(self._in_flight) + (self.source.waiting if isinstance(self.source, Camera) else 0)
            self.metrics.line_queue.labels(line).set(waiting)
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ what an operator sees
    def describe(self) -> dict:
        return {
            "name": self.config.name,
            "model": self.config.model or self.state.default_name,
            "station": self.config.station,
            "camera": self.config.camera,
            "source": self.source.describe(),
            "paused": self.outboxes.paused,
            "rate": _rate(self.seen_times),
            "in_flight": len(self._in_flight),
            "latency_budget_ms": self.config.latency_budget_ms,
            "counts": dict(self.counts),
            "last": self.last,
            "sinks": self.outboxes.describe(),
        }

    def trigger(self, part: str | None) -> int:
        if not isinstance(self.source, Camera) or self.source.config.mode != "trigger":
            raise ApiError("invalid_parameter", f"line {self.config.name!r} is not a camera in trigger mode")
        return self.source.trigger(part)


async def _recorded(record, row: dict, picture: Picture, line: str) -> bool:
    """Whether the record made a line picture's row durable (else the picture waits, and is tried again later)."""
    try:
        await asyncio.wait_for(asyncio.wrap_future(record.submit(row, picture.data)), RECORD_TIMEOUT_S)
    except Exception as error:  # the record's journal is full or its disk failed: the picture waits
        log.error("line picture not recorded; tried again later", extra={"line": line, "error": str(error)})
        return False
    return True


def _rate(seen_times) -> float:
    """Pictures a second over the last minute."""
    now = time.time()
    return round(len([t for t in seen_times if now - t <= 60]) / 60.0, 3)


def _row(served, result: dict, scored, size: tuple[int, int], picture, fields: dict, sample: float, key: str) -> dict:
    """The record's row of a line's picture, with the same id on every attempt (``key``): the record inserts it once."""
    return make_row(
        served.name,
        served.version,
        result,
        scored.input_distance,
        size,
        picture.sha256,
        len(picture.data),
        fields,
        sample,
        source="line",
        now=picture.seen,
        key=key,
    )


class _Rejected(Exception):
    """The picture cannot be scored (not an image, too large): it is rejected with this reason."""


class Lines:
    """Every line of a ``lines.yaml``, started once the models are loaded."""

    def __init__(self, state: ServiceState, path: Path):
        self.state, self.path = state, Path(path)
        self.file: LinesFile | None = None
        self.runners: dict[str, LineRunner] = {}
        self.error: str | None = None

    async def start(self) -> None:
        """Read and check the file against the served models, and start every line.

        Raises:
            LineConfigError: naming the line and the field.
        """
        lines, state_dir = await asyncio.to_thread(read_lines, self.path)
        await asyncio.to_thread(check_lines, lines, list(self.state.models), self.state.default_name, self.path)
        self.file = lines
        for config in lines.lines:
            runner = LineRunner(self.state, config, state_dir)
            self.runners[config.name] = runner
            await runner.start()

    async def stop(self) -> None:
        await asyncio.gather(*(runner.stop() for runner in self.runners.values()), return_exceptions=True)

    def describe(self) -> list[dict]:
        return [runner.describe() for runner in self.runners.values()]

    def runner(self, name: str) -> LineRunner:
        if name not in self.runners:
            raise ApiError("line_not_found", f"no line named {name!r}; lines: {', '.join(self.runners) or 'none'}")
        return self.runners[name]

    def health(self) -> dict:
        """Each line's source and sinks in a word or two: /health/ready's detail (it never makes it 503)."""
        detail = {}
        for name, runner in self.runners.items():
            depths = runner.journal.depths()
            detail[name] = {
                "source": runner.source.describe()["state"],
                "paused": runner.outboxes.paused is not None,
                "sinks": {
                    sink.name: {"connected": sink.connected, "outbox": depths[sink.name]} for sink in runner.sinks
                },
            }
        return detail


def check_file(path: Path, models: list[str], default: str | None) -> LinesFile:
    """``padim serve --check-lines``: the file read and checked as a start would, nothing started."""
    lines, _ = read_lines(path)
    check_lines(lines, models, default, path)
    return lines


async def run_lines(settings) -> int:
    """``padim watch``: the lines of ``settings.lines`` without HTTP, until SIGTERM or SIGINT (then drained as
    ``padim serve`` drains: no new picture, those being scored finished, the sinks given a last chance)."""
    state = ServiceState(settings)
    await asyncio.to_thread(state.open_record)
    lines = Lines(state, settings.lines)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await state.load()
        await lines.start()
        log.info("watching", extra={"lines": list(lines.runners)})
        await stop.wait()
    finally:
        state.draining = True
        await lines.stop()
        await state.close()
    return 0


def _message(
    key: str, fields: dict, served: ServedModel, result: dict, picture: Picture, heatmap: Path | None, now: float
) -> dict:
    """The verdict a line sends its sinks (the contract of docs/lines.md)."""
    return {
        "id": key,
        **fields,
        "model": served.name,
        "version": served.version,
        "score": result["score"],
        "raw_score": result["raw_score"],
        "is_anomaly": bool(result["is_anomaly"]),
        "verdict": "anomalous" if result["is_anomaly"] else "normal",
        "threshold": result["threshold"],
        "anomalous_area": result["anomalous_area"],
        "time": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "seen": picture.seen,
        "latency_ms": round((now - picture.seen) * 1000, 3),
        "source": picture.source_id,
        "sha256": picture.sha256,
        "heatmap": str(heatmap) if heatmap is not None else None,
    }
