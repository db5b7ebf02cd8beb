"""Pure ASGI middleware: upload limit (checked while streaming) and request context/logging."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from .errors import BodyTooLarge
from .metrics import Metrics

access_log = logging.getLogger("padim.access")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class BodySizeLimit:
    """413 for bodies over ``max_bytes``: at once from Content-Length, else while streaming.

    Counting happens in ``receive``, so an over-long chunked body is refused after
    ``max_bytes`` have arrived rather than after it has all been read.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_json(send, 413, "payload_too_large", f"the request body is over the limit of {self.max_bytes} bytes")
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        return await self.app(scope, limited_receive, send)


class RequestContext:
    """Request id (``X-Request-ID``), in-flight gauge, metrics by route and status, JSON access log."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

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
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.in_flight.dec()
            latency = time.perf_counter() - started
            route = _route_template(scope)
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(latency)
            access_log.info("request", extra={
                "request_id": request_id, "method": scope["method"], "route": route, "path": scope["path"],
                "status": status, "model": scope["state"].get("model"), "latency_ms": round(latency * 1000, 2),
            })


def _route_template(scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"


async def _send_json(send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
