"""``POST /score``, ``POST /models/{name}/score`` and ``POST /score/batch``."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from padim.models.errors import RecordUnavailable

from ..batching import Admission
from ..deps import ApiKey, StateDep
from ..errors import ApiError
from ..openapi import error_responses
from ..record.rows import InvalidFields, parse_fields
from ..schemas import BatchResponse, ScoreResponse
from ..state import ScoredImage, ServedModel, ServiceState

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
    content = {"multipart/form-data": {"schema": {"type": "object", "properties": properties, "required": ["file"]}}}
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
    state: StateDep,
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
    state: StateDep,
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
    state: StateDep,
    heatmap: HeatmapQ = False,
    mask: MaskQ = False,
    threshold: ThresholdQ = None,
    model: Annotated[str | None, Query(description="model name")] = None,
    monitor: MonitorQ = True,
):
    return await _score(request, state, model, heatmap, mask, threshold, many=True, monitor=monitor)


async def _score(
    request: Request,
    state: ServiceState,
    name: str | None,
    heatmap: bool,
    mask: bool,
    threshold: float | None,
    many: bool,
    monitor: bool = True,
) -> dict:
    started = time.perf_counter()
    # The version that admits the request scores and judges it, whatever is activated meanwhile.
    with state.using(state.model(name)) as served:
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
        with served.batcher.admit(len(datas)) as admission:  # 503 now, before anything is decoded
            scored, results, pictures = await _score_images(
                request, state, served, datas, admission, threshold, heatmap, mask
            )
        if monitor:
            state.observe(served, scored, results, own_threshold=threshold is not None)
        if recording:
            futures = state.keep(served, datas, digests, fields if many else [fields], scored, results, pictures)
            if state.settings.record_required:
                await _durable(futures, state.settings.record_timeout_s)
    latency_ms = round((time.perf_counter() - started) * 1000, 3)
    if many:
        return {"results": results, "model": served.info().model_dump(), "latency_ms": latency_ms}
    return {**results[0], "model": served.info().model_dump(), "latency_ms": latency_ms}


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


async def _score_images(
    request: Request,
    state: ServiceState,
    served: ServedModel,
    datas: list[bytes],
    admission: Admission,
    threshold,
    heatmap,
    mask,
) -> tuple[list[ScoredImage], list[dict], list[tuple[int, int]]]:
    """Each image as scored, its result, and each picture's size as sent.

    A client that disconnects while its images wait for a batch takes them out of the queue (the
    batcher skips cancelled ones), so that it costs no batch; its request is logged as 499.
    """
    loop = asyncio.get_running_loop()
    decoded = await asyncio.gather(
        *[loop.run_in_executor(state.decode, state.decode_image, served, d, heatmap) for d in datas]
    )
    futures = []
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        for image in decoded:
            futures.append(served.batcher.submit(image.tensor, admission))
        answered = asyncio.gather(*futures)
        done, _ = await asyncio.wait(
            {answered, gone}, timeout=state.settings.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if answered not in done:
            answered.cancel()
            if gone in done:
                raise ApiError(
                    "client_disconnected",
                    "the client closed the connection before its images were scored",
                )
            raise ApiError(
                "timeout", f"not scored within {state.settings.request_timeout_s:g} s; the server is overloaded"
            )
        scored = answered.result()
    finally:
        gone.cancel()
        for future in futures:  # a failed or abandoned request leaves nothing for the batcher to do
            if not future.done():
                future.cancel()
    results = list(
        await asyncio.gather(
            *[
                loop.run_in_executor(
                    state.decode, state.build_result, served, image, one.raw_score, one.map, threshold, heatmap, mask
                )
                for image, one in zip(decoded, scored, strict=True)
            ]
        )
    )
    return scored, results, [image.picture for image in decoded]


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
        parts = form.getlist("file")
        if not parts:
            raise ApiError("missing_file", "the multipart body has no 'file' field")
        if any(not isinstance(p, UploadFile) for p in parts):
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
    options = {}
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
