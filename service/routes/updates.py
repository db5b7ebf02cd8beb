"""``POST /models/{name}/update`` (admin): a new version that learns from the record's reviews; ``GET /jobs/{id}``.

Present when the record is on; the update route also needs the admin routes (``PADIM_ADMIN_KEY``) and a
repository to write the new version into.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from ..deps import AdminKey, RecordReader, StateDep
from ..openapi import error_responses
from ..schemas import JobInfo, UpdateRequest
from .records import iso, on_database, recorder

router = APIRouter(tags=["admin"], dependencies=[AdminKey])
jobs = APIRouter(tags=["record"], dependencies=[RecordReader])


@router.post(
    "/models/{name}/update",
    status_code=202,
    summary="start a job that adds the pictures reviewed as normal "
    "(and takes out those reviewed as defect that it fitted) into a new version, gated on the reviewed "
    "defects; not active unless activate=true and the gate passes",
    responses=error_responses(400, 403, 404, 409, 422, 503),
)
async def update(
    name: str,
    state: StateDep,
    body: Annotated[UpdateRequest | None, Body()] = None,
    activate: Annotated[bool, Query(description="activate the new version when its gate passes")] = False,
) -> JobInfo:
    body = body or UpdateRequest()
    job = await state.jobs.start(name, body.records, body.version, activate)
    return JobInfo(**_job_out(job))


@jobs.get(
    "/jobs/{job_id}",
    summary="a model update's progress and, once done, its result",
    responses=error_responses(401, 404, 503),
)
async def get_job(job_id: str, state: StateDep) -> JobInfo:
    return JobInfo(**_job_out(await on_database(state, recorder(state).store.jobs.job, job_id)))


def _job_out(job: dict) -> dict:
    return {**job, **{k: iso(job[k]) for k in ("created", "started", "finished")}}
