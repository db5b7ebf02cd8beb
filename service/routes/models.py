from fastapi import APIRouter

from ..deps import ApiKey, StateDep
from ..openapi import error_responses
from ..schemas import ModelsResponse

router = APIRouter(prefix="/models", tags=["models"], dependencies=[ApiKey])


@router.get("", summary="metadata of every served model; the first listed is the default",
            responses=error_responses(503))
async def list_models(state: StateDep) -> ModelsResponse:
    state.model(None)  # 503 while loading
    names = [state.default_name] + [n for n in state.models if n != state.default_name]
    return ModelsResponse(default=state.default_name, models=[state.models[n].describe() for n in names])
