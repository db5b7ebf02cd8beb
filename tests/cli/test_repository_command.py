"""`padim repository`: the repository's versions offline, through the real command line."""

from __future__ import annotations

import json

from helpers import run_cli


def lines(result) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_add_list_activate_rollback_remove(model_file, tmp_path):
    root = tmp_path / "repo"
    (added,) = lines(run_cli("-q", "repository", "add", root, "weave", model_file, "--activate"))
    assert added["version"] == 1 and added["active"] and len(added["sha256"]) == 64
    run_cli("-q", "repository", "add", root, "weave", model_file)
    listed = lines(run_cli("repository", "list", root))
    assert [(v["model"], v["version"], v["active"]) for v in listed] == [("weave", 1, True), ("weave", 2, False)]
    assert listed[0]["calibration"]["threshold"] > 0
    assert lines(run_cli("repository", "activate", root, "weave", "2"))[0]["active"]
    assert (root / "weave" / "ACTIVE").read_text() == "2\n"
    assert lines(run_cli("repository", "rollback", root, "weave"))[0]["version"] == 1
    assert lines(run_cli("repository", "remove", root, "weave", "2")) == [{"model": "weave", "removed": 2}]
    assert [v["version"] for v in lines(run_cli("repository", "list", root, "weave"))] == [1]


def test_what_the_service_would_refuse_is_refused_with_one_line(model_file, dataset, tmp_path):
    root = tmp_path / "repo"
    damaged = tmp_path / "damaged.padim"
    damaged.write_bytes(model_file.read_bytes()[:5000])
    partial = tmp_path / "partial.padim"
    run_cli(
        "-q",
        "train",
        dataset / "train" / "good",
        "--output",
        partial,
        "--weights",
        "random",
        "--image-size",
        32,
        "--partial",
    )
    for bad in (damaged, partial, tmp_path / "missing.padim"):
        result = run_cli("repository", "add", root, "weave", bad, check=False)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not list(root.glob("weave/[0-9]*"))
    run_cli("-q", "repository", "add", root, "weave", model_file, "--activate")
    for args, words in (
        (("rollback", root, "weave"), "no earlier activation"),
        (("remove", root, "weave", "1"), "is active"),
        (("activate", root, "weave", "5"), "no version 5"),
        (("list", root, "other"), "no model named"),
        (("add", root, "../up", model_file), "model name"),
    ):
        result = run_cli("repository", *args, check=False)
        assert result.returncode == 1 and words in result.stderr, (args, result.stderr)
