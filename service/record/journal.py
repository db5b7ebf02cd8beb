"""The journal: rows wait here, fsynced, until the database has committed them.

Rows are JSON lines in numbered segment files (``journal/00000001.jsonl``, a new one at each start and every
:data:`SEGMENT_BYTES`). :meth:`Journal.append` writes a batch of lines with one ``write`` and one ``fsync``
(group commit): a row is durable once it returns. The database writer reads on from ``COMMITTED`` (the
segment and byte offset of the first row the database does not have yet; replaced atomically after each
database commit) and removes the segments it has passed. A row may be sent to the database twice (a crash
between its commit and ``COMMITTED``): inserts are idempotent on the row's id.

A kill -9 leaves at most a torn last line in the segment being written; it was never acknowledged (its
``fsync`` had not returned), and the reader skips it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from padim.models.repository import sync_directory

log = logging.getLogger("padim.record")

#: A segment is closed and a new one begun past this many bytes.
SEGMENT_BYTES = 8 * 2**20
COMMITTED = "COMMITTED"


class JournalFull(Exception):
    """The journal holds its limit of bytes: the database has been away too long (or is too slow)."""


@dataclass(frozen=True, order=True)
class Position:
    """Where the database writer reads next: a segment's number and a byte offset in it."""

    segment: int
    offset: int


class Journal:
    """The segments in ``folder``, bounded to ``max_bytes`` of rows the database does not have yet."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        numbers = self._segments()
        self.position = self._read_position(numbers)
        self.current = (numbers[-1] + 1) if numbers else max(1, self.position.segment)
        self._handle = open(self._path(self.current), "ab")
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
            OSError: the disk failed (the segment is closed and a new one begun at the next append).
        """
        size = sum(len(line) for line in lines)
        if self.pending_bytes() + size > self.max_bytes:
            raise JournalFull(
                f"the journal holds {self.pending_bytes()} bytes of rows the database does not have, "
                f"and PADIM_RECORD_JOURNAL_MAX_BYTES is {self.max_bytes}"
            )
        with self._lock:
            if self._written >= SEGMENT_BYTES:
                self._rotate()
            try:
                self._handle.write(b"".join(lines))
                self._handle.flush()
                os.fsync(self._handle.fileno())
            except OSError:
                self._rotate()  # what was half-written stays behind, as a torn line the reader skips
                raise
            self._written += size

    def _rotate(self) -> None:
        try:
            self._handle.close()
        except OSError:
            pass
        self.current += 1
        self._handle = open(self._path(self.current), "ab")
        self._written = 0
        sync_directory(self.folder)

    def close(self) -> None:
        with self._lock:
            self._handle.close()

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
