"""The pictures as they were sent, never re-encoded: ``pictures/ab/<sha256>`` under the record's folder.

A picture is stored once however often it is scored. It is written to a temporary file, fsynced and renamed,
so that a reader never sees half of one and a crash leaves none. What each picture holds (bytes, last seen,
flagged, pinned) is kept in the database (:mod:`.store`), which decides what the budget evicts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from padim.models.repository import sync_directory, write_atomically

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
        write_atomically(path, data, sync_folder=False)  # the journal writer syncs the folders of a group at once
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


#: Magic numbers of the picture formats the service reads: ``(magic, media type, file extension)``.
FORMATS = (
    (b"\x89PNG\r\n\x1a\n", "image/png", ".png"),
    (b"\xff\xd8\xff", "image/jpeg", ".jpg"),
    (b"BM", "image/bmp", ".bmp"),
    (b"II*\x00", "image/tiff", ".tif"),
    (b"MM\x00*", "image/tiff", ".tif"),
    (b"GIF8", "image/gif", ".gif"),
)


def picture_format(data: bytes) -> tuple[str, str]:
    """``(media type, file extension)`` of a picture's bytes, from their magic number."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp", ".webp"
    return next(
        ((kind, ext) for magic, kind, ext in FORMATS if data.startswith(magic)), ("application/octet-stream", ".bin")
    )


def sync_directories(folders) -> None:
    """fsync each folder once (the pictures renamed into them during one group commit)."""
    for folder in set(folders):
        sync_directory(folder)
