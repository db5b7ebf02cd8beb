"""The inspection record: rows, pictures and heat maps of what was scored, and an operator's reviews.

Present when the record is on (``PADIM_RECORD_DIR`` or ``PADIM_RECORD_URL``). Reading needs any key the service
has (scoring, review or admin); reviewing needs ``PADIM_REVIEW_KEY`` or the admin key. A service without any key
leaves them open, like its other routes: a line that keeps a record should set keys (docs/record.md).
"""

from __future__ import annotations

import asyncio
import base64
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from sqlalchemy.exc import SQLAlchemyError

from padim.models.errors import RecordGone, RecordUnavailable

from ..edge.errors import ApiError
from ..edge.openapi import error_responses
from ..edge.schemas import MAX_VERSION, RecordDetail, RecordRow, RecordsPage, RecordStorage, ReviewRequest
from ..record.pictures import picture_format
from ..record.recorder import Recorder
from ..record.store import Filters
from ..state import ServiceState
from .deps import RecordReader, ReviewKey, StateDep

router = APIRouter(prefix="/records", tags=["record"])


def iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def row_out(row: dict) -> dict:
    return {
        **row,
        "time": iso(row["time"]),
        "reviewed_at": iso(row.get("reviewed_at")),
        **({"reviews": [{**r, "time": iso(r["time"])} for r in row["reviews"]]} if "reviews" in row else {}),
    }


def recorder(state: ServiceState) -> Recorder:
    """The service's record; 503 record_unavailable where it is off."""
    if state.record is None:
        raise RecordUnavailable("the inspection record is off")
    return state.record


async def on_database(state: ServiceState, call, *args):
    """Run a blocking record call off the event loop; a database that cannot answer is 503 record_unavailable."""
    if state.record is None:
        raise RecordUnavailable("the inspection record is off")
    try:
        return await asyncio.to_thread(call, *args)
    except SQLAlchemyError as error:
        raise RecordUnavailable(
            f"the record's database does not answer ({str(error).splitlines()[0][:200]}); rows "
            "wait in the journal meanwhile"
        ) from None


Model = Annotated[str | None, Query(description="the model's name")]
Limit = Annotated[int, Query(ge=1, le=500, description="rows per page")]


@router.get(
    "",
    summary="recorded pictures, newest first, filtered; paged by cursor",
    dependencies=[RecordReader],
    responses=error_responses(401, 503),
)
async def list_records(
    state: StateDep,
    model: Model = None,
    version: Annotated[int | None, Query(ge=1, le=MAX_VERSION)] = None,
    verdict: Annotated[Literal["anomalous", "normal"] | None, Query(description="the verdict given")] = None,
    label: Annotated[
        Literal["normal", "defect", "none"] | None, Query(description="the latest review's label; none: not reviewed")
    ] = None,
    since: Annotated[
        str | None,
        Query(
            description="scored at or after (ISO 8601; UTC unless it says)", json_schema_extra={"format": "date-time"}
        ),
    ] = None,
    until: Annotated[
        str | None, Query(description="scored before (ISO 8601)", json_schema_extra={"format": "date-time"})
    ] = None,
    part: Annotated[str | None, Query(max_length=256, description="the client's part field")] = None,
    limit: Limit = 50,
    cursor: Annotated[str | None, Query(pattern="^[0-9a-f]{32}$", description="`next` of the previous page")] = None,
) -> RecordsPage:
    filters = Filters(
        model=model,
        version=version,
        verdict=verdict,
        label=label,
        since=_seconds("since", since),
        until=_seconds("until", until),
        part=part,
    )
    return _page(await on_database(state, recorder(state).store.list, filters, limit, cursor), limit)


@router.get(
    "/queue",
    summary="the review queue: flagged pictures and a small random share of passed ones "
    "(PADIM_REVIEW_SAMPLE), not reviewed yet, newest first",
    dependencies=[RecordReader],
    responses=error_responses(401, 503),
)
async def review_queue(
    state: StateDep,
    model: Model = None,
    limit: Limit = 50,
    cursor: Annotated[str | None, Query(pattern="^[0-9a-f]{32}$")] = None,
) -> RecordsPage:
    rows = await on_database(state, recorder(state).store.list, Filters(model=model, queue=True), limit, cursor)
    return _page(rows, limit)


@router.get(
    "/storage",
    summary="what the record holds on disk against its budget, pinned pictures apart",
    dependencies=[RecordReader],
    responses=error_responses(401, 503),
)
async def storage(state: StateDep) -> RecordStorage:
    record = recorder(state)
    # The journal first: a row it no longer holds is in the database before the counts below are read, so a
    # report with nothing waiting counts every picture and row answered before it was asked for.
    rows_waiting, journal_bytes = await asyncio.to_thread(record.waiting_everywhere)
    report = await on_database(state, record.store.storage)
    rows = await on_database(state, record.store.count, Filters())
    settings = state.settings
    return RecordStorage(
        database=record.store.kind,
        database_up=record.database_up,
        required=settings.record_required,
        rows=rows,
        rows_waiting=rows_waiting,
        journal_bytes=journal_bytes,
        journal_max_bytes=settings.record_journal_max_bytes,
        max_bytes=settings.record_max_bytes,
        retention_days=settings.record_retention_days,
        flagged_retention_days=settings.record_flagged_retention_days,
        **report,
    )


@router.get(
    "/{record_id}",
    summary="one recorded picture's row, with every review",
    dependencies=[RecordReader],
    responses=error_responses(401, 404, 503),
)
async def get_record(record_id: str, state: StateDep) -> RecordDetail:
    return RecordDetail(**row_out(await on_database(state, recorder(state).store.get, record_id)))


@router.get(
    "/{record_id}/image",
    summary="the picture as it was sent (its bytes, never re-encoded)",
    dependencies=[RecordReader],
    responses={**error_responses(401, 404, 410, 503), 200: {"content": {"image/*": {}}, "description": "the picture"}},
)
async def get_image(record_id: str, state: StateDep) -> Response:
    row = await on_database(state, recorder(state).store.get, record_id)
    data = await asyncio.to_thread(recorder(state).pictures.read, row["sha256"])
    if data is None:
        raise _gone(record_id, row)
    return Response(
        data,
        media_type=picture_format(data)[0],
        headers={"Cache-Control": "private, max-age=86400", "X-Content-Type-Options": "nosniff"},
    )


@router.get(
    "/{record_id}/heatmap",
    summary="the picture's heat map, drawn again by the version that scored it "
    "(410 once that version was deleted or the picture evicted)",
    dependencies=[RecordReader],
    responses={**error_responses(401, 404, 410, 503, 507), 200: {"content": {"image/png": {}}, "description": "PNG"}},
)
async def get_heatmap(record_id: str, state: StateDep) -> Response:
    row = await on_database(state, recorder(state).store.get, record_id)
    data = await asyncio.to_thread(recorder(state).pictures.read, row["sha256"])
    if data is None:
        raise _gone(record_id, row)
    result = await state.recording.heatmap_of(row["model"], row["version"], data, row["threshold"])
    return Response(
        base64.b64decode(result["heatmap"]), media_type="image/png", headers={"Cache-Control": "private, max-age=3600"}
    )


@router.post(
    "/{record_id}/review",
    summary="review a recorded picture: normal (a false alarm an update may learn "
    "from) or defect; every review is kept, the latest counts",
    dependencies=[ReviewKey],
    responses=error_responses(400, 401, 403, 404, 422, 503),
)
async def review(record_id: str, body: ReviewRequest, state: StateDep) -> RecordDetail:
    row = await on_database(
        state, recorder(state).store.review, record_id, body.label, body.defect_type, body.note, body.reviewer
    )
    state.metrics.reviews.labels(row["model"], body.label).inc()
    return RecordDetail(**row_out(row))


def _gone(record_id: str, row: dict) -> RecordGone:
    if row["picture_kept"]:  # the database says it is kept: in another replica's folder, or lost with its disk
        return RecordGone(
            f"the picture of record {record_id} is not in this service's record folder (stored by "
            "another replica?); its row stays"
        )
    return RecordGone(
        f"the picture of record {record_id} was evicted (retention or the byte budget: "
        "GET /records/storage); its row stays"
    )


def _page(rows: list[dict], limit: int) -> RecordsPage:
    return RecordsPage(
        records=[RecordRow(**row_out(r)) for r in rows], next=rows[-1]["id"] if len(rows) == limit else None
    )


def _seconds(name: str, text: str | None) -> float | None:
    """An ISO 8601 moment (``2026-11-25T08:00:00Z``; UTC unless it says) as seconds since the epoch."""
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ApiError(
            "invalid_parameter",
            f"{name}: expected an ISO 8601 date and time such as 2026-11-25T08:00:00Z, got {text!r}",
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
