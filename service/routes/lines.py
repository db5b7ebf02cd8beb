"""``/lines``: what each line (PADIM_LINES) is doing, its latest picture, and its camera's trigger."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Request

from padim.core.calibration import threshold_at

from ..edge.errors import ApiError
from ..edge.openapi import error_responses
from ..edge.schemas import LastPicture, LinesResponse, LineState, TriggerRequest, TriggerResponse
from ..lines.pipeline import Lines
from .deps import ApiKey, StateDep

router = APIRouter(prefix="/lines", tags=["lines"], dependencies=[ApiKey])


def _lines(request: Request) -> Lines:
    lines = request.app.state.lines
    assert lines is not None  # the router is included only with PADIM_LINES
    return lines


@router.get("", response_model=LinesResponse, summary="every line: source, rate, counts, last verdict, outboxes")
async def all_lines(request: Request) -> dict:
    return {"lines": _lines(request).describe()}


@router.get("/{name}", response_model=LineState, responses=error_responses(404), summary="one line")
async def one_line(name: str, request: Request) -> dict:
    return _lines(request).runner(name).describe()


@router.post(
    "/{name}/trigger",
    status_code=202,
    response_model=TriggerResponse,
    responses=error_responses(400, 404, 422),
    summary="score the next frame of a camera line in trigger mode (a PLC's or a light barrier's signal)",
)
async def trigger(name: str, request: Request, body: Annotated[TriggerRequest | None, Body()] = None) -> dict:
    runner = _lines(request).runner(name)
    return {"line": name, "triggers_waiting": runner.trigger(body.part if body is not None else None)}


@router.get(
    "/{name}/last",
    response_model=LastPicture,
    responses=error_responses(404, 503),
    summary="the line's latest picture with its heat map (drawn again by the version that scored it)",
)
async def last(name: str, request: Request, state: StateDep) -> dict:
    runner = _lines(request).runner(name)
    message, picture = runner.last, runner.last_picture
    if message is None or picture is None:
        raise ApiError("line_not_found", f"line {name!r} has scored no picture yet")
    threshold = threshold_at(runner.config.threshold)
    drawn = await state.recording.heatmap_of(message["model"], message["version"], picture, threshold)
    return {"message": message, "heatmap": drawn["heatmap"]}
