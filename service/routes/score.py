"""``POST /score``, ``POST /models/{name}/score`` and ``POST /score/batch``."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from ..deps import ApiKey, RuntimeDep
from ..errors import ApiError
from ..runtime import Runtime, ServedModel
from ..schemas import BatchResponse, ScoreResponse

router = APIRouter(tags=["score"], dependencies=[ApiKey])


def _image_body(many: bool) -> dict:
    file_schema = {"type": "string", "format": "binary"}
    properties = {
        "file": {"type": "array", "items": file_schema} if many else file_schema,
        "heatmap": {"type": "boolean"}, "mask": {"type": "boolean"}, "threshold": {"type": "number", "minimum": 0, "maximum": 1},
    }
    content = {"multipart/form-data": {"schema": {"type": "object", "properties": properties, "required": ["file"]}}}
    if not many:
        content["image/*"] = {"schema": file_schema}
    return {"requestBody": {"required": True, "content": content}}


HeatmapQ = Annotated[bool, Query(description="return the heat map (PNG, base64)")]
MaskQ = Annotated[bool, Query(description="return the binary mask at the threshold (PNG, base64)")]
ThresholdQ = Annotated[float | None, Query(ge=0, le=1, description="override the threshold (0..1 score scale) for this request")]


@router.post("/score", response_model=ScoreResponse, response_model_exclude_none=True, openapi_extra=_image_body(False),
             summary="score one image with the default model")
async def score(request: Request, runtime: RuntimeDep, heatmap: HeatmapQ = False, mask: MaskQ = False, threshold: ThresholdQ = None):
    return await _score(request, runtime, None, heatmap, mask, threshold, many=False)


@router.post("/models/{name}/score", response_model=ScoreResponse, response_model_exclude_none=True,
             openapi_extra=_image_body(False), summary="score one image with the named model")
async def score_with(name: str, request: Request, runtime: RuntimeDep, heatmap: HeatmapQ = False, mask: MaskQ = False,
                     threshold: ThresholdQ = None):
    return await _score(request, runtime, name, heatmap, mask, threshold, many=False)


@router.post("/score/batch", response_model=BatchResponse, response_model_exclude_none=True, openapi_extra=_image_body(True),
             summary="score several images (multipart 'file' parts), one result each, in order")
async def score_batch(request: Request, runtime: RuntimeDep, heatmap: HeatmapQ = False, mask: MaskQ = False,
                      threshold: ThresholdQ = None, model: Annotated[str | None, Query(description="model name")] = None):
    return await _score(request, runtime, model, heatmap, mask, threshold, many=True)


async def _score(request: Request, runtime: Runtime, name: str | None, heatmap: bool, mask: bool,
                 threshold: float | None, many: bool) -> dict:
    started = time.perf_counter()
    served = runtime.model(name)
    request.state.model = served.name
    datas, form_options = await _read_images(request, many, runtime.settings.max_batch_size)
    heatmap = form_options.get("heatmap", heatmap)
    mask = form_options.get("mask", mask)
    threshold = form_options.get("threshold", threshold)
    results = await _score_images(runtime, served, datas, threshold, heatmap, mask)
    latency_ms = round((time.perf_counter() - started) * 1000, 3)
    if many:
        return {"results": results, "model": served.info().model_dump(), "latency_ms": latency_ms}
    return {**results[0], "model": served.info().model_dump(), "latency_ms": latency_ms}


async def _score_images(runtime: Runtime, served: ServedModel, datas: list[bytes], threshold, heatmap, mask) -> list[dict]:
    loop = asyncio.get_running_loop()
    decoded = await asyncio.gather(*[loop.run_in_executor(runtime.decode, runtime.decode_image, served, d) for d in datas])
    futures = []
    try:
        for _, tensor in decoded:
            futures.append(served.batcher.submit(tensor))
        scored = await asyncio.wait_for(asyncio.gather(*futures), timeout=runtime.settings.request_timeout_s)
    except TimeoutError:
        raise ApiError(504, "timeout", f"not scored within {runtime.settings.request_timeout_s:g} s; the server is overloaded") from None
    finally:
        for future in futures:  # a failed or abandoned request leaves nothing for the batcher to do
            if not future.done():
                future.cancel()
    return list(await asyncio.gather(*[
        loop.run_in_executor(runtime.decode, runtime.build_result, served, image, raw, anomaly_map, threshold, heatmap, mask)
        for (image, _), (raw, anomaly_map) in zip(decoded, scored)
    ]))


async def _read_images(request: Request, many: bool, max_files: int) -> tuple[list[bytes], dict]:
    """The image bytes (one, or several for /score/batch) and options given as form fields."""
    content_type = request.headers.get("content-type", "")
    options: dict = {}
    if content_type.startswith("multipart/form-data"):
        try:
            form = await request.form(max_files=max_files if many else 1)
        except HTTPException as error:
            raise ApiError(422, "invalid_multipart", f"the multipart body could not be read: {error.detail}") from None
        parts = form.getlist("file")
        if not parts:
            raise ApiError(422, "missing_file", "the multipart body has no 'file' field")
        if any(not isinstance(p, UploadFile) for p in parts):
            raise ApiError(422, "missing_file", "'file' must be a file part, not a text field")
        datas = [await p.read() for p in parts]
        options = _form_options(form)
    elif content_type.startswith(("image/", "application/octet-stream")):
        if many:
            raise ApiError(415, "unsupported_media_type", "/score/batch takes multipart/form-data with several 'file' parts")
        datas = [await request.body()]
    else:
        raise ApiError(415, "unsupported_media_type",
                       f"content type {content_type or 'none'!r}: send the image as multipart field 'file' "
                       "or as the raw body with an image/* content type")
    for i, data in enumerate(datas):
        if not data:
            raise ApiError(422, "empty_body", "the image is empty" + (f" (file part {i})" if many else ""))
    return datas, options


def _form_options(form) -> dict:
    options = {}
    for key in ("heatmap", "mask"):
        value = form.get(key)
        if isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ApiError(422, "invalid_parameter", f"{key}: expected true or false, got {value!r}")
            options[key] = value.lower() in ("true", "1", "yes")
    value = form.get("threshold")
    if isinstance(value, str):
        try:
            threshold = float(value)
        except ValueError:
            threshold = float("nan")
        if not 0.0 <= threshold <= 1.0:
            raise ApiError(422, "invalid_parameter", f"threshold: expected a number in [0, 1], got {value!r}")
        options["threshold"] = threshold
    return options
