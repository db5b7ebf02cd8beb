"""The model repository on disk: layout a person can read, numbers never reused, history, atomic changes."""

from __future__ import annotations

import json
import os
import time

import pytest
from helpers import python_forked, wait_for_line

from padim.core.artifact import file_sha256
from padim.models.errors import NothingToRollBack, UnservableModel, UsageError, VersionActive, VersionNotFound
from padim.models.repository import Repository, check_name


def test_a_version_is_a_numbered_folder_with_its_file_and_what_is_known_of_it(model_file, tmp_path):
    repository = Repository(tmp_path / "repo")
    version = repository.add("weave", model_file)
    assert version.version == 1 and version.kind == "model" and version.source == model_file.name
    assert version.path == tmp_path / "repo" / "weave" / "1" / "model.padim"
    assert version.sha256 == file_sha256(model_file)  # an independent reading of the bytes
    recorded = json.loads((tmp_path / "repo" / "weave" / "1" / "version.json").read_text())
    assert recorded["version"] == 1 and recorded["sha256"] == version.sha256
    assert (
        repository.active("weave") == 1 and not (tmp_path / "repo" / "weave" / "ACTIVE").exists()
    )  # highest by default
    repository.activate("weave", 1)
    assert (tmp_path / "repo" / "weave" / "ACTIVE").read_text() == "1\n"
    assert version.calibration()["threshold"] > 0


def test_numbers_are_never_reused_and_rollback_walks_the_history_back(model_file, tmp_path):
    repository = Repository(tmp_path)
    for _ in range(3):
        repository.activate("weave", repository.add("weave", model_file).version)
    assert repository.history("weave") == [1, 2, 3]
    assert repository.rollback("weave") == 2 and repository.active("weave") == 2
    assert repository.rollback("weave") == 1 and repository.history("weave") == [1]
    with pytest.raises(NothingToRollBack):
        repository.rollback("weave")
    with pytest.raises(VersionActive):
        repository.remove("weave", 1)
    repository.remove("weave", 3)
    assert [v.version for v in repository.versions("weave")] == [1, 2]
    assert repository.add("weave", model_file).version == 4  # 3 is gone, and never given again
    repository.remove("weave", 4)
    repository.remove("weave", 2)
    assert repository.add("weave", model_file).version == 5
    with pytest.raises(VersionNotFound, match="no version 9"):
        repository.activate("weave", 9)


def test_a_rollback_skips_versions_removed_since(model_file, tmp_path):
    repository = Repository(tmp_path)
    for _ in range(3):
        repository.activate("weave", repository.add("weave", model_file).version)
    repository.remove("weave", 2)
    assert repository.previous("weave") == 1


def test_a_version_copied_in_by_hand_is_read_from_its_file(model_file, tmp_path):
    repository = Repository(tmp_path)
    repository.add("weave", model_file)
    (tmp_path / "weave" / "7").mkdir()
    (tmp_path / "weave" / "7" / "line3.padim").write_bytes(model_file.read_bytes())
    copied = repository.version("weave", 7)
    assert copied.source == "copied in" and copied.sha256 == file_sha256(model_file) and copied.created
    assert json.loads((tmp_path / "weave" / "7" / "version.json").read_text())["sha256"] == copied.sha256  # hashed once
    assert repository.active("weave") == 7  # no ACTIVE: the highest
    assert repository.add("weave", model_file).version == 8
    (tmp_path / "weave" / "ACTIVE").write_text("1\n")  # edited by hand
    assert repository.active("weave") == 1


def test_damaged_or_foreign_files_and_bad_names_are_refused_and_leave_nothing(model_file, tmp_path):
    repository = Repository(tmp_path / "repo")
    damaged = tmp_path / "damaged.padim"
    damaged.write_bytes(model_file.read_bytes()[:1000])
    for bad in (damaged, tmp_path / "missing.padim"):
        with pytest.raises((UnservableModel, UsageError)):
            repository.add("weave", bad)
    assert repository.names() == [] and not list((tmp_path / "repo").glob("weave/[0-9]*"))
    assert not list((tmp_path / "repo").glob("weave/.incoming-*"))
    for name in ("../x", "1", ".hidden", "a b", ""):
        with pytest.raises(UsageError):
            check_name(name)


def test_interrupted_uploads_are_ignored_and_swept_later(model_file, tmp_path):
    repository = Repository(tmp_path)
    repository.add("weave", model_file)
    leftover = repository.incoming("weave")
    (leftover / "model.padim").write_bytes(b"half a model")
    assert [v.version for v in repository.versions("weave")] == [1]
    old = time.time() - 7200
    os.utime(leftover, (old, old))
    repository.add("weave", model_file)
    assert not leftover.exists()


#: Writes ACTIVE (and HISTORY) in a loop until killed; the reader then finds a whole pointer.
WRITER = """
import sys
from padim.models.repository import Repository
repository = Repository(sys.argv[1])
print("ready", flush=True)
while True:
    repository.activate("weave", 1)
    repository.activate("weave", 2)
"""


def test_kill_9_while_the_pointer_is_written_leaves_a_whole_pointer(model_file, tmp_path):
    repository = Repository(tmp_path)
    for _ in range(2):
        repository.add("weave", model_file)
    # a pointer before the writer starts (a writer killed before its first write leaves what was there)
    repository.activate("weave", 2)
    for delay in (0.05, 0.1, 0.2, 0.3, 0.5):
        output = tmp_path / f"writer-{delay}.log"
        process = python_forked(WRITER, tmp_path, output=output)  # a process of its own, its imports warm
        wait_for_line(output, "ready", process)
        time.sleep(delay)
        process.kill()
        process.wait()
        assert (tmp_path / "weave" / "ACTIVE").read_text() in ("1\n", "2\n")
        assert set(Repository(tmp_path).history("weave")) <= {1, 2}
        assert Repository(tmp_path).active("weave") in (1, 2)


def test_a_name_never_leads_out_of_the_repository(model_file, tmp_path):
    outside = tmp_path / "1"
    outside.mkdir()
    (outside / "model.padim").write_bytes(model_file.read_bytes())
    repository = Repository(tmp_path / "repo")
    for name in ("..", "../x", "/etc"):
        with pytest.raises(UsageError):
            repository.version(name, 1)
        with pytest.raises(UsageError):
            repository.versions(name)
