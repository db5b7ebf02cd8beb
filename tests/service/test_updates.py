"""The loop on a real server: a lamp changes, an operator reviews its false alarms as normal, an update learns
them into a new version that (once activated) no longer flags that light; a wrong review is undone; the gate
holds back a version that loses recall; a job killed midway writes nothing."""

import json
import math
import signal
import time

import httpx
import pytest
from helpers import normal_and_shifted, run_cli, running_server

ADMIN, REVIEW = "admin-key-333", "review-key-22"
admin, review = {"X-API-Key": ADMIN}, {"X-API-Key": REVIEW}


@pytest.fixture
def line(model_file, tmp_path):
    """A repository with the session's model as version 1, served with the record on and keys."""
    repository = tmp_path / "repository"
    run_cli("repository", "add", repository, "weave", model_file, "--activate")
    env = {
        "PADIM_ADMIN_KEY": ADMIN,
        "PADIM_REVIEW_KEY": REVIEW,
        "PADIM_RUNTIME": "torch",
        "PADIM_RECORD_DIR": str(tmp_path / "record"),
    }
    return repository, env, ("--repository", str(repository), "--device", "cpu")


def score_all(url: str, paths) -> list[dict]:
    """Each picture's answer, eight a request, with its part number in the record."""
    answers = []
    for first in range(0, len(paths), 8):
        chunk = paths[first : first + 8]
        answer = httpx.post(
            url + "/score/batch",
            timeout=60,
            headers=admin,
            files=[("file", (p.name, p.read_bytes(), "image/png")) for p in chunk],
            data={"fields": json.dumps([{"part": p.stem} for p in chunk])},
        )
        assert answer.status_code == 200, answer.text
        answers += answer.json()["results"]
    return answers


def wait_rows(url: str, rows: int) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        report = httpx.get(url + "/records/storage", headers=admin).json()
        if report["rows"] >= rows and report["rows_waiting"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"rows not recorded: {report}")


def label(url: str, answers, value: str, **more) -> None:
    for answer in answers:
        said = httpx.post(f"{url}/records/{answer['record_id']}/review", json={"label": value, **more}, headers=review)
        assert said.status_code == 200, said.text


def run_update(url: str, body: dict | None = None, **params) -> dict:
    started = httpx.post(url + "/models/weave/update", json=body, params=params, headers=admin, timeout=30)
    assert started.status_code == 202, started.text
    deadline = time.time() + 120
    while time.time() < deadline:
        job = httpx.get(f"{url}/jobs/{started.json()['id']}", headers=admin).json()
        if job["state"] in ("succeeded", "failed"):
            assert job["state"] == "succeeded", job
            return job
        time.sleep(0.2)
    raise AssertionError(f"the update did not finish: {job}")


def flags(answers) -> int:
    return sum(a["is_anomaly"] for a in answers)


def test_false_alarms_reviewed_as_normal_are_learned_into_a_version_that_no_longer_flags_them(line, dataset, tmp_path):
    repository, env, args = line
    _, shifted = normal_and_shifted(tmp_path / "pictures", 100)
    defects = sorted(p for p in dataset.glob("test/*/*.png") if p.parent.name != "good")
    with running_server(tmp_path, [], env=env, args=args) as server:
        before = score_all(server.url, shifted)
        seen_defects = score_all(server.url, defects)
        wait_rows(server.url, len(before) + len(seen_defects))
        assert flags(before) >= 50  # the new lamp: most normal pictures are false alarms
        reviewed = [a for a in before[:60] if a["is_anomaly"]][:40]
        assert len(reviewed) == 40
        label(server.url, reviewed, "normal", reviewer="ana", note="new lamp")
        label(server.url, seen_defects, "defect", defect_type="synthetic")

        job = run_update(server.url)
        result = job["result"]
        assert result["version"] == 2 and not result["activated"] and result["base_version"] == 1
        assert sorted(result["learned_from"]) == sorted(a["record_id"] for a in reviewed) and result["removed"] == []
        gate = result["gate"]
        assert gate["defects"] == len(defects) and gate["passed"]
        assert gate["caught_old"] == flags(seen_defects)  # the same pictures, the same version: the same verdicts
        versions = httpx.get(server.url + "/models/weave/versions", headers=admin).json()["versions"]
        assert [v["active"] for v in versions] == [True, False] and versions[1]["update"]["learned_from"]
        assert versions[1]["update"]["gate"] == gate and versions[1]["source"] == "update of version 1"
        assert versions[1]["calibration"]["scores"] == versions[0]["calibration"]["scores"] + 40

        others_before = before[60:]
        still = score_all(server.url, shifted[60:])
        assert flags(still) == flags(others_before)  # nothing changes before the activation
        activated = httpx.post(server.url + "/models/weave/versions/2/activate", headers=admin, timeout=120)
        assert activated.status_code == 200, activated.text
        after = score_all(server.url, shifted[60:])
        assert all(a["record_id"] for a in after)
        assert flags(after) <= flags(others_before) / 3 and flags(after) <= 0.15 * len(after), (
            flags(others_before),
            flags(after),
        )
        wait_rows(server.url, len(before) + len(seen_defects) + 2 * len(still))
        rows = httpx.get(server.url + "/records", params={"version": 2, "limit": 500}, headers=admin).json()["records"]
        assert len(rows) == len(after)  # every step on the record: answers of version 2 name it

        # a heat map is drawn again by the version that scored the picture: version 1, retired, read from the
        # repository; once that version is deleted, the row and the picture stay and the heat map is 410
        first = f"{server.url}/records/{before[0]['record_id']}"
        assert httpx.get(first + "/heatmap", headers=admin, timeout=60).content.startswith(b"\x89PNG")
        assert httpx.delete(server.url + "/models/weave/versions/1", headers=admin).status_code == 204
        gone = httpx.get(first + "/heatmap", headers=admin)
        assert gone.status_code == 410 and "deleted" in gone.json()["error"]["message"]
        assert httpx.get(first + "/image", headers=admin).content == shifted[0].read_bytes()

        # a wrong review: one of the 40 was a defect after all; the update takes it out of statistics and calibration
        wrong = reviewed[7]
        label(server.url, [wrong], "defect", note="looked again: a faint stain")
        undo = run_update(server.url)["result"]
        assert undo["removed"] == [wrong["record_id"]] and undo["learned_from"] == []
        assert undo["version"] == 3 and undo["report"]["scores_removed"] == 1
        assert undo["report"]["fit_image_count"] == result["report"]["fit_image_count"] - 1
        record = httpx.get(f"{server.url}/records/{wrong['record_id']}", headers=admin).json()
        assert [r["label"] for r in record["reviews"]] == ["normal", "defect"] and record["picture_pinned"]

        # version 3 has learned every review (the active version 2 still holds the wrong picture)
        nothing = httpx.post(server.url + "/models/weave/update", json={"version": 3}, headers=admin)
        assert nothing.status_code == 409 and nothing.json()["error"]["code"] == "nothing_to_update"
        not_normal = httpx.post(
            server.url + "/models/weave/update", json={"records": [wrong["record_id"]]}, headers=admin
        )
        assert not_normal.status_code == 422 and "reviewed as normal" in not_normal.json()["error"]["message"]
        unknown = httpx.post(server.url + "/models/weave/update", json={"records": ["f" * 32]}, headers=admin)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "record_not_found"
        assert httpx.post(server.url + "/models/nothing/update", headers=admin).status_code == 404
        assert httpx.post(server.url + "/models/weave/update", headers=review).status_code == 401
        assert httpx.get(f"{server.url}/jobs/{'0' * 32}", headers=admin).status_code == 404

        slim = tmp_path / "slim.padim"
        run_cli(
            "-q",
            "train",
            dataset / "train" / "good",
            "--output",
            slim,
            "--weights",
            "random",
            "--image-size",
            64,
            "--batch-size",
            8,
            "--slim",
        )
        added = json.loads(run_cli("repository", "add", repository, "weave", slim).stdout)
        refused = httpx.post(server.url + "/models/weave/update", json={"version": added["version"]}, headers=admin)
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "not_updatable"
        assert "--slim" in refused.json()["error"]["message"]


def test_a_threshold_sized_by_the_line_is_proposed_activated_and_refused_once_the_line_has_moved(
    line, dataset, tmp_path
):
    """The record's scores of the line's normal pictures set a new version's threshold (their conformal quantile,
    recomputed here from the answers); it serves once activated; once the line moves (another lamp), a proposal made
    before is refused (409 line_changed) unless forced. The same offline with ``padim repository``."""
    repository, env, args = line
    normal, shifted = normal_and_shifted(tmp_path / "pictures", 110)
    defects = sorted(p for p in dataset.glob("test/*/*.png") if p.parent.name != "good")
    five = {"false_alarm_rate": 0.05}
    with running_server(tmp_path, [], env=env, args=args) as server:
        url = server.url
        first = score_all(url, normal[:60])
        wait_rows(url, 60)
        early = httpx.post(url + "/models/weave/threshold", headers=admin, timeout=60)  # the model's 1%
        assert early.status_code == 409 and early.json()["error"]["code"] == "too_few_line_pictures", early.text
        assert "60 normal picture(s)" in early.text and "499 are needed" in early.text
        rest = score_all(url, normal[60:])
        seen_defects = score_all(url, defects)
        wait_rows(url, 110 + len(defects))
        label(url, seen_defects, "defect")
        label(url, rest[:5], "normal")
        old = httpx.get(url + "/models/weave/versions", headers=admin).json()["versions"][0]["calibration"]

        proposed = httpx.post(url + "/models/weave/threshold", json=five, headers=admin, timeout=60)
        assert proposed.status_code == 201, proposed.text
        body = proposed.json()
        raw = sorted(a["raw_score"] for a in first + rest)  # the defects are reviewed as such: left out
        rank = math.ceil(111 * 0.95)
        assert body["threshold"] == {"old": old["threshold"], "new": pytest.approx(raw[rank - 1], rel=1e-12)}
        assert body["threshold"]["new"] < old["threshold"]  # a steady line: tighter than the cover's
        assert body["version"] == 2 and body["base_version"] == 1 and body["line"]["versions"] == [1]
        assert body["line"]["pictures"] == 110 and body["line"]["reviewed_normal"] == 5
        assert body["replaces"]["method"] == old["method"] and body["replaces"]["threshold"] == old["threshold"]
        assert body["calibration"]["line_scores"] == 110
        assert body["calibration"]["promised_false_alarm_rate"] == pytest.approx((111 - rank) / 111)
        gate = body["gate"]
        assert gate["defects"] == len(defects) and gate["caught_old"] == flags(seen_defects)
        assert gate["caught_new"] == sum(a["raw_score"] >= body["threshold"]["new"] for a in seen_defects)
        assert gate["normals"] == 5 and gate["passed"]
        versions = httpx.get(url + "/models/weave/versions", headers=admin).json()["versions"]
        assert [v["active"] for v in versions] == [True, False] and versions[1]["calibration"]["method"] == "line"
        assert (
            versions[1]["source"] == "line threshold of version 1" and versions[1]["update"]["kind"] == "line_threshold"
        )

        activated = httpx.post(url + "/models/weave/versions/2/activate", headers=admin, timeout=120)
        assert activated.status_code == 200, activated.text
        served = score_all(url, normal[:8])
        assert [a["raw_threshold"] for a in served] == pytest.approx([body["threshold"]["new"]] * 8, rel=1e-9)
        assert [a["raw_score"] for a in served] == pytest.approx([a["raw_score"] for a in first[:8]], rel=1e-5)

        # proposed again from version 2 (its rows and version 1's: the same Gaussians); then the lamp changes
        wait_rows(url, 110 + len(defects) + 8)  # the 8 just scored are in the record: read by the proposal
        again = httpx.post(url + "/models/weave/threshold", json=five, headers=admin, timeout=60).json()
        assert again["version"] == 3 and again["line"]["versions"] == [2, 1] and again["line"]["pictures"] == 110
        moved = score_all(url, shifted[:40])
        wait_rows(url, 110 + len(defects) + 8 + 40)
        refused = httpx.post(url + "/models/weave/versions/3/activate", headers=admin, timeout=120)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "line_changed", refused.text
        assert "40 pictures scored since the proposal" in refused.json()["error"]["message"], refused.text
        assert flags(moved) >= 10
        forced = httpx.post(
            url + "/models/weave/versions/3/activate", params={"force": True}, headers=admin, timeout=120
        )
        assert forced.status_code == 200, forced.text
        third = httpx.get(url + "/models/weave/versions", headers=admin).json()["versions"][2]
        assert third["active"] and "40 pictures" in third["update"]["forced"][0]["gate"]
        metrics = httpx.get(url + "/metrics", headers=admin).text
        assert 'padim_model_changes_total{change="line_threshold",model="weave"} 2.0' in metrics

    # offline, as padim repository: the same proposal from the same rows; activation reads the line since
    record = ["--record", tmp_path / "record"]
    tighten = ("repository", "threshold", repository, "weave", "--version", "1", *record)
    offline = json.loads(run_cli(*tighten, "--false-alarm-rate", "0.08").stdout)
    assert offline["version"] == 4 and offline["line"]["pictures"] == 110 and offline["line"]["versions"] == [1]
    ranked = sorted(a["raw_score"] for a in first + rest)[math.ceil(111 * 0.92) - 1]
    assert offline["threshold"]["new"] == pytest.approx(ranked, rel=1e-12)
    mine = run_cli(*tighten, check=False)  # the version's own rate, 1%: 499 pictures
    assert mine.returncode == 1 and "110 normal picture(s)" in mine.stderr and "499 are needed" in mine.stderr
    assert json.loads(run_cli("repository", "activate", repository, "weave", "4", *record).stdout)["active"]
    stale = run_cli("repository", "activate", repository, "weave", "2", check=False)
    assert stale.returncode == 1 and "pass --record" in stale.stderr
    stale = run_cli("repository", "activate", repository, "weave", "2", *record, check=False)
    assert stale.returncode == 1 and "the line has changed since" in stale.stderr, stale.stderr
    few = run_cli(*tighten, "--since", "2100-01-01", check=False)
    assert few.returncode == 1 and "0 normal picture(s)" in few.stderr and "since then" in few.stderr


def test_the_gate_holds_back_a_version_that_loses_recall(line, tmp_path):
    repository, env, args = line
    _, shifted = normal_and_shifted(tmp_path / "pictures", 50)
    with running_server(tmp_path, [], env=env, args=args) as server:
        answers = score_all(server.url, shifted)
        wait_rows(server.url, len(answers))
        flagged = [a for a in answers if a["is_anomaly"]]
        assert len(flagged) >= 30
        # two operators disagree: one calls this light a defect, the other says it is normal
        label(server.url, flagged[:10], "defect")
        label(server.url, flagged[10:], "normal")
        result = run_update(server.url, activate="true")["result"]
        gate = result["gate"]
        assert not gate["passed"] and gate["caught_old"] == 10 and gate["caught_new"] < 9
        assert not result["activated"] and "gate failed" in result["not_activated"]
        refused = httpx.post(server.url + "/models/weave/versions/2/activate", headers=admin)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "update_gate_failed"
        forced = httpx.post(
            server.url + "/models/weave/versions/2/activate", params={"force": "true"}, headers=admin, timeout=120
        )
        assert forced.status_code == 200 and forced.json()["active"]
        version = json.loads((repository / "weave" / "2" / "version.json").read_text())
        assert version["update"]["forced"][0]["gate"] == gate["why"]


@pytest.mark.load_sensitive
def test_a_job_killed_midway_writes_no_version(line, tmp_path):
    repository, env, args = line
    _, shifted = normal_and_shifted(tmp_path / "pictures", 48)
    with running_server(tmp_path, [], env=env, args=args) as server:
        answers = score_all(server.url, shifted)
        wait_rows(server.url, len(answers))
        label(server.url, answers, "normal")
        started = httpx.post(server.url + "/models/weave/update", headers=admin)
        assert started.status_code == 202
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
    assert sorted(p.name for p in (repository / "weave").iterdir() if p.name.isdigit()) == ["1"]
    assert (repository / "weave" / "ACTIVE").read_text().strip() == "1"
    with running_server(tmp_path, [], env=env, args=args) as again:
        job = httpx.get(f"{again.url}/jobs/{started.json()['id']}", headers=admin).json()
        assert job["state"] == "failed" and "no version was written" in job["error"]
        versions = httpx.get(again.url + "/models/weave/versions", headers=admin).json()["versions"]
        assert [v["version"] for v in versions] == [1] and versions[0]["active"]
        assert run_update(again.url)["result"]["version"] == 2  # the same update, run again, completes
