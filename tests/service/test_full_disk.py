"""A full disk under a real service and a real fit: a tmpfs of a few MiB (tests/helpers.py ``small_disk``, as root)
filled to the last byte with a file, then freed. Each test counts what was answered, kept, refused and delivered:
what was accepted is never lost, what cannot be kept is refused saying why (and counted), the previous state keeps
serving, and the service comes back by itself once there is space again."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from helpers import IMAGE_SIZE, Receiver, metric, run_cli, running_server, small_disk, wait_until

pytestmark = pytest.mark.tmpfs

PNG = {"content-type": "image/png"}
MIB = 2**20


def pictures(dataset, count: int) -> list[bytes]:
    """``count`` pictures of distinct content: each one's bytes are stored anew by the record."""
    found = sorted(dataset.glob("train/good/*.png"))
    assert len(found) >= count
    return [path.read_bytes() for path in found[:count]]


def storage(url: str) -> dict:
    return httpx.get(url + "/records/storage", timeout=10).json()


@pytest.mark.parametrize("required", [False, True], ids=["answers first", "PADIM_RECORD_REQUIRED"])
def test_the_record_on_a_full_disk_refuses_rows_saying_why_and_comes_back_by_itself(
    model_file, dataset, tmp_path, required
):
    sent = pictures(dataset, 14)
    with small_disk(tmp_path / "disk", 8 * MIB) as disk:
        env = {"PADIM_RECORD_DIR": str(disk.path / "record"), "PADIM_RUNTIME": "torch"}
        if required:
            env["PADIM_RECORD_REQUIRED"] = "true"
        with running_server(tmp_path, [model_file], env=env) as server:
            url = server.url

            def score(data: bytes) -> httpx.Response:
                return httpx.post(url + "/score", content=data, headers=PNG, timeout=60)

            before = [score(data) for data in sent[:4]]
            assert all(a.status_code == 200 for a in before), before[0].text
            wait_until(lambda: storage(url)["rows"] == 4 and storage(url)["rows_waiting"] == 0, 60, "4 rows")

            def outcomes() -> tuple[float, float]:
                return tuple(metric(url, "padim_record_rows_total", outcome=o) for o in ("journaled", "refused"))

            disk.fill()
            # new pictures (their bytes are stored first) and pictures seen before (their rows go to the journal alone)
            # answering first, a verdict leaves before its row is journaled: each count is read once every row sent
            # has its outcome, or it is short (and the database's count steps past it)
            during = [score(data) for data in [*sent[4:10], *sent[:3]]]
            wait_until(lambda: sum(outcomes()) == len(before) + len(during), 60, "the rows sent on a full disk")
            refused = outcomes()[1]
            disk.free()
            after = [score(data) for data in sent[10:]]
            wait_until(lambda: sum(outcomes()) == len(sent) + 3, 60, "every row journaled or refused")
            journaled, refused_after = outcomes()
            assert refused_after == refused  # nothing refused once there is space again
            wait_until(
                lambda: storage(url)["rows"] == journaled and storage(url)["rows_waiting"] == 0,
                60,
                "the rows journaled to reach the database, with no restart",
            )
            answered = [a for a in during if a.status_code == 200 and required]
            kept = [a.json()["record_id"] for a in before + after + answered]
            found = [httpx.get(url + f"/records/{i}", timeout=10).status_code for i in kept]
            running = server.process.poll() is None  # the same process throughout: no restart
            logs = server.logs()
        assert running
    assert all(a.status_code == 200 for a in after), after[0].text
    assert found == [200] * len(kept)  # every row accepted (and, required, every answer's) is in the database
    assert refused >= 6 and refused + journaled == len(sent) + 3
    if required:  # no verdict without its row: refused, saying why
        # a new picture's bytes find no room; a row alone may still fit in the journal's last page
        assert all(a.status_code == 503 for a in during[:6]), [a.status_code for a in during]
        assert {a.status_code for a in during} <= {200, 503}
        error = during[0].json()["error"]
        assert error["code"] == "record_unavailable" and "No space left on device" in error["message"], error
        assert journaled == len(before) + len(after) + len(answered)  # every answer has its row
    else:  # the service answers throughout; what the record could not keep is counted as refused
        assert all(a.status_code == 200 for a in during), during[0].text
    assert "unreadable row" not in logs  # what a failed write began is cut off again, not left to be skipped


def test_a_line_on_a_full_disk_keeps_every_verdict_and_delivers_each_once_when_space_is_back(
    model_file, dataset, tmp_path
):
    """The line's journal and outboxes on the small disk, its hot folder on another. Verdicts already in an outbox
    are delivered while the disk is full (taken out of it once it can be written: none sent twice); a new picture,
    whose verdict the journal cannot take, waits in its folder, the line paused saying why; freed, every picture
    gets its verdict once, with no restart."""
    sent = pictures(dataset, 8)
    incoming = tmp_path / "in"
    incoming.mkdir()
    receiver = Receiver()
    with small_disk(tmp_path / "disk", 4 * MIB) as disk:
        lines = tmp_path / "lines.yaml"
        lines.write_text(
            f"""
state_dir: {disk.path / "lines"}
lines:
  - name: press
    source: {{type: folder, path: {incoming}, settle_s: 0.2, poll_s: 0.1}}
    sinks:
      - {{type: webhook, url: "{receiver.url}"}}
"""
        )

        def drop(first: int, stop: int) -> None:
            for i in range(first, stop):
                (incoming / f"part-{i}.png").write_bytes(sent[i])

        try:
            with running_server(tmp_path, [model_file], env={"PADIM_LINES": str(lines)}) as server:

                def line() -> dict:
                    return httpx.get(server.url + "/lines", timeout=10).json()["lines"][0]

                drop(0, 3)
                wait_until(lambda: len(receiver.bodies) == 3, 60, "the first verdicts")
                receiver.refusing = True  # the sink is down: the next verdicts wait in its outbox
                drop(3, 5)
                wait_until(lambda: line()["sinks"][0]["outbox"] == 2, 60, "two verdicts in the outbox")
                disk.fill()
                receiver.refusing = False
                drop(5, 8)
                wait_until(lambda: line()["counts"]["deferred"] >= 1, 60, "a picture deferred")
                paused = line()["paused"]
                waiting = sorted(p.name for p in incoming.glob("part-*.png"))
                disk.free()
                wait_until(lambda: len(receiver.bodies) >= 8, 60, "every verdict, once there is space")
                time.sleep(2.0)  # a second delivery, were there one, would come now
                after = line()
                deferred = metric(server.url, "padim_line_pictures_total", line="press", outcome="deferred")
                running = server.process.poll() is None
        finally:
            receiver.server.shutdown()
    assert running
    assert paused is not None and "journal cannot be written" in paused and "disk is full" in paused, paused
    assert waiting == [f"part-{i}.png" for i in range(5, 8)]  # unscored, in their folder
    delivered = sorted(b["source"] for b in receiver.bodies)
    assert delivered == [f"part-{i}.png" for i in range(8)], delivered  # each once
    assert after["paused"] is None and after["sinks"][0]["outbox"] == 0
    assert deferred >= 1 and after["counts"]["scored"] >= 8
    assert not list(incoming.glob("part-*.png"))  # each moved to done/ or flagged/ once journaled
    assert len(list(incoming.glob("done/*.png")) + list(incoming.glob("flagged/*.png"))) == 8


def test_a_version_uploaded_onto_a_full_disk_is_refused_whole_and_the_active_one_keeps_serving(
    model_file, second_model, dataset, tmp_path
):
    """A model repository on the small disk: an upload that finds no room is refused with 507, leaves no version
    (nothing half-written to list or activate) and no partial file; the active version answers throughout; freed,
    the same upload lands and is activated."""
    from padim.models.repository import Repository

    admin = {"x-api-key": "admin-key-333"}
    body = second_model.read_bytes()
    with small_disk(tmp_path / "disk", 3 * model_file.stat().st_size + 4 * MIB) as disk:
        root = disk.path / "repo"
        repository = Repository(root)
        repository.activate("weave", repository.add("weave", model_file).version)
        env = {"PADIM_ADMIN_KEY": admin["x-api-key"], "PADIM_RUNTIME": "torch"}
        with running_server(tmp_path, [], env=env, args=("--repository", str(root), "--device", "cpu")) as server:

            def score() -> httpx.Response:
                return httpx.post(server.url + "/score", content=sent, headers=PNG, timeout=60)

            def upload() -> httpx.Response:
                return httpx.post(
                    server.url + "/models/weave/versions",
                    params={"activate": "true"},
                    content=body,
                    headers={**admin, "content-type": "application/octet-stream"},
                    timeout=120,
                )

            sent = pictures(dataset, 1)[0]
            assert score().json()["model"]["version"] == 1
            disk.fill()
            refused = upload()
            versions = httpx.get(server.url + "/models/weave/versions", headers=admin, timeout=10).json()
            left = sorted(p.name for p in (root / "weave").iterdir())
            while_full = score()
            disk.free()
            landed = upload()
            after = score()
            running = server.process.poll() is None
    assert refused.status_code == 507, refused.text
    error = refused.json()["error"]
    assert error["code"] == "insufficient_storage" and "disk is full" in error["message"], error
    assert [v["version"] for v in versions["versions"]] == [1]
    assert not [n for n in left if n.startswith(".incoming-") or n.endswith(".tmp")], left  # nothing half-written
    assert while_full.status_code == 200 and while_full.json()["model"]["version"] == 1
    assert landed.status_code == 201 and landed.json()["version"] == 2 and landed.json()["active"], landed.text
    assert after.json()["model"]["version"] == 2 and running


def test_a_fit_onto_a_full_disk_fails_saying_so_leaves_nothing_and_runs_once_there_is_room(dataset, tmp_path):
    """``padim train`` with its output (and so the factors' scratch file) on the small disk: full, it stops before
    reading a picture; with room for the factors and not for the model file beside them, it stops when the file
    cannot be written. Either way with the usage exit code and the reason, no traceback, and neither a model file
    nor a part of one left; the same command, once there is room, makes the model."""

    def train(output: Path):
        command = ("-q", "train", dataset / "train" / "good", "--output", output, "--weights", "random")
        return run_cli(*command, "--image-size", IMAGE_SIZE, "--batch-size", 8, check=False)

    with small_disk(tmp_path / "disk", 32 * MIB) as disk:
        output = disk.path / "models" / "weave.padim"
        disk.fill()
        full = train(output)
        disk.free()
        disk.fill(leave=6 * MIB)  # the float32 factors (4.9 MiB) fit; the model file beside them does not
        late = train(output)
        left = sorted(p.name for p in disk.path.rglob("*") if p.name != ".filler")
        disk.free()
        made = train(output)
        kept = output.is_file()
    assert full.returncode == 1 and "MiB free, and the fit's precision factors need" in full.stderr, full.stderr
    assert late.returncode == 1 and "the disk is full" in late.stderr and "No space left" in late.stderr, late.stderr
    assert "Traceback" not in full.stderr + late.stderr
    assert left == ["models"], left
    assert made.returncode == 0, made.stderr
    assert kept
