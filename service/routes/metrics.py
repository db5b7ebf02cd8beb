from fastapi import APIRouter, Response

from ..metrics import exposition
from .deps import StateDep

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="Prometheus metrics (open, for scrapers)",
    response_class=Response,
    responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
    },
)
async def metrics(state: StateDep) -> Response:
    loaded: dict[str, int] = {}
    for model in [*state.models.values(), *state.retired]:
        loaded[model.name] = loaded.get(model.name, 0) + 1
    for name, count in loaded.items():
        state.metrics.versions_loaded.labels(name).set(count)
    for name, model in state.models.items():
        state.metrics.queue_depth.labels(name).set(state.places.held(name))
        state.metrics.show_reading(name, model.monitor.reading()[0], model.scorer.calibration.false_alarm_bound)
    body, media_type = exposition(state.metrics.registry)
    return Response(body, media_type=media_type)
