"""Pictures to score, from API processes to the scoring process, and their scores back.

One Unix socket connection per API process (``score.sock`` of the run folder), carrying small tuples: which slots
hold the pictures, which version scores them, and back their numbers. The pictures and maps stay in the slots
(:class:`~.shared.Slot`); nothing a picture holds is ever in a message.

- ``HELLO`` (API): row, pid;
- ``SCORE`` (API): request id, serial, (height, width), raw threshold, keep maps, monitor, own threshold, and per
  picture its slot (number, bytes, and the length of a JPEG the scoring device decodes: 0 for a model input);
- ``CANCEL`` (API): request id (its client left: images still queued are skipped);
- ``SCORED`` (scoring): request id, per picture (raw score, input distance, pixels over, pixels, finite);
- ``FAILED`` (scoring): request id, code, message, headers;
- ``STALE`` (scoring): request id (the version was let go: the API process asks the table again).

Every ``SCORE`` gets exactly one of the last three, after which its slots are the API process's again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener

from ..device.batching import Item, ScoredImage
from ..edge.errors import ApiError
from .shared import PIXELS, RunFolder, Slot, SlotMaps

log = logging.getLogger("padim.service")

HELLO, SCORE, CANCEL, SCORED, FAILED, STALE = range(6)

#: A scored picture's numbers as they cross: a :class:`ScoredImage` but its map (which stays in its slot).
Numbers = tuple[float, float | None, int, int, bool]
#: Seconds between attempts to reach a scoring process that is not (yet) there.
RECONNECT_S = 0.1


def send(connection: Connection, lock: threading.Lock, message: tuple) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        connection.send_bytes(data)


class Stale(Exception):
    """The version a request named is no longer loaded in the scoring process."""


# --------------------------------------------------------------------------- the API process's end
class Link:
    """An API process's connection to the scoring process: requests out, answers resolved on the event loop.

    A thread connects (again, whenever the scoring process is replaced); the event loop reads the answers. Losing the
    scoring process fails every waiting request at once with 503 ``not_ready``.
    """

    def __init__(self, run: RunFolder, row: int):
        self.run, self.row = run, row
        self.up = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._connection: Connection | None = None
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[asyncio.Future, Callable[[], None]]] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scoring-link", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    def stop(self) -> None:
        """On the event loop: stop reading and connecting."""
        self._stop.set()
        connection = self._connection
        if connection is not None:
            with contextlib.suppress(OSError, ValueError):
                assert self.loop is not None
                self.loop.remove_reader(connection.fileno())
                connection.close()

    async def score(
        self,
        serial: int,
        shape: tuple[int, int],
        slots: list[tuple[Slot, int]],
        raw_threshold: float,
        keep_map: bool,
        monitor: bool,
        own_threshold: bool,
        done: Callable[[], None],
    ) -> list[Numbers]:
        """The numbers of the pictures in ``slots``, scored by version ``serial``. Returned, the slots hold the maps
        and are the caller's to give back; otherwise ``done`` is called once the scoring process is finished with
        them (its answer came, or it is gone), even if this is cancelled.
        Each slot comes with the length of the JPEG it holds for the scoring device to decode (0: a model input).

        Raises:
            Stale: the version was let go meanwhile.
            ApiError: the scoring process's answer (503 out of GPU memory, 500), or 503 ``not_ready`` without it.
        """
        connection = self._connection
        if connection is None or not self.up.is_set():
            done()
            raise _gone()
        assert self.loop is not None
        request = next(self._ids)
        future = self.loop.create_future()
        self._pending[request] = (future, done)
        message = (
            SCORE,
            request,
            serial,
            shape,
            raw_threshold,
            keep_map,
            monitor,
            own_threshold,
            tuple((slot.number, slot.nbytes, jpeg) for slot, jpeg in slots),
        )
        try:
            send(connection, self._send_lock, message)
        except OSError:
            self._finish(request, (FAILED, request, "not_ready", "", None))
        try:
            return await future
        except asyncio.CancelledError:
            if request in self._pending:  # the scoring process skips what it has not begun
                with contextlib.suppress(OSError):
                    send(connection, self._send_lock, (CANCEL, request))
            elif future.done() and not future.cancelled():  # answered, but its caller is gone before reading it
                done()
            raise

    def _finish(self, request: int, message: tuple) -> None:
        """On the event loop: resolve a request with its answer. Its slots are given back here unless its caller is
        to read them (scored: the caller gives them back once it has read the maps)."""
        entry = self._pending.pop(request, None)
        if entry is None:
            return
        future, done = entry
        if future.done() or message[0] != SCORED:
            done()
        if future.done():
            return
        kind = message[0]
        if kind == SCORED:
            future.set_result(message[2])
        elif kind == STALE:
            future.set_exception(Stale())
        elif message[2] == "not_ready":
            future.set_exception(_gone())
        else:
            future.set_exception(ApiError(message[2], message[3], headers=message[4]))

    def _fail_all(self) -> None:
        for request in list(self._pending):
            self._finish(request, (FAILED, request, "not_ready", "", None))

    def _run(self) -> None:
        """Connects (again, once the connection is lost); the event loop reads the answers (no thread in between)."""
        while not self._stop.is_set():
            try:
                connection = Client(str(self.run.score_socket), family="AF_UNIX")
            except OSError:
                time.sleep(RECONNECT_S)
                continue
            try:
                send(connection, self._send_lock, (HELLO, self.row, os.getpid()))
            except OSError:
                connection.close()
                continue
            lost = threading.Event()
            self._call(self._attach, connection, lost)
            lost.wait()
            if not self._stop.is_set():
                log.warning("the scoring process is gone; waiting for it", extra={"row": self.row})

    def _attach(self, connection: Connection, lost: threading.Event) -> None:
        """On the event loop: answers are read as they arrive (the loop watches the connection)."""
        loop = self.loop
        assert loop is not None

        def readable() -> None:
            try:
                while connection.poll():
                    message = pickle.loads(connection.recv_bytes())
                    self._finish(message[1], message)
            except (EOFError, OSError):
                loop.remove_reader(connection.fileno())
                self.up.clear()
                self._connection = None
                with contextlib.suppress(OSError):
                    connection.close()
                self._fail_all()
                lost.set()

        self._connection = connection
        loop.add_reader(connection.fileno(), readable)
        self.up.set()
        log.info("connected to the scoring process", extra={"row": self.row})

    def _call(self, function, *args) -> None:
        assert self.loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is stopping
            self.loop.call_soon_threadsafe(function, *args)


def _gone() -> ApiError:
    return ApiError(
        "not_ready",
        "the scoring process is not running; it is being restarted, retry shortly",
        headers={"Retry-After": "2"},
    )


# --------------------------------------------------------------------------- the scoring process's end
class Request:
    """One ``SCORE`` in the scoring process: its pictures' items, answered once every one is scored."""

    def __init__(self, peer: Peer, request: int, served, slots: list[Slot], keep_map: bool, monitor: bool, own: bool):
        self.peer, self.id, self.served, self.slots = peer, request, served, slots
        self.keep_map, self.monitor, self.own = keep_map, monitor, own
        self.results: list[ScoredImage | BaseException | None] = [None] * len(slots)
        self.left = len(slots)
        self.items: list[Item] = []
        self._lock = threading.Lock()

    def delivery(self, index: int):
        def deliver(result: ScoredImage | BaseException) -> None:
            with self._lock:
                self.results[index] = result
                self.left -= 1
                complete = self.left == 0
            if complete:
                self.peer.outbox.put(self)

        return deliver


class Peer:
    """One API process's connection: a thread reads its requests, another sends their answers (so that a slow API
    process never holds the device's thread)."""

    def __init__(self, intake: Intake, connection: Connection, row: int):
        self.intake, self.connection, self.row = intake, connection, row
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[int, Request] = {}
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._send_loop, name=f"answers-{row}", daemon=True).start()

    def answer(self, message: tuple) -> None:
        if not self.closed:
            with contextlib.suppress(OSError):
                send(self.connection, self.lock, message)

    def _send_loop(self) -> None:
        """Answers requests as they complete; ends once the peer is gone and its last request is answered."""
        while True:
            request = self.outbox.get()
            if request is not None:
                self.requests.pop(request.id, None)
                self.intake.answered(request)
            if self.closed and not self.requests:
                return


class Intake:
    """The scoring process's end: takes API processes' connections, queues their pictures on the versions they
    name, and answers them.

    Args:
        run: the run folder.
        state: the scoring process's :class:`~padim.service.state.ServiceState`.
    """

    def __init__(self, run: RunFolder, state):
        self.run, self.state = run, state
        self.maps = SlotMaps(run)
        self.peers: dict[int, Peer] = {}
        self._lock = threading.Lock()
        self.run.score_socket.unlink(missing_ok=True)
        self._listener = Listener(str(run.score_socket), family="AF_UNIX")
        threading.Thread(target=self._accept_loop, name="intake", daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        for peer in list(self.peers.values()):
            with contextlib.suppress(OSError):
                peer.connection.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                connection = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._read_loop, args=(connection,), name="intake-peer", daemon=True).start()

    def _read_loop(self, connection: Connection) -> None:
        peer: Peer | None = None
        try:
            while True:
                message = pickle.loads(connection.recv_bytes())
                kind = message[0]
                if kind == SCORE and peer is not None:
                    self._score(peer, message)
                elif kind == CANCEL and peer is not None:
                    request = peer.requests.get(message[1])
                    if request is not None:
                        for item in request.items:
                            item.cancelled = True
                elif kind == HELLO:
                    peer = self._hello(connection, message[1], message[2])
        except (EOFError, OSError):
            pass
        finally:
            with contextlib.suppress(OSError):
                connection.close()
            if peer is not None:
                self._gone(peer)

    def _hello(self, connection: Connection, row: int, pid: int) -> Peer:
        peer = Peer(self, connection, row)
        with self._lock:
            old = self.peers.get(row)
            self.peers[row] = peer
        if old is not None:
            self._abandon(old)
        self.maps.drop(row)  # a new process of this row makes its slots anew
        log.info("API process connected", extra={"row": row, "pid": pid})
        return peer

    def _gone(self, peer: Peer) -> None:
        with self._lock:
            if self.peers.get(peer.row) is peer:
                del self.peers[peer.row]
        self._abandon(peer)

    def _abandon(self, peer: Peer) -> None:
        """A peer that is gone: what it still has queued is skipped (and told so, which lets its version go), and its
        answers go nowhere."""
        peer.closed = True
        for request in list(peer.requests.values()):
            for item in request.items:
                item.cancelled = True
        peer.outbox.put(None)  # its sending thread ends once the last of them is answered

    def _score(self, peer: Peer, message: tuple) -> None:
        _, request_id, serial, shape, raw_threshold, keep_map, monitor, own, slots = message
        state = self.state
        served = state.versions.by_serial.get(serial)
        if served is None or not state.versions.hold(served):
            peer.answer((STALE, request_id))
            return
        try:
            mapped = [self.maps.get(peer.row, number, nbytes) for number, nbytes, _ in slots]
        except OSError as error:
            state.versions.let_go(served)
            peer.answer((FAILED, request_id, "scoring_failed", f"the picture's slot cannot be read: {error}", None))
            return
        request = Request(peer, request_id, served, mapped, keep_map, monitor, own)
        height, width = shape
        request.items = [
            Item(slot.tensor(3, height, width, dtype=PIXELS), raw_threshold, keep_map, request.delivery(i))
            if not jpeg
            else Item(None, raw_threshold, keep_map, request.delivery(i), jpeg=slot.bytes(jpeg))
            for i, (slot, (_, _, jpeg)) in enumerate(zip(mapped, slots, strict=True))
        ]
        peer.requests[request_id] = request
        served.batcher.put(request.items)

    def answered(self, request: Request) -> None:
        """On the peer's sending thread: maps into the slots, scores into the monitor, the answer out."""
        served, results = request.served, request.results
        try:
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None:
                error = failure if isinstance(failure, ApiError) else ApiError("scoring_failed", str(failure))
                request.peer.answer((FAILED, request.id, error.code, error.message, error.headers))
                return
            numbers: list[Numbers] = []
            for slot, scored in zip(request.slots, results, strict=True):
                assert isinstance(scored, ScoredImage)
                if scored.map is not None:
                    slot.tensor(*scored.map.shape).copy_(scored.map)
                numbers.append((scored.raw_score, scored.input_distance, scored.over, scored.pixels, scored.finite))
            if request.monitor and all(n[4] for n in numbers):
                served.monitor.record([n[0] for n in numbers], [n[1] for n in numbers], request.own)
            request.peer.answer((SCORED, request.id, numbers))
        finally:
            self.state.versions.let_go(served)
