"""Pure ASGI middleware: the request body's limits, and request context/logging/draining."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from ..metrics import Metrics
from .errors import BodyTimeout, BodyTooLarge

access_log = logging.getLogger("padim.access")
log = logging.getLogger("padim.service")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class BodyGuard:
    """The request body: at most ``max_bytes`` (413) and all of it within ``timeout_s`` (408).

    An over-limit body is read and thrown away (up to ``max_discard_bytes``, within the same
    deadline) before the 413 is sent: a client still writing its upload when the server closes
    the connection gets a "connection reset" instead of the answer. The 413 comes at once from
    ``Content-Length``, or from counting while a chunked body streams in.
    """

    def __init__(
        self,
        app,
        max_bytes: int,
        timeout_s: float,
        max_discard_bytes: int,
        model_uploads: tuple[re.Pattern, int, float] | None = None,
    ):
        self.app, self.max_bytes, self.timeout_s, self.max_discard_bytes = app, max_bytes, timeout_s, max_discard_bytes
        self.model_uploads = model_uploads  # (path pattern, max bytes, timeout): model files, far larger than pictures

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes, timeout_s = self.max_bytes, self.timeout_s
        names = ("PADIM_MAX_UPLOAD_BYTES", "PADIM_BODY_TIMEOUT_S")
        if self.model_uploads is not None and scope["method"] == "POST" and self.model_uploads[0].match(scope["path"]):
            max_bytes, timeout_s = self.model_uploads[1:]
            names = ("PADIM_MAX_MODEL_UPLOAD_BYTES", "PADIM_MODEL_UPLOAD_TIMEOUT_S")
        until = time.monotonic() + timeout_s
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._discard(receive, until)
            error = BodyTooLarge(max_bytes, names[0])
            return await _send_json(send, error.status, error.code, error.message)
        seen = 0
        done = False

        async def guarded_receive():
            nonlocal seen, done
            if done:  # the body is in: what follows is a disconnect, however late
                return await receive()
            message = await self._receive_by(receive, until, timeout_s, names[1])
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                done = not message.get("more_body", False)
                if seen > max_bytes:
                    if not done:
                        await self._discard(receive, until)
                    raise BodyTooLarge(max_bytes, names[0])
            return message

        return await self.app(scope, guarded_receive, send)

    async def _receive_by(self, receive, until: float, timeout_s: float, setting: str) -> dict:
        try:
            async with asyncio.timeout(max(0.0, until - time.monotonic())):
                return await receive()
        except TimeoutError:
            raise BodyTimeout(timeout_s, setting) from None

    async def _discard(self, receive, until: float) -> None:
        """Read the rest of the body and throw it away, up to the bounds."""
        discarded = 0
        while discarded <= self.max_discard_bytes:
            try:
                async with asyncio.timeout(max(0.0, until - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                return
            if message["type"] != "http.request":
                return
            discarded += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


class RequestContext:
    """Request id (``X-Request-ID``), in-flight gauge, metrics by route and status, JSON access log.

    When the drain timeout runs out, uvicorn cancels the requests still running; they are
    answered 503 ``shutting_down`` here (not uvicorn's bare 500) and logged.

    In the scoring process of a service in several processes (``counted=False``), the API process that passed the
    request on counts and logs it; the answer tells it the route and model (``X-Padim-Route``, ``X-Padim-Model``).
    """

    def __init__(self, app, metrics: Metrics, draining: Callable[[], bool] = lambda: False, counted: bool = True):
        self.app, self.metrics, self.draining, self.counted = app, metrics, draining, counted

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500
        started = time.perf_counter()

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
                if not self.counted:
                    model = scope["state"].get("model")
                    message["headers"] += [(b"x-padim-route", _route_template(scope).encode())] + (
                        [(b"x-padim-model", model.encode())] if model else []
                    )
            await send(message)

        if not self.counted:
            return await self._passed_on(scope, receive, send_with_id, request_id)
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            if not self.draining():
                raise
            log.warning("request cancelled: the drain timeout ran out", extra={"request_id": request_id})
            if status == 500:  # nothing sent yet
                await _send_json(
                    send_with_id,
                    503,
                    "shutting_down",
                    "the server is shutting down and could not finish this request; retry",
                )
        finally:
            self.metrics.in_flight.dec()
            latency = time.perf_counter() - started
            route = _route_template(scope)
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(latency)
            access_log.info(
                "request",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "route": route,
                    "path": scope["path"],
                    "status": status,
                    "model": scope["state"].get("model"),
                    "latency_ms": round(latency * 1000, 2),
                },
            )

    async def _passed_on(self, scope, receive, send, request_id: str) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not self.draining():
                raise
            log.warning("request cancelled: the drain timeout ran out", extra={"request_id": request_id})
            await _send_json(
                send, 503, "shutting_down", "the server is shutting down and could not finish this request"
            )


def _route_template(scope) -> str:
    """The route's template (``/models/{name}/score``); a request passed on to the scoring process is labelled with
    the template that process matched (its ``X-Padim-Route``)."""
    passed = scope.get("state", {}).get("route")
    if passed is not None:
        return passed
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


async def _send_json(send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
