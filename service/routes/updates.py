"""``POST /models/{name}/update`` (admin): a new version that learns from the record's reviews; ``GET /jobs/{id}``;
``POST /models/{name}/threshold`` (admin): a new version whose threshold the line's normal pictures set.

Present when the record is on; the update route also needs the admin routes (``PADIM_ADMIN_KEY``) and a
repository to write the new version into.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from ..edge.openapi import error_responses
from ..edge.schemas import JobInfo, LineThreshold, LineThresholdRequest, UpdateRequest
from ..updates import propose_line_threshold
from .deps import AdminKey, RecordReader, StateDep
from .records import _seconds, iso, on_database, recorder

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


@router.post(
    "/models/{name}/threshold",
    status_code=201,
    summary="write a new version (not active) with the same Gaussians and the threshold the line's normal pictures "
    "set (their conformal quantile, from the record's scores), with the threshold and cover it replaces and the "
    "recall it buys on reviewed defects; activating it is refused while the line has changed since (409 "
    "line_changed)",
    responses=error_responses(400, 403, 404, 409, 422, 503),
)
async def line_threshold(
    name: str, state: StateDep, body: Annotated[LineThresholdRequest | None, Body()] = None
) -> LineThreshold:
    body = body or LineThresholdRequest()
    since = _seconds("since", body.since)
    repository = state.changes.writable()
    store = recorder(state).store
    async with state.changes.changing(name):
        proposal = await on_database(
            state,
            propose_line_threshold,
            repository,
            store,
            name,
            body.version,
            body.false_alarm_rate,
            since,
            state.settings.update_max_recall_drop,
        )
    state.metrics.model_changes.labels(name, "line_threshold").inc()
    return LineThreshold(model=name, **{**proposal, "proposed": iso(proposal["proposed"])})


@jobs.get(
    "/jobs/{job_id}",
    summary="a model update's progress and, once done, its result",
    responses=error_responses(401, 404, 503),
)
async def get_job(job_id: str, state: StateDep) -> JobInfo:
    return JobInfo(**_job_out(await on_database(state, recorder(state).store.jobs.job, job_id)))


def _job_out(job: dict) -> dict:
    return {**job, **{k: iso(job[k]) for k in ("created", "started", "finished")}}
