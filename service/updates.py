"""Model updates from the record's reviews (``POST /models/{name}/update``), run as jobs beside scoring.

A job takes a version of a model (the active one by default) and writes a **new version**, not active:

1. pictures reviewed as *defect* that the version fitted (an earlier review said normal, wrongly) are taken
   out of its statistics and calibration, exactly; pictures reviewed as *normal* that it has not fitted are
   added, as ``train --resume`` adds them (:func:`padim.models.fit.learning.update_model`);
2. the **gate** scores every reviewed defect, and the reviewed normal pictures the new version did not fit,
   with the old and the new version (:func:`padim.models.fit.learning.gate`);
3. the new version is committed to the repository with what it learned (record ids), its gate and its job,
   and activated when asked and the gate passed.

One job runs at a time (one thread: scoring keeps its own), and one per model across every replica (a lock in
PostgreSQL: :meth:`~padim.service.record.store.JobStore.claim_updates`). Its state is a row of the record's
``jobs`` table, so ``GET /jobs/{id}`` answers from the database, on every replica. A job that dies (kill -9) writes no
version: the model file is written into the repository's ``.incoming-*`` folder and renamed in only at the end.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from padim.core.artifact import file_sha256, read_header
from padim.core.errors import ArtifactError
from padim.models.config import PadimConfig
from padim.models.errors import ModelBusy, NothingToUpdate, NotUpdatable, PadimError, UsageError, VersionNotFound
from padim.models.fit.learning import fitted_digests, gate, picture_name, sha256_digest, update_model
from padim.models.fit.passes import TrainingImage
from padim.models.repository import MODEL_FILE

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
                run_options=PadimConfig(batch_size=8, workers=1, device=state.settings.device),
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
        return {
            "version": committed.version,
            "base_version": version.version,
            "learned_from": learned,
            "removed": removed,
            "gate": checked.to_dict(),
            "report": report.to_dict(),
            "seconds": round(time.time() - started, 3),
        }

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
