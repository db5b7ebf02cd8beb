from fastapi import APIRouter

from ..deps import ApiKey, StateDep
from ..openapi import error_responses
from ..schemas import ModelsResponse, MonitorResponse

router = APIRouter(prefix="/models", tags=["models"], dependencies=[ApiKey])


@router.get("", summary="metadata of every served model; the first listed is the default",
            responses=error_responses(503))
async def list_models(state: StateDep) -> ModelsResponse:
    state.model(None)  # 503 while loading
    names = [state.default_name] + [n for n in state.models if n != state.default_name]
    return ModelsResponse(default=state.default_name, models=[state.models[n].describe() for n in names])


@router.get("/{name}/monitor", summary="the model's last images read against its calibration: flag rate, score and "
            "input drift", responses=error_responses(404, 503))
async def monitor(name: str, state: StateDep) -> MonitorResponse:
    served = state.model(name)
    return MonitorResponse(model=served.name, **served.monitor.to_dict())


@router.post("/{name}/monitor/reset", summary="forget the model's window (after a fix on the line); the Prometheus "
             "counters keep counting", responses=error_responses(404, 503))
async def reset_monitor(name: str, state: StateDep) -> MonitorResponse:
    served = state.model(name)
    served.monitor.reset()
    return MonitorResponse(model=served.name, **served.monitor.to_dict())
