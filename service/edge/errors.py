"""One JSON shape for every error: ``{"error": {"code": ..., "message": ...}}``."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from padim.core.errors import PadimError
from padim.models.errors import OUTCOMES, DiskFull, disk_full, outcome

#: Status recorded (metrics, access log) for a request whose client went away before the answer.
CLIENT_CLOSED = 499
#: The service's own answers (a request's shape, keys, admission, scoring), by code: their HTTP status.
SERVICE_CODES = {
    "invalid_parameter": 422,
    "invalid_fields": 422,
    "invalid_multipart": 422,
    "missing_file": 422,
    "empty_body": 422,
    "too_many_files": 422,
    "batch_too_large": 422,
    "unauthorized": 401,
    "forbidden": 403,
    "model_not_found": 404,
    "line_not_found": 404,
    "body_timeout": 408,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "client_disconnected": CLIENT_CLOSED,
    "scoring_failed": 500,
    "not_ready": 503,
    "overloaded": 503,
    "shutting_down": 503,
    "device_out_of_memory": 503,
    "timeout": 504,
}
#: Every error code the service answers with its HTTP status, each once: the library's errors from
#: :data:`padim.models.errors.OUTCOMES`, and the service's own.
STATUS: dict[str, int] = {row.code: row.http_status for row in OUTCOMES.values()} | SERVICE_CODES


class ApiError(Exception):
    """An error answered to the client as is; its status is the code's (:data:`STATUS`) unless ``status`` says
    otherwise (a malformed header: 400)."""

    def __init__(self, code: str, message: str, headers: dict[str, str] | None = None, status: int | None = None):
        super().__init__(message)
        self.status = STATUS[code] if status is None else status
        self.code, self.message, self.headers = code, message, headers


def api_error(error: PadimError, message: str | None = None) -> ApiError:
    """The answer to ``error``: its HTTP status and code from :data:`padim.models.errors.OUTCOMES`."""
    row = outcome(error)
    return ApiError(row.code, message or str(error))


class BodyTooLarge(ApiError):
    def __init__(self, limit: int, setting: str = "PADIM_MAX_UPLOAD_BYTES"):
        super().__init__(
            "payload_too_large",
            f"the request body is over the limit of {setting} = {limit} bytes",
            headers={"Connection": "close"},
        )


class BodyTimeout(ApiError):
    def __init__(self, seconds: float, setting: str = "PADIM_BODY_TIMEOUT_S"):
        super().__init__(
            "body_timeout",
            f"the request body did not arrive within {seconds:g} s ({setting})",
            headers={"Connection": "close"},
        )


def error_response(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


_HTTP_CODES = {
    400: "invalid_body",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    503: "unavailable",
}


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route of this path answers (one route per method: GET and POST of one path are two)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE and getattr(route, "methods", None):
            methods |= set(route.methods)
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def answer_api_error(request: Request, error: ApiError) -> Response:
        return answer_for(error)

    @app.exception_handler(PadimError)
    async def padim_error(request: Request, error: PadimError) -> Response:
        return answer_for(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = error.headers
        if error.status_code == 405:  # Starlette names the methods of the first route of the path only
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return error_response(
            error.status_code, _HTTP_CODES.get(error.status_code, "error"), str(error.detail), headers
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return error_response(422, "invalid_parameter", f"{where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(ClientDisconnect)
    async def client_disconnect(request: Request, error: ClientDisconnect) -> Response:
        return answer_for(error)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> Response:
        return answer_for(error)


def answer_for(error: Exception) -> Response:
    """The answer to an error a route raised (the handlers above, and the score routes' fast path)."""
    if isinstance(error, ApiError):
        return error_response(error.status, error.code, error.message, error.headers)
    if isinstance(error, OSError) and not isinstance(error, PadimError) and disk_full(error):
        # a full disk is not a bug: answered from the table, and logged without a traceback
        error = DiskFull.of(error, "what served before still serves; free space and send it again")
        logging.getLogger("padim.service").error("%s", error)
        return answer_for(error)
    if isinstance(error, PadimError):
        if outcome(error).http_status >= 500 and not isinstance(error, DiskFull):
            logging.getLogger("padim.service").exception("request failed")
        answer = api_error(error)
        return error_response(answer.status, answer.code, answer.message)
    if isinstance(error, ClientDisconnect):
        logging.getLogger("padim.service").info("client disconnected before sending the whole request")
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; metrics and the access log do
    logging.getLogger("padim.service").exception("unhandled error")
    return error_response(500, "internal_error", "internal error; see the server log (request id in X-Request-ID)")
