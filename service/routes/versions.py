"""The admin routes: a model's versions, uploaded, activated, rolled back, removed and unloaded while the service runs.

Present only when ``PADIM_ADMIN_KEY`` is set, and opened by that key alone (the scoring key gets 403).
On a fixed set of models (``PADIM_MODELS`` / ``PADIM_MODEL_DIR``) a change answers 409 ``read_only_models``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from padim.models.errors import DigestMismatch
from padim.models.repository import MODEL_FILE, check_name

from ..edge.errors import ApiError
from ..edge.openapi import error_responses
from ..edge.schemas import VersionChange, VersionInfo, VersionsResponse
from .deps import AdminKey, StateDep

router = APIRouter(prefix="/models", tags=["admin"], dependencies=[AdminKey])

#: Route of the upload: the body guard gives it PADIM_MAX_MODEL_UPLOAD_BYTES and PADIM_MODEL_UPLOAD_TIMEOUT_S.
UPLOAD_PATH = re.compile(r"^/models/[^/]+/versions/?$")
#: Bytes gathered from the stream before they are written (and hashed) on a thread, off the event loop.
WRITE_BYTES = 8 * 2**20
SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")


@router.get(
    "/{name}/versions",
    summary="every version of a model, the active one marked, with its calibration",
    responses=error_responses(403, 404, 503),
)
async def list_versions(name: str, state: StateDep) -> VersionsResponse:
    if not state.ready:
        state.model(None)  # 503 while loading
    return VersionsResponse(
        model=name, versions=[VersionInfo(**v) for v in await asyncio.to_thread(state.changes.versions_of, name)]
    )


@router.post(
    "/{name}/versions",
    status_code=201,
    summary="upload a model file as the next version (streamed to disk; "
    "loaded and warmed up beside the active version to check that it can be served)",
    responses=error_responses(400, 403, 408, 409, 413, 415, 422, 503, 507),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def upload(
    name: str,
    request: Request,
    state: StateDep,
    activate: Annotated[bool, Query(description="activate it once loaded")] = False,
    x_content_sha256: Annotated[
        str | None, Header(description="the body's sha256 (hex); a mismatch is refused (400 digest_mismatch)")
    ] = None,
) -> VersionChange:
    repository = state.changes.writable()
    check_name(name)
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("application/octet-stream"):
        raise ApiError(
            "unsupported_media_type",
            f"content type {content_type or 'none'!r}: send the model file "
            "as the raw body with content type application/octet-stream",
        )
    if x_content_sha256 is not None and not SHA256.match(x_content_sha256):
        raise ApiError("invalid_parameter", "X-Content-SHA256: expected 64 hexadecimal digits", status=400)
    incoming = await asyncio.to_thread(repository.incoming, name)
    try:
        digest, size = await _receive(request, incoming / MODEL_FILE)
        if size == 0:
            raise ApiError("empty_body", "the model file is empty")
        if x_content_sha256 is not None and x_content_sha256.lower() != digest:
            raise DigestMismatch(
                f"the body's sha256 is {digest}, not the {x_content_sha256.lower()} that "
                "X-Content-SHA256 says: the file was changed or cut on the way"
            )
        change = await state.changes.add_version(name, incoming, digest, activate)
    except BaseException:
        await asyncio.to_thread(repository.discard, incoming)
        raise
    return VersionChange(model=name, **change)


async def _receive(request: Request, path: Path) -> tuple[str, int]:
    """Stream the body into ``path`` (fsynced); returns its sha256 and size. Memory: ``WRITE_BYTES`` at most."""
    digest, size, pending, held = hashlib.sha256(), 0, [], 0

    def write(handle, blocks: list[bytes]) -> None:
        for block in blocks:
            digest.update(block)
            handle.write(block)

    with open(path, "wb") as handle:
        async for chunk in request.stream():
            pending.append(chunk)
            held += len(chunk)
            size += len(chunk)
            if held >= WRITE_BYTES:
                await asyncio.to_thread(write, handle, pending)
                pending, held = [], 0
        await asyncio.to_thread(write, handle, pending)
        handle.flush()
        await asyncio.to_thread(os.fsync, handle.fileno())
    return digest.hexdigest(), size


@router.post(
    "/{name}/versions/{version}/activate",
    summary="serve this version: loaded and warmed up beside the active "
    "one, then swapped in; requests already admitted finish on the version that admitted them",
    responses=error_responses(403, 404, 409, 422, 503, 507),
)
async def activate(
    name: str,
    version: int,
    state: StateDep,
    force: Annotated[
        bool,
        Query(
            description="activate a version made by an update even though its gate "
            "found recall fell by more than PADIM_UPDATE_MAX_RECALL_DROP (kept in "
            "its version.json)"
        ),
    ] = False,
) -> VersionChange:
    return VersionChange(model=name, **await state.changes.activate(name, version, force=force))


@router.post(
    "/{name}/rollback",
    summary="serve the version that was active before the current one (409 when none)",
    responses=error_responses(403, 404, 409, 503, 507),
)
async def rollback(name: str, state: StateDep) -> VersionChange:
    return VersionChange(model=name, **await state.changes.activate(name, 0, rollback=True))


@router.delete(
    "/{name}/versions/{version}",
    status_code=204,
    summary="delete a version that is not active (its number is never given again)",
    responses=error_responses(403, 404, 409, 503),
)
async def remove(name: str, version: int, state: StateDep) -> Response:
    await state.changes.remove(name, version)
    return Response(status_code=204)


@router.delete(
    "/{name}",
    status_code=204,
    summary="stop serving a model (not the default one); its files stay, and activating a version serves it again",
    responses=error_responses(403, 404, 409, 503),
)
async def unload(name: str, state: StateDep) -> Response:
    await state.changes.unload(name)
    return Response(status_code=204)
