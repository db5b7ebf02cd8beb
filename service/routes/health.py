from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..edge.schemas import LiveResponse, ReadyResponse
from .deps import StateDep

router = APIRouter(prefix="/health", tags=["health"])


@router.get("/live", summary="the process is up (always open)")
async def live() -> LiveResponse:
    return LiveResponse(status="alive")


@router.get(
    "/ready",
    summary="every model is loaded and warm, the GPU (if any) answers a tiny operation, and the "
    "server is not draining (always open)",
    response_model=ReadyResponse,
    response_model_exclude_none=True,
    responses={503: {"model": ReadyResponse, "description": "loading, failed, or draining"}},
)
async def ready(state: StateDep, request: Request):
    lines = request.app.state.lines.health() if request.app.state.lines is not None else None
    device_problem = await state.scoring.check_devices() if state.ready and not state.draining else None
    replica = state.settings.replica
    if state.ready and not state.draining and device_problem is None:
        return ReadyResponse(status="ready", models=list(state.models), lines=lines, replica=replica)
    if state.draining:
        reason = "draining"
    elif device_problem is not None or state.failure is not None:
        reason = f"failed: {device_problem or state.failure}"
    else:
        reason = "failed: " + state.startup_error if state.startup_error else "loading"
    body = (
        {"status": "not_ready", "reason": reason}
        | ({"lines": lines} if lines is not None else {})
        | ({"replica": replica} if replica is not None else {})
    )
    return JSONResponse(body, status_code=503)
