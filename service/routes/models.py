import asyncio

from fastapi import APIRouter

from padim.core.errors import PadimError

from ..edge.openapi import error_responses
from ..edge.schemas import ModelsResponse, MonitorResponse
from .deps import ApiKey, StateDep

router = APIRouter(prefix="/models", tags=["models"], dependencies=[ApiKey])


@router.get(
    "", summary="metadata of every served model; the first listed is the default", responses=error_responses(503)
)
async def list_models(state: StateDep) -> ModelsResponse:
    if not state.ready:
        state.model(None)  # 503 while loading
    names = ([state.default_name] if state.default_name in state.models else []) + [
        n for n in state.models if n != state.default_name
    ]
    versions = await asyncio.to_thread(lambda: {n: _versions(state, n) for n in names})  # files: off the event loop
    return ModelsResponse(
        default=state.default_name,
        models=[state.models[n].describe(versions[n]) for n in names],
        record=state.record is not None,
    )


def _versions(state, name: str) -> list[dict]:
    try:
        return state.changes.versions_of(name)
    except PadimError:  # its folder removed by hand while it is served: the model still answers
        return []


@router.get(
    "/{name}/monitor",
    summary="the model's last images read against its calibration: flag rate, score and input drift",
    responses=error_responses(404, 503),
)
async def monitor(name: str, state: StateDep) -> MonitorResponse:
    served = state.model(name)
    return MonitorResponse(model=served.name, version=served.version, **served.monitor.to_dict())


@router.post(
    "/{name}/monitor/reset",
    summary="forget the model's window (after a fix on the line); the Prometheus counters keep counting",
    responses=error_responses(404, 503),
)
async def reset_monitor(name: str, state: StateDep) -> MonitorResponse:
    served = state.model(name)
    served.monitor.reset()
    return MonitorResponse(model=served.name, version=served.version, **served.monitor.to_dict())
