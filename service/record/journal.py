"""The journal: rows wait here, fsynced, until the database has committed them.

Rows are JSON lines in numbered segment files (``journal/00000001.jsonl``, a new one at each start and every
:data:`SEGMENT_BYTES`). :meth:`Journal.append` writes a batch of lines with one ``write`` and one ``fsync``
(group commit): a row is durable once it returns. The database writer reads on from ``COMMITTED`` (the
segment and byte offset of the first row the database does not have yet; replaced atomically after each
database commit) and removes the segments it has passed. A row may be sent to the database twice (a crash
between its commit and ``COMMITTED``): inserts are idempotent on the row's id.

A kill -9 leaves at most a torn last line in the segment being written; it was never acknowledged (its
``fsync`` had not returned), and the reader skips it.

A process owns its journal through an ``flock`` on ``.owner``, held while it runs and released by the kernel
when it dies. Replicas that share a record folder each have a journal of their own (``journal/NAME``,
``PADIM_REPLICA``); the journal of a replica that stopped with rows in it (a pod deleted for good) is *adopted*:
:func:`adoptable` finds it, another replica takes its lock, sends its rows to the database and removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from io import FileIO
from pathlib import Path

from padim.models.errors import UsageError
from padim.models.repository import sync_directory

log = logging.getLogger("padim.record")

#: A segment is closed and a new one begun past this many bytes.
SEGMENT_BYTES = 8 * 2**20
COMMITTED = "COMMITTED"
OWNER = ".owner"
#: A journal held by another process is waited for this long at start (a replica adopting it finishes first).
OWN_WAIT_S = 15.0


class JournalFull(Exception):
    """The journal holds its limit of bytes: the database has been away too long (or is too slow)."""


class JournalTaken(UsageError):
    """Another running process owns this journal (two processes given one PADIM_REPLICA, or none, on one folder)."""


def _own(folder: Path, wait_s: float):
    """The open ``.owner`` of ``folder``, locked (``folder`` made when missing); JournalTaken after ``wait_s``.

    A replica that adopted the journal removes its folder before it lets go of the lock: a lock won on a file
    that is no longer the folder's ``.owner`` is let go and taken again on the new one."""
    deadline = time.monotonic() + wait_s
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / OWNER, "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            if time.monotonic() >= deadline:
                raise JournalTaken(
                    f"{folder}: another running process writes this journal (replicas that share a record "
                    "folder need a PADIM_REPLICA each)"
                ) from None
            time.sleep(0.2)
            continue
        try:
            if os.fstat(handle.fileno()).st_ino == os.stat(folder / OWNER).st_ino:
                return handle
        except OSError:
            pass
        handle.close()  # adopted and removed meanwhile: own the new one


@dataclass(frozen=True, order=True)
class Position:
    """Where the database writer reads next: a segment's number and a byte offset in it."""

    segment: int
    offset: int


class Journal:
    """The segments in ``folder``, bounded to ``max_bytes`` of rows the database does not have yet."""

    def __init__(self, folder: Path, max_bytes: int, wait_s: float = OWN_WAIT_S, write: bool = True):
        self.folder = Path(folder)
        self._owner = _own(self.folder, wait_s)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        numbers = self._segments()
        self.position = self._read_position(numbers)
        self.writes = write
        if write:
            self.current = (numbers[-1] + 1) if numbers else max(1, self.position.segment)
            # unbuffered: a failed write leaves nothing in a buffer to be written later, after the rows it failed
            self._handle: FileIO | None = open(self._path(self.current), "ab", buffering=0)
        else:  # adopted: read to the end, never written
            self.current = numbers[-1] if numbers else self.position.segment
            self._handle = None
        self._written = 0
        sync_directory(self.folder)

    # ---------------------------------------------------------------- writer
    def pending_bytes(self) -> int:
        """Bytes of rows the database does not have yet."""
        total = 0
        for number in self._segments():
            if number >= self.position.segment:
                try:
                    total += self._path(number).stat().st_size
                except OSError:
                    continue
        return max(0, total - self.position.offset)

    def append(self, lines: list[bytes]) -> None:
        """Write ``lines`` (each ending in a newline) and fsync them: durable when this returns.

        Raises:
            JournalFull: they would take the journal over its limit (nothing is written).
            OSError: the disk failed or is full; what was half-written is cut off again, so the journal holds
                exactly the rows acknowledged (where even that fails, the segment is closed as torn, its last line
                skipped by the reader, and a new one begun at the next append).
        """
        size = sum(len(line) for line in lines)
        if self.pending_bytes() + size > self.max_bytes:
            raise JournalFull(
                f"the journal holds {self.pending_bytes()} bytes of rows the database does not have, "
                f"and PADIM_RECORD_JOURNAL_MAX_BYTES is {self.max_bytes}"
            )
        with self._lock:
            if self.writes and (self._handle is None or self._written >= SEGMENT_BYTES):
                self._rotate()
            handle = self._handle
            assert handle is not None and self.writes, "an adopted journal is read, never written"
            fd = handle.fileno()
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                _write_all(fd, b"".join(lines))
                os.fsync(fd)
            except OSError:
                self._cut(fd, end)
                raise
            self._written += size

    def _cut(self, fd: int, end: int) -> None:
        """After a failed append: the segment back to ``end`` (a full disk lets a file shrink), else closed."""
        try:
            os.ftruncate(fd, end)
            os.fsync(fd)
        except OSError:
            self._close_handle()  # the next append begins a new segment; this one's torn last line is skipped

    def _close_handle(self) -> None:
        with contextlib.suppress(OSError):
            if self._handle is not None:
                self._handle.close()
        self._handle = None

    def _rotate(self) -> None:
        """Begin a new segment (the current one is closed first). A failure leaves no segment open: the next append
        tries again."""
        self._close_handle()
        self.current += 1
        self._handle = open(self._path(self.current), "ab", buffering=0)
        self._written = 0
        sync_directory(self.folder)

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._handle.close()
            self._owner.close()  # the lock goes with it

    # ---------------------------------------------------------------- reader
    def read(self, position: Position, max_rows: int) -> tuple[list[dict], Position]:
        """Up to ``max_rows`` complete rows from ``position`` on (one segment at most), and where the next read begins.

        A closed segment's torn last line (a crash while it was written) is skipped; the segment being written is
        read up to its last complete line.
        """
        for number in self._segments():
            if number < position.segment:
                continue
            offset = position.offset if number == position.segment else 0
            rows, consumed = _read_lines(self._path(number), offset, max_rows)
            if rows or number >= self.current:
                return rows, Position(number, offset + consumed)
            position = Position(number + 1, 0)  # a closed segment read to its end
        return [], position

    def commit(self, position: Position) -> None:
        """The database has every row before ``position``: remember it, and remove the segments passed."""
        temporary = self.folder / f".{COMMITTED}.tmp"
        temporary.write_text(f"{position.segment} {position.offset}\n")
        os.replace(temporary, self.folder / COMMITTED)
        self.position = position
        for number in self._segments():
            if number < position.segment and number != self.current:
                try:
                    self._path(number).unlink()
                except OSError:
                    pass

    def waiting_rows(self) -> int:
        """Rows the database does not have yet (counted by reading the journal: for metrics and start-up)."""
        count, position = 0, self.position
        while True:
            rows, position = self.read(position, 10_000)
            if not rows:
                return count
            count += len(rows)

    # ---------------------------------------------------------------- files
    def _segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.folder.glob("*.jsonl") if p.stem.isdigit())

    def _path(self, number: int) -> Path:
        return self.folder / f"{number:08d}.jsonl"

    def _read_position(self, numbers: list[int]) -> Position:
        try:
            segment, offset = (int(x) for x in (self.folder / COMMITTED).read_text().split())
            return Position(segment, offset)
        except (OSError, ValueError):
            return Position(numbers[0] if numbers else 1, 0)


def waiting(folder: Path) -> tuple[int, int]:
    """Rows and bytes of the journal in ``folder`` that the database does not have yet, read without owning it (the
    journal of a running sibling: the API processes of one service each have one)."""
    numbers = sorted(int(p.stem) for p in folder.glob("*.jsonl") if p.stem.isdigit())
    try:
        segment, offset = (int(x) for x in (folder / COMMITTED).read_text().split())
    except (OSError, ValueError):
        segment, offset = (numbers[0] if numbers else 1), 0
    rows = size = 0
    for number in numbers:
        if number < segment:
            continue
        start = offset if number == segment else 0
        path = folder / f"{number:08d}.jsonl"
        while True:
            found, consumed = _read_lines(path, start, 10_000)
            if not found:
                break
            rows += len(found)
            size += consumed
            start += consumed
    return rows, size


def adoptable(root: Path, own: Path) -> list[Path]:
    """Journals under ``root`` other than ``own`` that hold segments: ``root``'s own (a single process's, before
    replicas were named) and each replica's folder; whether their owner still runs is for :func:`adopt`."""
    if not root.is_dir():
        return []
    folders = [root, *sorted(p for p in root.iterdir() if p.is_dir())]
    return [p for p in folders if p.resolve() != own.resolve() and any(p.glob("*.jsonl"))]


def adopt(folder: Path, insert, batch: int) -> int | None:
    """Send the rows of the journal in ``folder`` to the database (``insert(rows)``) and remove it; ``None`` when
    its owner runs. A replica's folder goes; a shared root keeps its replicas' folders."""
    try:
        journal = Journal(folder, 0, wait_s=0, write=False)
    except JournalTaken:
        return None
    adopted, position = 0, journal.position
    try:
        while True:
            rows, position = journal.read(position, batch)
            if not rows:
                break
            insert(rows)  # idempotent on the row's id: an adopter after a crash here inserts nothing twice
            adopted += len(rows)
        for path in [*folder.glob("*.jsonl"), folder / COMMITTED]:
            with contextlib.suppress(OSError):
                path.unlink()
        if not any(p.is_dir() for p in folder.iterdir()):  # a replica's folder: gone (before its lock is let go)
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        journal.close()
    return adopted


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_lines(path: Path, offset: int, max_rows: int, chunk: int = 2**20) -> tuple[list[dict], int]:
    """Complete JSON lines of ``path`` from ``offset``: at most ``max_rows``, and the bytes they took."""
    rows: list[dict] = []
    consumed = 0
    try:
        handle = open(path, "rb")
    except OSError:
        return rows, 0
    with handle:
        handle.seek(offset)
        rest = b""
        while len(rows) < max_rows:
            data = handle.read(chunk)
            if not data:
                break
            lines = (rest + data).split(b"\n")
            rest = lines.pop()  # after the last newline: incomplete so far
            for line in lines:
                consumed += len(line) + 1
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    log.error("journal: an unreadable row skipped", extra={"file": path.name})
                if len(rows) >= max_rows:
                    break
    return rows, consumed
