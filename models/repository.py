"""A model repository on disk: numbered versions of each model, which one is active, and what was active before.

The layout is meant to be read with ``ls`` and ``cat`` and edited with ``cp`` and ``mv``::

    REPO/
      weave/                  a model: its versions, its pointer, its history
        ACTIVE                the active version's number ("2"), one line
        HISTORY               activations, oldest first: "<version> <ISO time>" a line; a rollback pops the last
        LAST                  the highest version number ever given (numbers are never reused)
        1/model.padim         a version: one model file ...
        1/version.json        ... and what the repository knows of it: version, sha256, created, source
        2/padim.json ...      ... or an export directory's files (padim export), added offline
      .cache/weave/2/         exports made at load (runtime auto on a CPU): outside the model folders

Every change is atomic: a version is written into ``NAME/.incoming-*`` and renamed to ``NAME/N`` once
complete and checked; ``ACTIVE``, ``HISTORY`` and ``LAST`` are replaced by rename after an fsync. A crash
(kill -9) at any point leaves either the old or the new state, never half of one; leftovers of an
interrupted upload are ignored and removed at the next change. Changes of one model are serialised by
an ``flock`` on ``NAME/.lock`` (the service and ``padim repository`` may run side by side).

A version copied in by hand needs only its folder (``mkdir REPO/weave/3 && cp new.padim REPO/weave/3/``;
copy elsewhere and ``mv`` the folder in, so that no reader sees half a file); ``version.json`` is then
made from the file. The sha256 of an export directory is that of the model file it was exported from
(its ``padim.json``), as the service reports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from padim.core.artifact import file_sha256, locked_file, read_header
from padim.core.errors import ArtifactError
from padim.models.deploy.export import METADATA_FILE, read_export
from padim.models.errors import (
    NothingToRollBack,
    UnservableModel,
    UsageError,
    VersionActive,
    VersionNotFound,
)

ACTIVE, HISTORY, LAST, VERSION_FILE, MODEL_FILE = "ACTIVE", "HISTORY", "LAST", "version.json", "model.padim"
CACHE = ".cache"
INCOMING = ".incoming-"
#: A model's name: what URLs and Prometheus labels carry.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_name(name: str) -> str:
    if not NAME.match(name) or name.startswith(".") or name.isdigit():
        raise UsageError(
            f"model name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit, and not a number alone"
        )
    return name


@dataclass(frozen=True)
class Version:
    """One version of a model, as the repository knows it."""

    name: str
    version: int
    path: Path  # the model file, or the export directory
    sha256: str
    created: str  # when it was added (ISO 8601, UTC)
    source: str  # what it was added from: "upload", or the file name given to `padim repository add`
    kind: str  # "model" (a .padim file) or "export" (an export directory)
    update: dict | None = (
        None  # a version made by an update from reviews: what it learned, its gate, forced activations
    )

    def calibration(self) -> dict | None:
        """The calibration summary its header (or ``padim.json``) records; ``None`` where it cannot be read."""
        try:
            if self.kind == "export":
                return json.loads((self.path / METADATA_FILE).read_text()).get("calibration")
            return read_header(self.path).get("calibration")
        except (OSError, ValueError, ArtifactError):
            return None

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "sha256": self.sha256,
            "created": self.created,
            "source": self.source,
            "kind": self.kind,
            "update": self.update,
        }


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_atomically(path: Path, content: str | bytes, sync_folder: bool = True) -> None:
    """``path`` holds ``content`` or what it held before, whatever happens (fsync, then rename); the folder is
    fsynced too unless the caller syncs it later for several files (``sync_folder=False``)."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "wb") as handle:
            handle.write(content.encode() if isinstance(content, str) else content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:  # a full disk: no temporary file left taking what little room there is
        temporary.unlink(missing_ok=True)
        raise
    if sync_folder:
        sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """fsync a folder, so that the names of files renamed into it survive a power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_path_in(folder: Path) -> tuple[Path, str]:
    """The model a version folder holds: ``(path, kind)``.

    Raises:
        UnservableModel: no model file or export in it, or more than one model file.
    """
    if (folder / METADATA_FILE).is_file():
        return folder, "export"
    files = sorted(p for p in folder.glob("*.padim") if p.is_file())
    if len(files) != 1:
        raise UnservableModel(
            f"{folder}: a version folder holds one .padim file or an export directory's files; "
            f"found {len(files)} .padim files"
        )
    return files[0], "model"


def model_sha256(path: Path, kind: str) -> str:
    """What the service reports as a version's sha256: the file's, or for an export the source file's."""
    if kind == "export":
        return read_export(path)["model"]["sha256"]
    return file_sha256(path)


def check_model(path: Path) -> str:
    """Read what can be read without loading: the header of a model file (format, integrity of the header)
    or an export's ``padim.json`` with every file's digest. Returns the kind.

    Raises:
        UnservableModel: a damaged, foreign or newer file; the message says which.
    """
    try:
        if path.is_dir():
            read_export(path)
            return "export"
        read_header(path)
        return "model"
    except ArtifactError as error:
        raise UnservableModel(str(error)) from None


class Repository:
    """The repository at ``root`` (created when missing)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"{self.root}: the repository must be a folder")
        self.root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ reading
    def names(self) -> list[str]:
        """Models that have at least one version, sorted."""
        return sorted(
            p.name
            for p in self.root.iterdir()
            if p.is_dir() and NAME.match(p.name) and not p.name.isdigit() and self._numbers(p.name)
        )

    def _numbers(self, name: str) -> list[int]:
        folder = self.root / check_name(name)  # a name is one folder of the repository, never a path out of it
        if not folder.is_dir():
            return []
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())

    def versions(self, name: str) -> list[Version]:
        return [self.version(name, number) for number in self._numbers(name)]

    def version(self, name: str, number: int) -> Version:
        """Raises VersionNotFound when ``NAME/number`` is not there."""
        folder = self.root / check_name(name) / str(number)
        if not folder.is_dir():
            known = self._numbers(name)
            raise VersionNotFound(
                f"model {name!r} has no version {number}"
                + (f"; versions: {', '.join(map(str, known))}" if known else "")
            )
        path, kind = model_path_in(folder)
        try:
            recorded = json.loads((folder / VERSION_FILE).read_text())
        except (OSError, ValueError):  # copied in by hand: described from the file, once
            recorded = {
                "version": number,
                "sha256": model_sha256(path, kind) if path.exists() else "",
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(folder.stat().st_mtime)),
                "source": "copied in",
                "kind": kind,
            }
            if recorded["sha256"]:
                with contextlib.suppress(OSError):  # a read-only repository: described again at the next reading
                    write_atomically(folder / VERSION_FILE, json.dumps(recorded, indent=1) + "\n")
        return Version(
            name,
            number,
            path,
            recorded.get("sha256", ""),
            recorded.get("created", ""),
            recorded.get("source", ""),
            kind,
            recorded.get("update"),
        )

    def active(self, name: str) -> int | None:
        """The active version: ``ACTIVE``'s number; without a readable one, the highest version."""
        try:
            number = int((self.root / name / ACTIVE).read_text().strip())
            if number in self._numbers(name):
                return number
        except (OSError, ValueError):
            pass
        numbers = self._numbers(name)
        return numbers[-1] if numbers else None

    def history(self, name: str) -> list[int]:
        """Versions activated, oldest first (a rollback removed its entry)."""
        return [int(line.split()[0]) for line in self._history_lines(name)]

    def last(self, name: str) -> int:
        try:
            recorded = int((self.root / name / LAST).read_text().strip())
        except (OSError, ValueError):
            recorded = 0
        return max([recorded, *self._numbers(name), *self.history(name)])

    def cache_root(self, name: str) -> Path:
        """Where exports made at load of a model's versions are cached (outside the model folders; each
        export's folder is named after its source's sha256, ``model.padim.onnx-<16 hex>``)."""
        return self.root / CACHE / name

    # ------------------------------------------------------------------ changing
    @contextlib.contextmanager
    def locked(self, name: str) -> Iterator[None]:
        """Serialise changes of model ``name`` across threads and processes."""
        folder = self.root / check_name(name)
        folder.mkdir(exist_ok=True)
        with locked_file(folder / ".lock"):
            yield

    def incoming(self, name: str) -> Path:
        """A fresh folder to write a new version into (not a version until :meth:`commit`)."""
        folder = self.root / check_name(name)
        folder.mkdir(exist_ok=True)
        path = folder / f"{INCOMING}{uuid.uuid4().hex}"
        path.mkdir()
        return path

    def commit(self, name: str, incoming: Path, sha256: str, source: str, update: dict | None = None) -> Version:
        """Make the checked model in ``incoming`` the next version of ``name`` (not active yet); ``update``: what an
        update from reviews learned, kept in its ``version.json``."""
        with self.locked(name):
            number = self.last(name) + 1
            path, kind = model_path_in(incoming)
            recorded = {"version": number, "sha256": sha256, "created": utc_now(), "source": source, "kind": kind}
            if update is not None:
                recorded["update"] = update
            write_atomically(incoming / VERSION_FILE, json.dumps(recorded, indent=1) + "\n")
            write_atomically(self.root / name / LAST, f"{number}\n")
            os.rename(incoming, self.root / name / str(number))
            sync_directory(self.root / name)
            self._sweep(name)
        return self.version(name, number)

    def discard(self, incoming: Path) -> None:
        shutil.rmtree(incoming, ignore_errors=True)

    def add(self, name: str, source: Path) -> Version:
        """Copy a model file or export directory in as the next version, after checking it (not active yet).

        Raises:
            UnservableModel: damaged, foreign or newer; UsageError: not there.
        """
        source = Path(source)
        if not source.exists():
            raise UsageError(f"{source}: no such file or export directory")
        kind = check_model(source)
        incoming = self.incoming(name)
        try:
            if kind == "export":
                shutil.copytree(source, incoming, dirs_exist_ok=True)
            else:
                shutil.copyfile(source, incoming / MODEL_FILE)
            path, _ = model_path_in(incoming)
            check_model(path)  # the copy, as read back
            sha256 = model_sha256(path, kind)
            return self.commit(name, incoming, sha256, source.name)
        except BaseException:
            self.discard(incoming)
            raise

    def note_forced(self, name: str, number: int, note: dict) -> None:
        """Keep in a version's ``version.json`` that it was activated past its update's gate (who asked, when)."""
        with self.locked(name):
            path = self.root / name / str(number) / VERSION_FILE
            recorded = json.loads(path.read_text())
            recorded.setdefault("update", {}).setdefault("forced", []).append(note)
            write_atomically(path, json.dumps(recorded, indent=1) + "\n")

    def activate(self, name: str, number: int) -> None:
        """Point ``ACTIVE`` at ``number`` and add it to the history."""
        with self.locked(name):
            self.version(name, number)
            if self.active(name) == number and (self.root / name / ACTIVE).is_file():
                return
            history = self._history_lines(name) + [f"{number} {utc_now()}"]
            write_atomically(self.root / name / HISTORY, "\n".join(history) + "\n")
            write_atomically(self.root / name / ACTIVE, f"{number}\n")

    def previous(self, name: str) -> int:
        """The version a rollback goes back to: the one active before the current, still present.

        Raises:
            NothingToRollBack: none.
        """
        current, numbers = self.active(name), set(self._numbers(name))
        if not numbers:
            raise VersionNotFound(f"the repository has no model named {name!r}")
        for number in reversed(self.history(name)):
            if number != current and number in numbers:
                return number
        raise NothingToRollBack(
            f"model {name!r}: no earlier activation to go back to (version {current} is the "
            "first one activated that is still there)"
        )

    def rollback(self, name: str) -> int:
        """Activate :meth:`previous`, dropping the current version's entries from the end of the history."""
        with self.locked(name):
            target = self.previous(name)
            lines = self._history_lines(name)
            while lines and int(lines[-1].split()[0]) != target:
                lines.pop()
            write_atomically(self.root / name / HISTORY, "\n".join(lines) + ("\n" if lines else ""))
            write_atomically(self.root / name / ACTIVE, f"{target}\n")
        return target

    def remove(self, name: str, number: int) -> None:
        """Delete a version that is not active (its number is never given again).

        Raises:
            VersionActive, VersionNotFound.
        """
        with self.locked(name):
            doomed_version = self.version(name, number)
            if self.active(name) == number:
                raise VersionActive(f"version {number} of {name!r} is active; activate another (or roll back) first")
            write_atomically(self.root / name / LAST, f"{self.last(name)}\n")
            doomed = self.root / name / f"{INCOMING}deleted-{number}-{uuid.uuid4().hex[:8]}"
            os.rename(self.root / name / str(number), doomed)  # gone from the listing at once, atomically
            shutil.rmtree(doomed, ignore_errors=True)
            if doomed_version.sha256 and all(v.sha256 != doomed_version.sha256 for v in self.versions(name)):
                for cached in self.cache_root(name).glob(f"*-{doomed_version.sha256[:16]}"):
                    shutil.rmtree(cached, ignore_errors=True)

    def _history_lines(self, name: str) -> list[str]:
        try:
            return [
                line
                for line in (self.root / name / HISTORY).read_text().splitlines()
                if line.split() and line.split()[0].isdigit()
            ]
        except OSError:
            return []

    def _sweep(self, name: str, older_than_s: float = 3600.0) -> None:
        """Remove what interrupted uploads left (an hour old: a running upload is younger)."""
        for leftover in (self.root / name).glob(f"{INCOMING}*"):
            with contextlib.suppress(OSError):
                if time.time() - leftover.stat().st_mtime > older_than_s:
                    shutil.rmtree(leftover, ignore_errors=True)
