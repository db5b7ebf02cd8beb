from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ..deps import StateDep
from ..schemas import LiveResponse, ReadyResponse

router = APIRouter(prefix="/health", tags=["health"])


@router.get("/live", summary="the process is up (always open)")
async def live() -> LiveResponse:
    return LiveResponse(status="alive")


@router.get("/ready", summary="every model is loaded and warm, and the server is not draining (always open)",
            response_model=ReadyResponse, response_model_exclude_none=True,
            responses={503: {"model": ReadyResponse, "description": "loading, failed, or draining"}})
async def ready(state: StateDep):
    if state.ready and not state.draining:
        return ReadyResponse(status="ready", models=list(state.models))
    reason = "draining" if state.draining else ("failed: " + state.startup_error if state.startup_error else "loading")
    return JSONResponse({"status": "not_ready", "reason": reason}, status_code=503)
