"""The pictures as they were sent, never re-encoded: ``pictures/ab/<sha256>`` under the record's folder.

A picture is stored once however often it is scored. It is written to a temporary file, fsynced and renamed,
so that a reader never sees half of one and a crash leaves none. What each picture holds (bytes, last seen,
flagged, pinned) is kept in the database (:mod:`.store`), which decides what the budget evicts.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

SHA256 = re.compile(r"^[0-9a-f]{64}$")


class PictureStore:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        if not SHA256.match(sha256):
            raise ValueError(f"not a sha256: {sha256!r}")
        return self.folder / sha256[:2] / sha256

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def put(self, sha256: str, data: bytes) -> tuple[bool, Path | None]:
        """Store ``data`` under its digest unless it is there (then its time is touched, so that eviction, which
        spares what was seen lately, leaves it). Returns whether it was written, and the folder to fsync."""
        path = self.path(sha256)
        if path.is_file():
            try:
                os.utime(path)
            except OSError:
                pass
            return False, None
        path.parent.mkdir(exist_ok=True)
        temporary = path.with_name(f".{sha256}.{uuid.uuid4().hex[:8]}.tmp")
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        return True, path.parent

    def read(self, sha256: str) -> bytes | None:
        try:
            return self.path(sha256).read_bytes()
        except OSError:
            return None

    def remove(self, sha256: str) -> int:
        """Delete a picture; returns the bytes freed (0 when it was not there)."""
        path = self.path(sha256)
        try:
            size = path.stat().st_size
            path.unlink()
            return size
        except OSError:
            return 0


def sync_directories(folders) -> None:
    """fsync each folder once, so that the names of the files renamed into it survive a power loss."""
    for folder in set(folders):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
