from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..deps import StateDep

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
        queued = model.batcher.admitted + sum(m.batcher.admitted for m in state.retired if m.name == name)
        state.metrics.queue_depth.labels(name).set(queued)
        state.metrics.show_reading(name, model.monitor.reading()[0], model.scorer.calibration.false_alarm_bound)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
