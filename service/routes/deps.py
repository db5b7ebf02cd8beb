"""FastAPI dependencies as ``Annotated`` aliases."""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import SecretStr

from ..edge.errors import ApiError
from ..settings import ServiceSettings
from ..state import ServiceState
from ..state.surface import ScoreSurface


async def get_state(request: Request) -> ServiceState:
    return request.app.state.service


async def get_score_surface(request: Request) -> ScoreSurface[Any]:
    """The score routes' surface: the service's state in one process, an API process's own in several."""
    return request.app.state.service


async def get_service_settings(request: Request) -> ServiceSettings:
    return request.app.state.service.settings


def _given_key(request: Request) -> str | None:
    """``X-API-Key: KEY`` or ``Authorization: Bearer KEY``."""
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token if scheme.lower() == "bearer" else None
    return given


def _is(given: str | None, key: SecretStr | None) -> bool:
    return (
        given is not None
        and key is not None
        and secrets.compare_digest(given.encode(), key.get_secret_value().encode())
    )


def _unauthorized(which: str) -> ApiError:
    return ApiError(
        "unauthorized",
        f"missing or wrong {which} (send X-API-Key or Authorization: Bearer)",
        headers={"WWW-Authenticate": "Bearer"},
    )


async def require_api_key(
    request: Request, settings: Annotated[ServiceSettings, Depends(get_service_settings)]
) -> None:
    """The API key (or the admin key, which opens every route) when ``PADIM_API_KEY`` is set."""
    if settings.api_key is None:
        return
    given = _given_key(request)
    if not (_is(given, settings.api_key) or _is(given, settings.admin_key)):
        raise _unauthorized("API key")


async def require_record_reader(
    request: Request, settings: Annotated[ServiceSettings, Depends(get_service_settings)]
) -> None:
    """Reading the inspection record: any key the service has (scoring, review, admin); open when none is set."""
    keys = [k for k in (settings.api_key, settings.admin_key, settings.review_key) if k is not None]
    if not keys:
        return
    given = _given_key(request)
    if not any(_is(given, key) for key in keys):
        raise _unauthorized("API key")


async def require_review_key(
    request: Request, settings: Annotated[ServiceSettings, Depends(get_service_settings)]
) -> None:
    """Reviewing: the review key (``PADIM_REVIEW_KEY``) or the admin key; open when the service has no key at all.
    The scoring key gets 403."""
    if settings.api_key is None and settings.admin_key is None and settings.review_key is None:
        return
    given = _given_key(request)
    if _is(given, settings.review_key) or _is(given, settings.admin_key):
        return
    if _is(given, settings.api_key):
        raise ApiError(
            "forbidden",
            "the API key scores and reads the record; reviewing needs PADIM_REVIEW_KEY or the admin key",
        )
    raise _unauthorized("review key")


async def require_admin_key(
    request: Request, settings: Annotated[ServiceSettings, Depends(get_service_settings)]
) -> None:
    """The admin key (``PADIM_ADMIN_KEY``); the scoring key gets 403, any other or none 401."""
    given = _given_key(request)
    if _is(given, settings.admin_key):
        return
    if _is(given, settings.api_key):
        raise ApiError("forbidden", "the API key scores images; changing models needs the admin key (PADIM_ADMIN_KEY)")
    raise _unauthorized("admin key")


StateDep = Annotated[ServiceState, Depends(get_state)]
ScoreDep = Annotated[ScoreSurface[Any], Depends(get_score_surface)]
ApiKey = Depends(require_api_key)
AdminKey = Depends(require_admin_key)
RecordReader = Depends(require_record_reader)
ReviewKey = Depends(require_review_key)
