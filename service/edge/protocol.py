"""Limits at the connection: what uvicorn's HTTP/1.1 protocol does not bound by itself.

uvicorn (httptools) reads request headers of any size and count, holds a connection that sends
nothing (its keep-alive timer starts only after a first response and stops at the first byte),
and answers every protocol error with a plain-text 400. :class:`GuardedProtocol` adds, per
connection, before any application code runs:

- a cap on the bytes of the request line and headers, and on their count: 431. Both are read off
  the raw bytes as they arrive, so a request that breaks both gets the code of the limit its byte
  stream crosses first, however the bytes are split into reads (header lines are counted by
  their line ends, not by the parser, which sees them a read later);
- a deadline for the request line and headers, from the connection's first byte or from the
  end of the previous response, never pushed back by trickled bytes: 408 (a connection that
  sent nothing is closed silently);
- a cap on open connections: 503 ``too_many_connections`` before anything is read;
- JSON errors like the application's (``{"error": {"code", "message"}}``).

A rejected client gets a *lingering close*: the response is written, the write side is shut
down, and whatever the client is still sending is read and thrown away (up to a bound, for a
few seconds) so it can read the answer instead of a "connection reset".
"""

from __future__ import annotations

import json
from asyncio import TimerHandle
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

#: Seconds a rejected connection is read from and discarded before it is closed.
LINGER_S = 2.0


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection limits (from :class:`~padim.service.settings.ServiceSettings`)."""

    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    max_connections: int
    max_discard_bytes: int


class _Rejected(Exception):
    """Raised from a parser callback to stop parsing; the reason is on the protocol."""


class HeaderScan:
    """The request line and headers read off the raw byte stream: their bytes and their line ends.

    Both limits are checked here, before the parser sees the bytes, so that a request breaking both
    gets the code of the limit its stream crosses first whatever the reads' sizes. Header ``k`` ends
    at line end ``k + 1`` (the request line ends at the first); the blank line that ends the headers
    counts as bytes but not as a header.
    """

    def __init__(self, max_bytes: int, max_headers: int):
        self.max_bytes, self.max_headers = max_bytes, max_headers
        self.bytes = 0  # of the request line and headers, seen so far
        self.lines = 0  # line ends among them
        self._tail = b""  # the last bytes seen, to find a header end split across reads

    def feed(self, data: bytes) -> str | None:
        """Counts the header part of ``data`` (all of it unless the blank line ending the headers is in it).

        Returns the limit the stream crosses first, ``"bytes"`` or ``"count"``, or None while within both.
        """
        window = self._tail + data
        end = window.find(b"\r\n\r\n")
        offset = len(self._tail)
        counted = len(data) if end < 0 else max(0, end + 4 - offset)
        lines_part = data if end < 0 else data[: max(0, end + 2 - offset)]
        self._tail = window[-3:]
        # the index in ``data`` of the byte that crosses each limit, where one does
        over_bytes = self.max_bytes - self.bytes if self.bytes + counted > self.max_bytes else None
        over_count = None
        ends = lines_part.count(b"\n")
        needed = self.max_headers + 2 - self.lines  # the line end that closes one header too many
        if needed <= ends:
            over_count = -1
            for _ in range(needed):
                over_count = lines_part.find(b"\n", over_count + 1)
        self.bytes += counted
        self.lines += ends
        if over_bytes is None and over_count is None:
            return None
        if over_count is None or (over_bytes is not None and over_bytes < over_count):
            return "bytes"
        return "count"


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header, timeout and connection limits.

    Use :func:`guarded_protocol` to bind the limits: uvicorn builds protocols from a class.
    """

    limits: ConnectionLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: TimerHandle | None = None
        self._awaiting_headers = True
        self._scan = HeaderScan(self.limits.max_header_bytes, self.limits.max_headers)
        self._header_count = 0
        self._rejection: tuple[int, str, str] | None = None
        self._lingering = False
        self._discarded = 0

    # ----------------------------------------------------------------- connection
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.logger.warning("connection refused: %d open (PADIM_MAX_CONNECTIONS)", len(self.connections) - 1)
            self._reject(
                503,
                "too_many_connections",
                f"the server has its limit of {self.limits.max_connections} connections open; retry shortly",
                retry_after=1,
            )
            return
        self._start_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._discarded += len(data)
            if self._discarded > self.limits.max_discard_bytes:
                self.transport.close()
            return
        if self._awaiting_headers:
            crossed = self._scan.feed(data)
            if crossed == "bytes":
                self._reject(
                    431,
                    "headers_too_large",
                    f"the request line and headers are over the limit of "
                    f"{self.limits.max_header_bytes} bytes (PADIM_MAX_HEADER_BYTES)",
                )
                return
            if crossed == "count":
                self._reject(
                    431,
                    "too_many_headers",
                    f"the request has more than {self.limits.max_headers} headers (PADIM_MAX_HEADERS)",
                )
                return
        super().data_received(data)

    # ----------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0
        if self._header_timer is None:  # a keep-alive connection's next request
            self._start_header_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._rejection = (
                431,
                "too_many_headers",
                f"the request has more than {self.limits.max_headers} headers (PADIM_MAX_HEADERS)",
            )
            raise _Rejected
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        self._awaiting_headers = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_headers = True
        self._scan = HeaderScan(self.limits.max_header_bytes, self.limits.max_headers)

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this on any parser error, including the ones raised above."""
        if self._rejection is not None:
            self._reject(*self._rejection)
        else:
            self._reject(400, "bad_request", "the request is not valid HTTP/1.1")

    # ----------------------------------------------------------------- timers and rejection
    def _start_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self._lingering:
            return
        if self._scan.bytes == 0:  # never said anything: an idle connection
            self.transport.close()
            return
        self._reject(
            408,
            "header_timeout",
            f"the request headers did not arrive within {self.limits.header_timeout_s:g} s (PADIM_HEADER_TIMEOUT_S)",
        )

    def _reject(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        """Answer ``status`` as JSON and close, lingering so the client can read the answer."""
        self._cancel_header_timer()
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: ",
            str(len(body)).encode(),
            b"\r\n",
            b"connection: close\r\n",
        ]
        if retry_after is not None:
            head += [b"retry-after: ", str(retry_after).encode(), b"\r\n"]
        self.transport.write(b"".join([*head, b"\r\n", body]))
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is still being written on this connection: no linger
            return
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """A :class:`GuardedProtocol` subclass bound to ``limits``, for ``uvicorn.Config(http=...)``."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits})
