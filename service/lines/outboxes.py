"""A line's verdicts out (:class:`Outboxes`): each sink's deliverer takes its outbox in the line's journal oldest
first, removes a message only once the sink confirmed it, and backs off while the sink is down; the outboxes'
depth, age and fullness as metrics and as the console shows them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable

from ..metrics import Metrics
from .journal import LineJournal
from .sinks import Sink, SinkDown

log = logging.getLogger("padim.lines")

#: Messages a deliverer sends in one go.
SEND_BATCH = 64
#: Back-off after a failed send: doubled each time up to MAX_BACKOFF_S.
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
#: An outbox that cannot be written (a full disk) is tried again at most this far apart: it is back soon after space.
UNWRITABLE_BACKOFF_S = 5.0
#: How long a full outbox (``when_full: block``) makes the line wait before it looks again.
FULL_WAIT_S = 0.5


class Outboxes:
    """The sinks of one line and their outboxes.

    Args:
        line: the line's name.
        journal: the line's journal, which holds every sink's outbox.
        sinks: where its verdicts go.
        metrics: where deliveries, latencies and the outboxes are shown.
        max_messages: an outbox's bound (``outbox.max_messages``).
        on_delivered: told of each message the first sink confirmed, and when (the line counts late verdicts).
    """

    def __init__(
        self,
        line: str,
        journal: LineJournal,
        sinks: list[Sink],
        metrics: Metrics,
        max_messages: int,
        on_delivered: Callable[[dict, float], None],
    ):
        self.line, self.journal, self.sinks, self.metrics = line, journal, sinks, metrics
        self.max_messages, self.on_delivered = max_messages, on_delivered
        self._wake = {sink.name: asyncio.Event() for sink in sinks}
        self._dropped_shown = {sink.name: 0 for sink in sinks}
        self.full: str | None = None  # why the line takes no picture now: an outbox is full
        self.unwritable: str | None = None  # or the journal took no verdict lately (its disk is full)
        for sink in sinks:
            metrics.line_delivered.labels(line, sink.name)

    def wake(self) -> None:
        """A message is in every outbox: each deliverer looks now."""
        for event in self._wake.values():
            event.set()

    async def room(self) -> None:
        """Return once every outbox has room for a verdict; meanwhile the line is paused, and says why."""
        if self.journal.room():
            return
        self.full = "an outbox is full (outbox.max_messages); the line takes no picture until it drains"
        log.error("line paused: outbox full", extra={"line": self.line})
        while not self.journal.room():
            await asyncio.sleep(FULL_WAIT_S)
        self.full = None
        log.warning("line resumed: outbox has room", extra={"line": self.line})

    @property
    def paused(self) -> str | None:
        """Why the line takes no picture now: an outbox is full, or the journal cannot be written."""
        return self.full or self.unwritable

    def cannot_write(self, error: Exception) -> None:
        """The journal could not take a verdict (its disk is full): the line says so until it takes one again."""
        if self.unwritable is None:
            log.error("line paused: its journal cannot be written", extra={"line": self.line, "error": str(error)})
        self.unwritable = f"the line's journal cannot be written ({error}); pictures wait, tried again every second"

    def written(self) -> None:
        if self.unwritable is not None:
            log.warning("line resumed: its journal takes verdicts again", extra={"line": self.line})
            self.unwritable = None

    async def deliver(self, sink: Sink) -> None:
        """``sink``'s deliverer, until cancelled."""
        line, streak = self.line, 0
        wake = self._wake[sink.name]
        while True:
            due = await asyncio.to_thread(self.journal.due, sink.name, SEND_BATCH)
            if not due:
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), 1.0)
                continue
            try:
                done = await sink.send([p.message for p in due])
                failure = None
            except SinkDown as error:
                done, failure = error.done, str(error)
            except Exception as error:  # a bug in a sink must not stop the line: the messages wait
                log.exception("sink failed", extra={"line": line, "sink": sink.name})
                done, failure = 0, f"{type(error).__name__}: {error}"
            now = time.time()
            await self._forget(sink, [p.id for p in due[:done]])
            self.show_depths()
            for pending in due[:done]:
                self.metrics.line_latency.labels(line, sink.name).observe(max(0.0, now - pending.message["seen"]))
                if sink is self.sinks[0]:
                    self.on_delivered(pending.message, now)
            self.metrics.line_delivered.labels(line, sink.name).inc(done)
            if failure is None:
                streak = 0
                continue
            self.metrics.line_delivery_failures.labels(line, sink.name).inc()
            delay = min(FIRST_BACKOFF_S * 2**streak, MAX_BACKOFF_S)
            streak += 1
            if streak == 1:
                log.warning(
                    "sink down; verdicts wait in its outbox", extra={"line": line, "sink": sink.name, "error": failure}
                )
            with contextlib.suppress(sqlite3.Error, OSError):  # not written (a full disk): the next try is sooner
                await asyncio.to_thread(self.journal.failed, [p.id for p in due[done:]], delay)
            await asyncio.sleep(delay)

    async def _forget(self, sink: Sink, ids: list[int]) -> None:
        """Take what ``sink`` confirmed out of its outbox. Until the journal can be written again (a full disk), this
        is tried again, and nothing is sent meanwhile: a message the sink has is never sent twice."""
        delay = FIRST_BACKOFF_S
        while True:
            try:
                await asyncio.to_thread(self.journal.delivered, sink.name, ids)
                return
            except (sqlite3.Error, OSError) as error:
                if delay == FIRST_BACKOFF_S:
                    log.error(
                        "outbox cannot be written; delivered verdicts are taken out once it can",
                        extra={"line": self.line, "sink": sink.name, "error": str(error)},
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, UNWRITABLE_BACKOFF_S)

    def show_depths(self) -> None:
        for name, depth in self.journal.depths().items():
            self.metrics.line_outbox_depth.labels(self.line, name).set(depth)

    async def show(self) -> None:
        """The outboxes' depth, age and fullness, each sink's connection, and verdicts dropped, as metrics."""
        line = self.line
        self.show_depths()
        depths = self.journal.depths()
        ages = await asyncio.to_thread(self.journal.oldest)
        for sink in self.sinks:
            depth = depths[sink.name]
            self.metrics.line_outbox_age.labels(line, sink.name).set(ages[sink.name] or 0.0)
            self.metrics.line_outbox_full.labels(line, sink.name).set(1.0 if depth >= self.max_messages else 0.0)
            self.metrics.line_sink_up.labels(line, sink.name).set(1.0 if sink.connected else 0.0)
            dropped = self.journal.dropped[sink.name] - self._dropped_shown[sink.name]
            if dropped:
                self.metrics.line_outbox_dropped.labels(line, sink.name).inc(dropped)
                self._dropped_shown[sink.name] += dropped
                log.error(
                    "outbox full: oldest verdicts dropped", extra={"line": line, "sink": sink.name, "dropped": dropped}
                )

    def describe(self) -> list[dict]:
        """Each sink as the console shows it: its connection, last error and outbox."""
        depths, ages = self.journal.depths(), self.journal.oldest()
        return [
            {
                "name": sink.name,
                **sink.describe(),
                "connected": sink.connected,
                "error": sink.last_error,
                "outbox": depths[sink.name],
                "oldest_s": _rounded(ages[sink.name]),
                "full": depths[sink.name] >= self.max_messages,
                "dropped": self.journal.dropped[sink.name],
            }
            for sink in self.sinks
        ]


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)
