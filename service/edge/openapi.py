"""The OpenAPI document, made to tell the truth about what the service answers.

FastAPI documents 200 and its own 422 shape; the service also answers 401, 404, 408, 413, 415,
500, 503 and 504, all as :class:`~padim.service.edge.schemas.ErrorResponse`. The routes declare
their statuses with :func:`error_responses`; :func:`truthful_openapi` then replaces FastAPI's
422 schema with the real one and, only when ``PADIM_API_KEY`` is set, declares the key as a
security scheme on the routes that need it (a key the server does not check is not declared).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .schemas import ErrorResponse

RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}

_WHY = {
    400: "the body's sha256 is not the one X-Content-SHA256 says (`digest_mismatch`), a malformed header "
    "(`invalid_parameter`), or a JSON body that cannot be read (`invalid_body`)",
    401: "missing or wrong API key (`unauthorized`)",
    403: "the scoring key (PADIM_API_KEY) on an admin route, or reviewing with it (`forbidden`)",
    404: "no model of that name (`model_not_found`), no such version (`version_not_found`), no such record or job "
    "(`record_not_found`), no line of that name or no picture from it yet (`line_not_found`)",
    410: "the record's picture was evicted (retention, byte budget), or the version that scored it was deleted "
    "(`gone`)",
    408: "the body did not arrive within PADIM_BODY_TIMEOUT_S (`body_timeout`)",
    413: "body over PADIM_MAX_UPLOAD_BYTES (`payload_too_large`) or image over PADIM_MAX_IMAGE_PIXELS "
    "(`image_too_large`)",
    409: "a change the repository's state does not allow: models served from PADIM_MODELS / PADIM_MODEL_DIR "
    "(`read_only_models`), removing the active version (`version_active`), a rollback with nothing to go back to "
    "(`nothing_to_roll_back`), unloading the default model (`default_model`), another change of the model under "
    "way (`model_busy`), an update with nothing to learn (`nothing_to_update`), activating an updated version "
    "whose gate failed without force=true (`update_gate_failed`), a threshold asked of a line with too few pictures "
    "(`too_few_line_pictures`), activating a line's threshold after the line changed without force=true "
    "(`line_changed`)",
    415: "neither multipart/form-data nor a raw image body (`unsupported_media_type`)",
    422: "not an image, an empty body, a malformed multipart body, more images than the batch limit or a bad "
    "option (`invalid_image`, `empty_body`, `invalid_multipart`, `missing_file`, `too_many_files`, "
    "`batch_too_large`, `invalid_parameter`); a model file that cannot be served (`invalid_model`) or a bad "
    "model name (`invalid_request`); client fields that are not a small map of strings (`invalid_fields`); a "
    "model that cannot learn from reviews, an export or a --slim file (`not_updatable`)",
    500: "the model gave a non-finite score, so no verdict (`non_finite_score`); scoring failed (`scoring_failed`); "
    "or an internal error",
    503: "models still loading (`not_ready`), the queue full (`overloaded`), a batch out of GPU memory even in two "
    "halves (`device_out_of_memory`) or the server shutting down "
    "(`shutting_down`); with PADIM_RECORD_REQUIRED, a row the record cannot make durable "
    "(`record_unavailable`); the record's database unreachable (`record_unavailable`)",
    504: "not scored within PADIM_REQUEST_TIMEOUT_S (`timeout`)",
    507: "not enough free memory (or GPU memory) to load another version beside the loaded ones "
    "(`insufficient_memory`); the disk that would keep it is full, and nothing of it was kept "
    "(`insufficient_storage`)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status with its meaning and the error schema."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        responses[status] = {"model": ErrorResponse, "description": _WHY[status]}
        if status == 503:
            responses[status]["headers"] = RETRY_AFTER
    return responses


def truthful_openapi(
    app: FastAPI,
    protected_tags: set[str],
    api_key_required: bool,
    batch_limit: int,
    admin_tags: frozenset[str] = frozenset({"admin"}),
    any_key: bool = False,
    record_tags: frozenset[str] = frozenset({"record"}),
) -> dict[str, Any]:
    """The app's OpenAPI document with the real 422 schema, the batch limit and, when a key is
    required, its security scheme (the admin routes, present only with an admin key, always need it)."""
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.get("responses", {})
            if "422" in responses:
                responses["422"] = {"description": _WHY[422], "content": {"application/json": {"schema": error_ref}}}
            tags = set(operation.get("tags", []))
            if (api_key_required and protected_tags & tags) or admin_tags & tags or (any_key and record_tags & tags):
                operation["security"] = [{"ApiKey": []}, {"Bearer": []}]
                responses["401"] = {
                    "description": _WHY[401],
                    "content": {"application/json": {"schema": error_ref}},
                    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
                }
    batch_body = document["paths"]["/score/batch"]["post"]["requestBody"]["content"]["multipart/form-data"]
    batch_body["schema"]["properties"]["file"]["maxItems"] = batch_limit
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    if (
        api_key_required
        or any_key
        or any(
            admin_tags & set(op.get("tags", [])) for item in document.get("paths", {}).values() for op in item.values()
        )
    ):
        components["securitySchemes"] = {
            "ApiKey": {
                "type": "apiKey",
                "in": "header",
                "name": "X-API-Key",
                "description": "PADIM_API_KEY (scoring, reading the record), "
                "PADIM_REVIEW_KEY (reviewing, reading the record), or PADIM_ADMIN_KEY (every route)",
            },
            "Bearer": {"type": "http", "scheme": "bearer", "description": "either key as a bearer token"},
        }
    app.openapi_schema = document
    return document
