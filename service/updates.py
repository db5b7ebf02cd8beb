"""Model updates from the record's reviews (``POST /models/{name}/update``), run as jobs beside scoring.

A job takes a version of a model (the active one by default) and writes a **new version**, not active:

1. pictures reviewed as *defect* that the version fitted (an earlier review said normal, wrongly) are taken
   out of its statistics and calibration, exactly; pictures reviewed as *normal* that it has not fitted are
   added, as ``train --resume`` adds them (:func:`padim.models.fit.learning.update_model`);
2. the **gate** scores every reviewed defect, and the reviewed normal pictures the new version did not fit,
   with the old and the new version (:func:`padim.models.fit.learning.gate`);
3. the new version is committed to the repository with what it learned (record ids), its gate and its job,
   and activated when asked and the gate passed.

**A threshold sized by the line** (``POST /models/{name}/threshold``, ``padim repository tighten``;
:func:`propose_line_threshold`): the same Gaussians, the threshold set again from what the line's normal pictures
scored (the record's raw scores: every picture those Gaussians scored that no review called a defect), by their own
conformal quantile (:meth:`padim.core.calibration.Calibration.tightened`). No picture is scored again. It is written
as a new version, not active, with the threshold it replaces, the cover it was sized by, and the same gate on the
reviewed pictures' recorded scores; activating it is refused while the line has changed since
(:func:`line_changed`: what the line scored after the proposal, read against the line's scores by the monitor's
tests).

One job runs at a time (one thread: scoring keeps its own), and one per model across every replica (a lock in
PostgreSQL: :meth:`~padim.service.record.store.JobStore.claim_updates`). Its state is a row of the record's
``jobs`` table, so ``GET /jobs/{id}`` answers from the database, on every replica. A job that dies (kill -9) writes no
version: the model file is written into the repository's ``.incoming-*`` folder and renamed in only at the end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import torch

from padim.core.artifact import file_sha256, read_header
from padim.core.calibration import (
    LINE_EXCEEDANCES,
    Calibration,
    CalibrationError,
    checked_rate,
    line_pictures_needed,
)
from padim.core.drift import assess
from padim.core.errors import ArtifactError
from padim.models.config import PadimConfig
from padim.models.errors import (
    LineChanged,
    ModelBusy,
    NothingToUpdate,
    NotUpdatable,
    PadimError,
    TooFewLinePictures,
    UpdateGateFailed,
    UsageError,
    VersionNotFound,
)
from padim.models.fit.learning import Gate, fitted_digests, gate, picture_name, sha256_digest, update_model
from padim.models.fit.model_file import read_calibration, read_int8_calibration, store_calibration
from padim.models.fit.passes import TrainingImage
from padim.models.repository import MODEL_FILE, Repository, Version

from .record.store import Filters, RecordStore

log = logging.getLogger("padim.service")


class UpdateJobs:
    """The update jobs of one service (``state``: its :class:`~padim.service.state.ServiceState`)."""

    def __init__(self, state) -> None:
        self.state = state
        self.running: dict[str, str] = {}  # model -> job id
        self.stopping = threading.Event()  # the service is stopping: a job commits nothing more

    async def start(self, name: str, records: list[str] | None, number: int | None, activate: bool) -> dict:
        """Check what the update would learn (409 when nothing), then start its job; returns the job's row."""
        state = self.state
        repository = state.changes.writable()
        if name in self.running:
            raise ModelBusy(f"an update of {name!r} is running (job {self.running[name]}); one at a time per model")
        if number is None:
            number = repository.active(name)
            if number is None:
                raise VersionNotFound(f"the repository has no model named {name!r}")
        version = await asyncio.to_thread(repository.version, name, number)
        plan = await asyncio.to_thread(self._plan, name, version, records)
        store = state.record.store
        self.running[name] = "starting"
        claim = None
        try:
            claim = await asyncio.to_thread(store.jobs.claim_updates, name)
            if claim is None:
                other = await asyncio.to_thread(store.jobs.running_job, name)
                raise ModelBusy(
                    f"an update of {name!r} is running on another replica"
                    + (f" (job {other['id']})" if other else "")
                    + "; one at a time per model"
                )
            job = await asyncio.to_thread(
                store.jobs.add_job, name, number, {"records": records, "version": number, "activate": activate}
            )
        except BaseException:
            self.running.pop(name, None)
            if claim is not None:
                claim.release()
            raise
        self.running[name] = job["id"]
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(state.updates, self._run, job["id"], name, version, plan)
        task = loop.create_task(self._finish(job["id"], name, future, activate, claim), name=f"update-{name}")
        state.versions.track(task)  # cancelled when the service stops
        return job

    # ---------------------------------------------------------------- what it learns
    def _plan(self, name: str, version, records: list[str] | None) -> dict:
        """The rows to add (reviewed normal, not fitted) and to take out (reviewed defect, fitted)."""
        store = self.state.record.store
        if version.kind == "export":
            raise NotUpdatable(
                f"version {version.version} of {name!r} is an export directory, which holds no "
                "statistics; add the model file it was exported from as a version and update that"
            )
        try:
            if not read_header(version.path).get("has_statistics", False):
                raise NotUpdatable(
                    f"version {version.version} of {name!r} was saved with --slim, without the "
                    "statistics an update extends; train it again without --slim and add it"
                )
            fitted = fitted_digests(version.path)
        except ArtifactError as error:
            raise NotUpdatable(f"version {version.version} of {name!r} cannot be read: {error}") from None
        reviewed_normal = store.labelled(name, "normal")
        if records is not None:
            rows = store.rows(records)
            wrong = [r["id"] for r in rows if r["model"] != name or r["label"] != "normal"]
            if wrong:
                raise UsageError(
                    f"record {wrong[0]} is not a picture of {name!r} reviewed as normal"
                    + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")
                    + "; an update learns only from pictures an operator confirmed normal"
                )
            normals = rows
        else:
            normals = reviewed_normal
        defects = store.labelled(name, "defect")
        pictures = self.state.record.pictures
        add = _unique(r for r in normals if sha256_digest(r["sha256"]) not in fitted and pictures.has(r["sha256"]))
        remove = _unique(r for r in defects if sha256_digest(r["sha256"]) in fitted and pictures.has(r["sha256"]))
        if not add and not remove:
            raise NothingToUpdate(
                f"nothing to update in version {version.version} of {name!r}: no picture reviewed "
                "as normal that it has not fitted, and none reviewed as defect that it fitted"
            )
        held = _unique(
            r
            for r in reviewed_normal
            if pictures.has(r["sha256"])
            and r["sha256"] not in {a["sha256"] for a in add}
            and sha256_digest(r["sha256"]) not in fitted
        )
        return {
            "add": add,
            "remove": remove,
            "defects": [r for r in _unique(defects) if pictures.has(r["sha256"])],
            "held": held,
        }

    # ---------------------------------------------------------------- the job (on the update thread)
    def _run(self, job_id: str, name: str, version, plan: dict) -> dict:
        state = self.state
        store, pictures, repository = state.record.store, state.record.pictures, state.repository
        started = time.time()
        store.jobs.set_job(job_id, state="running", started=started, phase="remove", progress=0.0)
        incoming = repository.incoming(name)
        add, remove = plan["add"], plan["remove"]
        total = max(1, len(add) + len(remove))

        def image(row: dict) -> TrainingImage:
            return TrainingImage(pictures.path(row["sha256"]), picture_name(row["sha256"]))

        def progress(phase: str, done: int, count: int) -> None:
            finished = done + (len(remove) if phase == "add" else 0)
            store.jobs.set_job(job_id, phase=phase, progress=round(0.8 * finished / total, 3))

        try:
            store.pin(r["sha256"] for r in [*add, *remove])  # learned from: never evicted
            output = incoming / MODEL_FILE
            report = update_model(
                version.path,
                [image(r) for r in add],
                [image(r) for r in remove],
                output,
                run_options=PadimConfig(batch_size=8, decode_workers=1, device=state.settings.device),
                on_progress=progress,
            )
            store.jobs.set_job(job_id, phase="gate", progress=0.85)
            checked = gate(
                version.path,
                output,
                [pictures.path(r["sha256"]) for r in plan["defects"]],
                [pictures.path(r["sha256"]) for r in plan["held"]],
                state.settings.update_max_recall_drop,
                device=state.settings.device,
            )
            if self.stopping.is_set():  # the job row says so at the next start: no version was written
                raise RuntimeError("the service is stopping")
            store.jobs.set_job(job_id, phase="commit", progress=0.95)
            learned = [r["id"] for r in add if picture_name(r["sha256"]) in set(report.added)]
            removed = [r["id"] for r in remove if picture_name(r["sha256"]) in set(report.removed)]
            update = {
                "base_version": version.version,
                "job": job_id,
                "learned_from": learned,
                "removed": removed,
                "gate": checked.to_dict(),
                "report": report.to_dict(),
            }
            committed = repository.commit(
                name, incoming, file_sha256(output), f"update of version {version.version}", update
            )
        except BaseException:
            repository.discard(incoming)
            raise
        kept = {k: v for k, v in update.items() if k != "job"}  # base_version, learned_from, removed, gate, report
        return {"version": committed.version, **kept, "seconds": round(time.time() - started, 3)}

    async def _finish(self, job_id: str, name: str, future, activate: bool, claim) -> None:
        """Back on the event loop: activate when asked and the gate passed; the job's final state."""
        state = self.state
        store = state.record.store
        try:
            result = await future
            result["activated"] = False
            if activate and result["gate"]["passed"]:
                await asyncio.to_thread(store.jobs.set_job, job_id, phase="activate", progress=0.97)
                await state.changes.activate(name, result["version"])
                result["activated"] = True
            elif activate:
                result["not_activated"] = "the gate failed: " + result["gate"]["why"]
            outcome = "succeeded" if result["gate"]["passed"] else "gate_failed"
            await asyncio.to_thread(
                store.jobs.set_job,
                job_id,
                state="succeeded",
                phase="done",
                progress=1.0,
                finished=time.time(),
                result=result,
            )
            state.metrics.model_changes.labels(name, "update").inc()
            state.metrics.update_jobs.labels(name, outcome).inc()
            log.info(
                "model updated",
                extra={
                    "model": name,
                    "version": result["version"],
                    "job": job_id,
                    "learned": len(result["learned_from"]),
                    "removed": len(result["removed"]),
                    "gate": result["gate"]["why"],
                },
            )
        except Exception as error:
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            if not isinstance(error, PadimError):
                log.exception("update failed", extra={"model": name, "job": job_id})
            state.metrics.update_jobs.labels(name, "failed").inc()
            try:
                await asyncio.to_thread(store.jobs.set_job, job_id, state="failed", finished=time.time(), error=message)
            except Exception:  # the database is away: the job stays 'running' until the next start says otherwise
                log.error("update: its failure could not be recorded", extra={"job": job_id})
        finally:
            self.running.pop(name, None)
            await asyncio.to_thread(claim.release)


def _unique(rows) -> list[dict]:
    """One row per picture (the latest), in the order given."""
    seen: dict[str, dict] = {}
    for row in rows:
        seen[row["sha256"]] = row
    return list(seen.values())


# ---------------------------------------------------------------------- a threshold sized by the line
#: ``version.json``'s ``update.kind`` of a version whose threshold the line set.
LINE = "line_threshold"


def propose_line_threshold(
    repository: Repository,
    store: RecordStore,
    name: str,
    number: int | None = None,
    false_alarm_rate: float | None = None,
    since: float | None = None,
    max_recall_drop: float = 0.0,
) -> dict:
    """Write a new version of ``name`` (not active): version ``number``'s Gaussians (the active one's by default),
    its threshold set from the line; returns the new version's number and what its ``version.json`` keeps of the
    proposal (``update``: the line's pictures, the thresholds, what it replaces, the promise, the gate).

    The line's normal pictures are every picture the same Gaussians scored (this version, and the versions it was
    tightened from) at or after ``since``, once each, that no review called a defect: unreviewed flagged pictures
    count as normal, so the quantile errs high (fewer false alarms), never low.

    Raises:
        VersionNotFound: no such model or version.
        NotUpdatable: an export directory (no model file to write the threshold into).
        UsageError: no rate (a threshold set by hand, and none given), or one out of range.
        TooFewLinePictures: fewer line pictures than :func:`~padim.core.calibration.line_pictures_needed`.
    """
    version = _model_file_version(repository, name, number)
    number = version.version
    scorers = _same_gaussians(repository, version)
    rows = _pictures(row for v in scorers for row in store.iterate(Filters(model=name, version=v, since=since), 5000))
    scorer, rows, calibration = _scored_by(repository, name, version, scorers, rows)
    normal = [r for r in rows if r["label"] != "defect"]
    rate = _line_rate(calibration.false_alarm_rate if false_alarm_rate is None else false_alarm_rate, name, number)
    _enough(len(normal), rate, f"version {number} of {name!r}" + ("" if since is None else " since then"))
    tightened = calibration.tightened(torch.tensor([r["raw_score"] for r in normal], dtype=torch.float64), rate)
    checked = _recorded_gate(rows, calibration.threshold, tightened.threshold, max_recall_drop)
    config = read_header(version.path).get("config", {})
    update = {
        "kind": LINE,
        "base_version": number,
        "scorer": scorer,
        "proposed": time.time(),
        "line": {"versions": scorers, "since": since, **_line_summary(normal)},
        "threshold": {"old": calibration.threshold, "new": tightened.threshold},
        "replaces": {
            **{k: calibration.summary()[k] for k in ("method", "threshold", "promised_false_alarm_rate")},
            "expect": config.get("expect"),
            "fit_changes": config.get("fit_changes"),
        },
        "calibration": {
            k: tightened.summary()[k]
            for k in ("false_alarm_rate", "promised_false_alarm_rate", "false_alarm_bound", "confidence", "line_scores")
        },
        "gate": checked.to_dict(),
    }
    committed = _committed(repository, name, version, tightened, update, scorer)
    log.info(
        "line threshold proposed",
        extra={"model": name, "version": committed.version, "base_version": number, "pictures": len(normal)},
    )
    return {"version": committed.version, **update}


def _scored_by(
    repository: Repository, name: str, version: Version, numbers: list[int], rows: list[dict]
) -> tuple[str, list[dict], Calibration]:
    """Which of the model file's scorers scored the line's pictures, their rows, and that scorer's calibration in
    ``version``: ``int8`` (a float32 model's int8 scorer, which ``--runtime auto`` runs on a CPU with int8
    arithmetic: :mod:`padim.models.scoring.reduced`) where it scored most of them and ``version`` has one, else
    ``float32``."""
    parts = _by_scorer(repository, name, numbers, rows)
    int8 = read_int8_calibration(version.path)
    if int8 is not None and len(parts["int8"]) > len(parts["float32"]):
        return "int8", parts["int8"], int8
    return "float32", parts["float32"], read_calibration(version.path)


def _by_scorer(repository: Repository, name: str, numbers: list[int], rows: list[dict]) -> dict[str, list[dict]]:
    """``rows`` of versions ``numbers`` by the scorer of their model file that scored them (``float32``, ``int8``).
    A row's recorded raw threshold is its scorer's threshold at the row's own (0..1) one, so it says which scored
    it; a row without one, or of a version removed since, is float32's."""
    int8 = {}
    for number in numbers:
        try:
            found = repository.version(name, number)
        except VersionNotFound:  # removed since: its rows are taken as float32's
            continue
        if found.kind != "export":
            int8[number] = read_int8_calibration(found.path)

    def by_int8(row: dict) -> bool:
        calibration, raw = int8.get(int(row["version"])), row.get("raw_threshold")
        if calibration is None or raw is None:
            return False
        return math.isclose(calibration.raw_threshold(float(row["threshold"])), float(raw), rel_tol=1e-9)

    parts: dict[str, list[dict]] = {"float32": [], "int8": []}
    for row in rows:
        parts["int8" if by_int8(row) else "float32"].append(row)
    return parts


def _committed(
    repository: Repository, name: str, version: Version, calibration, update: dict, scorer: str = "float32"
) -> Version:
    """The next version of ``name``: ``version``'s file with ``calibration`` (``scorer``'s), and ``update`` in its
    version.json."""
    incoming = repository.incoming(name)
    try:
        output = incoming / MODEL_FILE
        store_calibration(version.path, calibration, output, scorer=scorer)
        return repository.commit(
            name, incoming, file_sha256(output), f"line threshold of version {version.version}", update
        )
    except BaseException:
        repository.discard(incoming)
        raise


def _model_file_version(repository: Repository, name: str, number: int | None) -> Version:
    """Version ``number`` of ``name`` (the active one when ``None``), refused when it is an export directory."""
    if number is None:
        number = repository.active(name)
        if number is None:
            raise VersionNotFound(f"the repository has no model named {name!r}")
    version = repository.version(name, number)
    if version.kind == "export":
        raise NotUpdatable(
            f"version {number} of {name!r} is an export directory; add the model file it was exported from as a "
            "version and tighten that (then export it again)"
        )
    return version


def _line_rate(rate: float | None, name: str, number: int) -> float:
    """The false-alarm rate to promise on the line, checked (what was asked, not what was fitted: a UsageError)."""
    if rate is None:
        raise UsageError(f"version {number} of {name!r} has a threshold set by hand: give the false-alarm rate")
    try:
        checked_rate(rate)
    except CalibrationError as error:
        raise UsageError(str(error)) from None
    return rate


def _enough(pictures: int, rate: float, scored_by: str) -> None:
    """Refuse fewer line pictures than a threshold for ``rate`` by their own quantile needs."""
    needed = line_pictures_needed(rate)
    if pictures < needed:
        raise TooFewLinePictures(
            f"the line has {pictures} normal picture(s) scored by {scored_by}; {needed} are needed to set a threshold "
            f"for {rate:.2%} false alarms by their own quantile ({LINE_EXCEEDANCES} of them above it)"
        )


def _line_summary(normal: list[dict]) -> dict:
    """The line's normal pictures, in ``version.json``: how many, how many reviewed, the first and the last."""
    return {
        "pictures": len(normal),
        "reviewed_normal": sum(r["label"] == "normal" for r in normal),
        "first": min(r["time"] for r in normal),
        "last": max(r["time"] for r in normal),
    }


def line_changed(
    store: RecordStore, version: Version, level: float, min_images: int, repository: Repository
) -> str | None:
    """Why a version whose threshold the line set no longer fits the line, or ``None`` (also for other versions).

    What the same Gaussians scored after the proposal (reviewed defects left out) is read against the line's scores
    with the monitor's tests (flag rate at the line's threshold and bound, one-sided KS of the scores); an alarm
    means the line moved since, and the threshold sized by it is stale.
    """
    update = version.update or {}
    if update.get("kind") != LINE:
        return None
    scorer = update.get("scorer", "float32")  # whose threshold the line set (the int8 scorer's: models/scoring)
    calibration = read_calibration(version.path) if scorer == "float32" else read_int8_calibration(version.path)
    if calibration is None:
        return None
    line = update["line"]
    numbers = [version.version, *line["versions"]]  # once active, it scores with the same Gaussians too
    rows = _pictures(
        row
        for v in numbers
        for row in store.iterate(Filters(model=version.name, version=v, since=line["last"]), 5000)
        if row["time"] > line["last"]
    )
    rows = _by_scorer(repository, version.name, numbers, rows)[scorer]
    recent = torch.tensor([r["raw_score"] for r in rows if r["label"] != "defect"], dtype=torch.float64)
    drift = assess(recent, calibration, None, level, min_images)
    if drift.status != "alarm":
        return None
    said = []
    if drift.flag_rate is not None and drift.flag_rate.alarm:
        flags = drift.flag_rate
        said.append(
            f"{flags.flags} flagged ({flags.rate:.1%}) where the line's threshold promised at most "
            f"{flags.normal_rate:.1%} (p = {flags.p_value:.2g})"
        )
    if drift.score_drift is not None and drift.score_drift.alarm:
        shift = drift.score_drift
        said.append(
            f"scores higher than the line's (KS D+ {shift.statistic:.2f}, p = {shift.p_value:.2g}, median "
            f"x{shift.median_ratio:.2f})"
        )
    return f"{drift.images} pictures scored since the proposal: " + "; ".join(said)


def activation_refused(version: Version, stale: str | None) -> PadimError | None:
    """Why activating ``version`` is refused unless forced, or ``None``: its update's gate failed, or the line changed
    since the line set its threshold (``stale``: :func:`line_changed`'s reason). The service and ``padim repository
    activate`` refuse alike."""
    gate = (version.update or {}).get("gate") or {}
    name, number = version.name, version.version
    if gate.get("passed") is False:
        return UpdateGateFailed(
            f"version {number} of {name!r} failed its update's gate: {gate.get('why')}; activate it with force=true "
            "(padim repository activate --force) to override (it is kept in its version.json)"
        )
    if stale is not None:
        return LineChanged(
            f"version {number} of {name!r} has a threshold the line set, and the line has changed since: {stale}; "
            "propose it again from the line as it is now (since, --since), or activate it with force=true (--force)"
        )
    return None


def _pictures(rows) -> list[dict]:
    """One row per picture (the newest given first wins), labelled ``defect`` where any review of it said so, else
    ``normal`` where any did: a picture scored twice counts once, as its reviews say."""
    seen: dict[str, dict] = {}
    for row in rows:
        kept = seen.setdefault(row["sha256"], dict(row))
        if row["label"] == "defect" or (row["label"] == "normal" and kept["label"] is None):
            kept["label"] = row["label"]
    return list(seen.values())


def _same_gaussians(repository: Repository, version: Version) -> list[int]:
    """This version and those it was tightened from, whose pictures' raw scores are this version's."""
    numbers = [version.version]
    update = version.update or {}
    while update.get("kind") == LINE:
        try:
            base = repository.version(version.name, int(update["base_version"]))
        except VersionNotFound:  # removed since: its rows stay in the record under its number
            numbers.append(int(update["base_version"]))
            break
        numbers.append(base.version)
        update = base.update or {}
    return numbers


def _recorded_gate(rows: list[dict], old: float, new: float, max_recall_drop: float) -> Gate:
    """The update gate from recorded raw scores: reviewed defects caught and reviewed normals flagged, at each
    threshold."""
    defects = [r["raw_score"] for r in rows if r["label"] == "defect"]
    normals = [r["raw_score"] for r in rows if r["label"] == "normal"]
    return Gate(
        len(defects),
        len(normals),
        sum(s >= old for s in defects),
        sum(s >= new for s in defects),
        sum(s >= old for s in normals),
        sum(s >= new for s in normals),
        max_recall_drop,
    )
