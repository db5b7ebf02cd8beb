"""``POST /score``, ``POST /models/{name}/score`` and ``POST /score/batch``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Coroutine
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Query, Request
from pydantic import TypeAdapter, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from padim.models.errors import RecordUnavailable

from ..edge.errors import ApiError, answer_for
from ..edge.openapi import error_responses
from ..edge.schemas import BatchResponse, ScoreResponse
from ..record.rows import InvalidFields, parse_fields
from ..state.surface import ScoreSurface
from .deps import ApiKey, ScoreDep, require_api_key

router = APIRouter(tags=["score"], dependencies=[ApiKey])

#: Multipart parts (files or fields) read from one body before it is refused as malformed.
MAX_PARTS = 1000


def _image_body(many: bool) -> dict:
    file_schema = {"type": "string", "format": "binary"}
    properties = {
        # maxItems: the batch limit, a setting; filled in by service.openapi
        "file": {"type": "array", "items": file_schema, "minItems": 1} if many else file_schema,
        "heatmap": {"type": "boolean"},
        "mask": {"type": "boolean"},
        "threshold": {"type": "number", "minimum": 0, "maximum": 1},
        "fields": {"type": "string", "description": FIELDS_HELP},
    }
    content: dict[str, dict] = {
        "multipart/form-data": {"schema": {"type": "object", "properties": properties, "required": ["file"]}}
    }
    if not many:  # the raw image as the body; its format is read from its bytes, not the content type
        content["image/*"] = {"schema": file_schema}
        content["application/octet-stream"] = {"schema": file_schema}
    return {"requestBody": {"required": True, "content": content}}


FIELDS_HELP = (
    "the client's own fields, kept in the inspection record with the verdict: a JSON object of up to 16 "
    'names (lower-case letters, digits, _) to strings, e.g. {"part": "A-1234", "line": "3", "station": "2", '
    '"camera": "top"}; for /score/batch an object for every file or a list of one per file, in order. Also '
    "as the X-Padim-Fields header (for a raw image body)"
)

ERRORS = error_responses(404, 408, 413, 415, 422, 500, 503, 504)


HeatmapQ = Annotated[bool, Query(description="return the heat map (PNG, base64)")]
MaskQ = Annotated[bool, Query(description="return the binary mask at the threshold (PNG, base64)")]
MonitorQ = Annotated[
    bool,
    Query(
        description="count the image in the model's monitor and verdict metrics; false for "
        "a second look at an image already scored (the console's re-scores)"
    ),
]
ThresholdQ = Annotated[
    float | None, Query(ge=0, le=1, description="override the threshold (0..1 score scale) for this request")
]


@router.post(
    "/score",
    response_model=ScoreResponse,
    response_model_exclude_unset=True,
    openapi_extra=_image_body(False),
    responses=ERRORS,
    summary="score one image with the default model",
)
async def score(
    request: Request,
    state: ScoreDep,
    heatmap: HeatmapQ = False,
    mask: MaskQ = False,
    threshold: ThresholdQ = None,
    monitor: MonitorQ = True,
):
    return await _score(request, state, None, heatmap, mask, threshold, many=False, monitor=monitor)


@router.post(
    "/models/{name}/score",
    response_model=ScoreResponse,
    response_model_exclude_unset=True,
    openapi_extra=_image_body(False),
    responses=ERRORS,
    summary="score one image with the named model",
)
async def score_with(
    name: str,
    request: Request,
    state: ScoreDep,
    heatmap: HeatmapQ = False,
    mask: MaskQ = False,
    threshold: ThresholdQ = None,
    monitor: MonitorQ = True,
):
    return await _score(request, state, name, heatmap, mask, threshold, many=False, monitor=monitor)


@router.post(
    "/score/batch",
    response_model=BatchResponse,
    response_model_exclude_unset=True,
    openapi_extra=_image_body(True),
    responses=ERRORS,
    summary="score several images (multipart 'file' parts), one result each, in order",
)
async def score_batch(
    request: Request,
    state: ScoreDep,
    heatmap: HeatmapQ = False,
    mask: MaskQ = False,
    threshold: ThresholdQ = None,
    model: Annotated[str | None, Query(description="model name")] = None,
    monitor: MonitorQ = True,
):
    return await _score(request, state, model, heatmap, mask, threshold, many=True, monitor=monitor)


async def _score(
    request: Request,
    state: ScoreSurface[Any],
    name: str | None,
    heatmap: bool,
    mask: bool,
    threshold: float | None,
    many: bool,
    monitor: bool = True,
) -> dict:
    started = time.perf_counter()
    # The version that admits the request scores and judges it, whatever is activated meanwhile (in an API process,
    # the one that serves when that version was let go before the scoring process took the pictures: it names it).
    with state.using(state.model(name)) as admitted:
        served = admitted
        request.state.model = served.name
        datas, form_options = await _read_images(request, many, state.settings.batch_limit())
        heatmap = form_options.get("heatmap", heatmap)
        mask = form_options.get("mask", mask)
        threshold = form_options.get("threshold", threshold)
        recording = state.record is not None and monitor
        if recording:
            try:
                fields = parse_fields(
                    form_options.get("fields", request.headers.get("x-padim-fields")), len(datas) if many else None
                )
            except InvalidFields as error:
                raise ApiError("invalid_fields", str(error)) from None
            loop = asyncio.get_running_loop()
            digests = await asyncio.gather(*[loop.run_in_executor(state.decode, _sha256, d) for d in datas])
        served, scored, results, pictures = await _answered(
            request,
            state.settings.request_timeout_s,
            state.score_pictures(served, datas, threshold, heatmap, mask, monitor),
        )
        if monitor:
            state.observe(served, results, own_threshold=threshold is not None)
        if recording:
            futures = state.keep(
                served, datas, digests, fields if isinstance(fields, list) else [fields], scored, results, pictures
            )
            if state.settings.record_required:
                await _durable(futures, state.settings.record_timeout_s)
    latency_ms = round((time.perf_counter() - started) * 1000, 3)
    if many:
        return {"results": results, "model": served.identity(), "latency_ms": latency_ms}
    return {**results[0], "model": served.identity(), "latency_ms": latency_ms}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _durable(futures, timeout_s: float) -> None:
    """Wait until every row is durable (PADIM_RECORD_REQUIRED); 503 record_unavailable when one cannot be."""
    try:
        await asyncio.wait_for(asyncio.gather(*[asyncio.wrap_future(f) for f in futures]), timeout_s)
    except TimeoutError:
        raise RecordUnavailable(
            f"the record did not make this picture's row durable within {timeout_s:g} s "
            "(PADIM_RECORD_TIMEOUT_S); PADIM_RECORD_REQUIRED withholds the verdict"
        ) from None
    except Exception as error:  # the journal is full, or its disk failed
        raise RecordUnavailable(
            f"the inspection record cannot keep this picture's row ({error}); "
            "PADIM_RECORD_REQUIRED withholds the verdict until it can"
        ) from None


async def _answered(request: Request, timeout_s: float, scoring: Coroutine) -> tuple:
    """What ``scoring`` returns, unless the client leaves first (499, logged) or it takes over ``timeout_s`` (504).

    A request given up takes its images out of the queue (they cost no batch) and gives its places back (``scoring``
    is cancelled, its ``finally`` blocks run); a request cancelled by the drain's end does the same before the
    cancellation goes on.
    """
    current = asyncio.current_task()
    assert current is not None
    gone = asyncio.ensure_future(_disconnected(request))
    left = False

    def leave(_) -> None:
        nonlocal left
        if not gone.cancelled():
            left = True
            current.cancel()

    gone.add_done_callback(leave)
    try:
        async with asyncio.timeout(timeout_s):
            return await scoring
    except TimeoutError:
        raise ApiError("timeout", f"not scored within {timeout_s:g} s; the server is overloaded") from None
    except asyncio.CancelledError:
        if not left:
            raise
        current.uncancel()  # answered here: a later cancellation is not taken for this one
        raise ApiError(
            "client_disconnected", "the client closed the connection before its images were scored"
        ) from None
    finally:
        gone.remove_done_callback(leave)
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body is read by now: nothing else can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _read_images(request: Request, many: bool, batch_limit: int) -> tuple[list[bytes], dict]:
    """The image bytes (one, or several for /score/batch) and options given as form fields.

    The body is at most ``PADIM_MAX_UPLOAD_BYTES``, so reading every part before counting them
    is bounded; a batch over ``batch_limit`` images is then refused (422, as the schema's ``maxItems``
    says) before decoding.
    """
    content_type = request.headers.get("content-type", "")
    options: dict = {}
    if content_type.startswith("multipart/form-data"):
        try:
            form = await request.form(max_files=MAX_PARTS, max_fields=MAX_PARTS)
        except HTTPException as error:
            raise ApiError("invalid_multipart", f"the multipart body could not be read: {error.detail}") from None
        entries = form.getlist("file")
        if not entries:
            raise ApiError("missing_file", "the multipart body has no 'file' field")
        parts = [p for p in entries if isinstance(p, UploadFile)]
        if len(parts) < len(entries):
            raise ApiError("missing_file", "'file' must be a file part, not a text field")
        if not many and len(parts) > 1:
            raise ApiError(
                "too_many_files",
                f"{len(parts)} 'file' parts: /score takes one image (use /score/batch for several)",
            )
        if len(parts) > batch_limit:
            raise ApiError(
                "batch_too_large",
                f"{len(parts)} images in one request; at most {batch_limit} "
                "(the smaller of PADIM_MAX_BATCH_SIZE and PADIM_MAX_QUEUE): split the batch",
            )
        datas = [await p.read() for p in parts]
        await form.close()
        options = _form_options(form)
    elif content_type.startswith(("image/", "application/octet-stream")):
        if many:
            raise ApiError("unsupported_media_type", "/score/batch takes multipart/form-data with several 'file' parts")
        datas = [await request.body()]
    else:
        raise ApiError(
            "unsupported_media_type",
            f"content type {content_type or 'none'!r}: send the image as multipart field 'file' "
            "or as the raw body with an image/* (or application/octet-stream) content type",
        )
    for i, data in enumerate(datas):
        if not data:
            raise ApiError("empty_body", "the image is empty" + (f" (file part {i})" if many else ""))
    return datas, options


def _form_options(form) -> dict:
    options: dict[str, bool | str | float] = {}
    for key in ("heatmap", "mask"):
        value = form.get(key)
        if isinstance(value, str):
            if value not in ("true", "false"):  # the JSON spellings, as the schema says
                raise ApiError("invalid_parameter", f"{key}: expected true or false, got {value!r}")
            options[key] = value == "true"
    value = form.get("fields")
    if isinstance(value, str):
        options["fields"] = value
    value = form.get("threshold")
    if isinstance(value, str):
        try:
            threshold = float(value)
        except ValueError:
            threshold = float("nan")
        if not 0.0 <= threshold <= 1.0:
            raise ApiError("invalid_parameter", f"threshold: expected a number in [0, 1], got {value!r}")
        options["threshold"] = threshold
    return options


# --------------------------------------------------------------------------- the fast path
_BOOL = TypeAdapter(bool)
_FLOAT = TypeAdapter(float)


def _plain_query(query_string: bytes, many: bool) -> dict | None:
    """The score routes' query parameters read as FastAPI reads them, or ``None`` where one is not plainly valid
    (FastAPI then answers with its own message)."""
    values = dict(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))  # the last of a name wins
    options: dict = {"heatmap": False, "mask": False, "threshold": None, "monitor": True, "model": None}
    try:
        for key in ("heatmap", "mask", "monitor"):
            if key in values:
                options[key] = _BOOL.validate_python(values[key])
        if "threshold" in values:
            threshold = _FLOAT.validate_python(values["threshold"])
            if not 0.0 <= threshold <= 1.0:
                return None
            options["threshold"] = threshold
    except ValidationError:
        return None
    if many and "model" in values:
        options["model"] = values["model"]
    return options


class ScoreFastPath:
    """``POST /score``, ``/models/{name}/score`` and ``/score/batch`` answered without FastAPI's routing, dependency
    injection and response model, which cost a request about as much CPU as the rest of it outside decoding (measured:
    docs/sizing.md). The same code answers (:func:`_score`, the API key's check, the error table); a query it cannot
    read plainly goes the FastAPI way, for FastAPI's own answer. The routes stay declared (OpenAPI)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        path = route = scope["path"]
        name, many = None, False
        if path == "/score/batch":
            many = True
        elif path != "/score":
            parts = path.split("/")
            if len(parts) != 4 or parts[1] != "models" or parts[3] != "score" or not parts[2]:
                return await self.app(scope, receive, send)
            name, route = parts[2], "/models/{name}/score"
        options = _plain_query(scope["query_string"], many)
        if options is None:
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["route"] = route  # the label of its metrics and access log line
        request = Request(scope, receive)
        state = scope["app"].state.service
        try:
            await require_api_key(request, state.settings)
            result = await _score(
                request,
                state,
                name if not many else options["model"],
                options["heatmap"],
                options["mask"],
                options["threshold"],
                many=many,
                monitor=options["monitor"],
            )
        except Exception as error:  # as the app's error handlers answer it
            response = answer_for(error)
        else:
            body = json.dumps(result, separators=(",", ":")).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await response(scope, receive, send)
