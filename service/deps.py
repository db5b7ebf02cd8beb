"""FastAPI dependencies as ``Annotated`` aliases."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from .errors import ApiError
from .settings import ServiceSettings
from .state import ServiceState


async def get_state(request: Request) -> ServiceState:
    return request.app.state.service


async def get_service_settings(request: Request) -> ServiceSettings:
    return request.app.state.service.settings


async def require_api_key(request: Request, settings: Annotated[ServiceSettings, Depends(get_service_settings)]) -> None:
    """``X-API-Key: KEY`` or ``Authorization: Bearer KEY`` when ``PADIM_API_KEY`` is set."""
    if settings.api_key is None:
        return
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token if scheme.lower() == "bearer" else None
    if given is None or not secrets.compare_digest(given.encode(), settings.api_key.get_secret_value().encode()):
        raise ApiError(401, "unauthorized", "missing or wrong API key (send X-API-Key or Authorization: Bearer)",
                       headers={"WWW-Authenticate": "Bearer"})


StateDep = Annotated[ServiceState, Depends(get_state)]
ApiKey = Depends(require_api_key)
