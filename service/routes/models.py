from fastapi import APIRouter

from ..deps import ApiKey, RuntimeDep
from ..openapi import error_responses
from ..schemas import ModelsResponse

router = APIRouter(prefix="/models", tags=["models"], dependencies=[ApiKey])


@router.get("", summary="metadata of every served model; the first listed is the default",
            responses=error_responses(503))
async def list_models(runtime: RuntimeDep) -> ModelsResponse:
    runtime.model(None)  # 503 while loading
    names = [runtime.default_name] + [n for n in runtime.models if n != runtime.default_name]
    return ModelsResponse(default=runtime.default_name, models=[runtime.models[n].describe() for n in names])
