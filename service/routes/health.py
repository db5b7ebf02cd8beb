from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ..deps import RuntimeDep

router = APIRouter(prefix="/health", tags=["health"])


@router.get("/live", summary="the process is up (always open)")
async def live() -> dict:
    return {"status": "alive"}


@router.get("/ready", summary="every model is loaded and warm, and the server is not draining (always open)",
            responses={503: {"description": "loading, failed, or draining"}})
async def ready(runtime: RuntimeDep):
    if runtime.ready and not runtime.draining:
        return {"status": "ready", "models": list(runtime.models)}
    reason = "draining" if runtime.draining else ("failed: " + runtime.startup_error if runtime.startup_error else "loading")
    return JSONResponse({"status": "not_ready", "reason": reason}, status_code=503)
