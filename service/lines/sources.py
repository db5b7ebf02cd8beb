"""Where a line's pictures come from: a hot folder, or a camera, stream or video file (OpenCV).

A source yields :class:`Picture` objects (the bytes as written, or a frame encoded losslessly as BMP, so that the
service decodes it exactly as an uploaded picture) and is told what became of each one.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from padim.models.repository import write_atomically

from .capture import encode_frame, open_capture
from .config import CameraSource, FolderSource

log = logging.getLogger("padim.lines")

#: Names a writer uses while a file is incomplete (rename it into place when done): never taken.
PARTIAL_SUFFIXES = (".part", ".partial", ".tmp", ".crdownload", "~")
#: First wait after a stream drops; doubled after each failed reopen up to the source's reconnect_max_s.
FIRST_BACKOFF_S = 0.5
#: Frames chosen and not yet taken by the line: past this the oldest is dropped (the line is behind).
FRAME_QUEUE = 64


@dataclass
class Picture:
    source_id: str  # the file's name in the folder, or DEVICE#FRAME
    data: bytes
    seen: float  # wall-clock time the picture was complete (file) or read (frame)
    part: str | None = None
    path: Path | None = None  # a folder's file
    sha256: str = field(init=False)

    def __post_init__(self) -> None:
        self.sha256 = hashlib.sha256(self.data).hexdigest()


class HotFolder:
    """New files in a folder, each taken once complete, moved once its verdict is journaled.

    A file is complete when Linux says it was closed after writing or renamed into the folder (watchdog events),
    or, where no event arrives (network shares, other systems), when its size and time have not changed for
    ``settle_s``. Files being written under a partial name (``.part``, ``.tmp``, ...) are never taken.
    """

    def __init__(self, config: FolderSource):
        self.config = config
        self.folder = config.path
        self.state = "starting"
        self.last_error: str | None = None
        self._sizes: dict[Path, tuple[int, int, float]] = {}  # path -> (size, mtime_ns, unchanged since)
        self._closed: dict[Path, float] = {}  # closed after writing, or renamed in (events): when it was told
        self._settle_only: set[Path] = set()  # did not decode: taken again only once its size settles
        self._retried: set[Path] = set()
        self.taken: set[Path] = set()  # yielded and not yet finished
        self._wake = asyncio.Event()
        self._observer = None

    def start(self) -> None:
        for which in ("done", "flagged", "rejected"):
            if self.config.after == "move" or which == "rejected":
                self.config.folder(which).mkdir(parents=True, exist_ok=True)
        if self.config.events:
            self._observer = _watch(self.folder, asyncio.get_running_loop(), self._event)
        self.state = "watching"

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None

    def _event(self, path: str) -> None:  # on the event loop
        self._closed[Path(path)] = time.monotonic()
        self._wake.set()

    def _wanted(self, name: str) -> bool:
        lower = name.lower()
        if name.startswith(".") or lower.endswith(PARTIAL_SUFFIXES):
            return False
        return any(fnmatch.fnmatch(lower, p.lower()) for p in self.config.patterns)

    def _ready(self) -> tuple[list[Path], float]:
        """Files complete now, oldest first, and how long until the next may settle."""
        now, wait = time.monotonic(), self.config.poll_s
        ready: list[tuple[int, Path]] = []
        present = set()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if not entry.is_file(follow_symlinks=False) or not self._wanted(entry.name):
                    continue
                path = Path(entry.path)
                present.add(path)
                if path in self.taken:
                    continue
                stat = entry.stat(follow_symlinks=False)
                before = self._sizes.get(path)
                if before is None or before[:2] != (stat.st_size, stat.st_mtime_ns):
                    self._sizes[path] = (stat.st_size, stat.st_mtime_ns, now)
                    before = self._sizes[path]
                settled = now - before[2] >= self.config.settle_s
                if stat.st_size > 0 and (settled or (path in self._closed and path not in self._settle_only)):
                    ready.append((stat.st_mtime_ns, path))
                elif stat.st_size > 0 or path not in self._closed:
                    wait = min(wait, max(0.01, self.config.settle_s - (now - before[2])))
        for gone in set(self._sizes) - present:
            self._sizes.pop(gone, None)
        # an event for a file this scan did not see yet (it came during the scan) is kept for the next one
        for gone in [p for p, told in list(self._closed.items()) if p not in present and told < now]:
            self._closed.pop(gone, None)
        self._settle_only &= present
        self._retried &= present
        return [path for _, path in sorted(ready)], wait

    async def pictures(self):
        """Yields each complete picture once (again only if :meth:`retry` or :meth:`release` gives it back)."""
        while True:
            self._wake.clear()  # before the scan: an event during it or the pictures' handling wakes the next one
            try:
                ready, wait = await asyncio.to_thread(self._ready)
                self.state, self.last_error = "watching", None
            except OSError as error:  # a network share that went away: say so and keep looking
                ready, wait = [], self.config.poll_s
                if self.state != "unreachable":
                    log.error("hot folder unreachable", extra={"folder": str(self.folder), "error": str(error)})
                self.state, self.last_error = "unreachable", str(error)
            for path in ready:
                try:
                    data = await asyncio.to_thread(path.read_bytes)
                except OSError:  # moved or deleted meanwhile
                    continue
                self.taken.add(path)
                part = path.stem if self.config.part_from_name else None
                yield Picture(path.name, data, time.time(), part=part, path=path)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    def retry(self, picture: Picture) -> bool:
        """A picture that did not decode is taken once more after its size settled again (a writer may have paused,
        or closed it between writes); ``False`` when it was so taken already: reject it."""
        assert picture.path is not None
        if picture.path in self._retried:
            self._retried.discard(picture.path)
            return False
        self._retried.add(picture.path)
        self._settle_only.add(picture.path)
        self._sizes.pop(picture.path, None)
        self.taken.discard(picture.path)
        return True

    def release(self, picture: Picture) -> None:
        """Give a picture back to be taken again (its journaling or recording failed)."""
        assert picture.path is not None
        self.taken.discard(picture.path)
        self._sizes.pop(picture.path, None)

    def finish(self, picture: Picture, anomalous: bool) -> None:
        """Runs in a thread: move the picture to done/ or flagged/ (or leave it)."""
        assert picture.path is not None
        # a left picture stays taken: it is not read again by this process (a restart reads it, finds its key in the
        # journal, and does not score it twice)
        if self.config.after == "move":
            _move(picture.path, self.config.folder("flagged" if anomalous else "done"), picture.sha256)
            self.taken.discard(picture.path)

    def reject(self, picture: Picture, reason: str) -> None:
        """Runs in a thread: move an undecodable picture to rejected/, its reason beside it."""
        assert picture.path is not None
        target = _move(picture.path, self.config.folder("rejected"), picture.sha256)
        if target is not None:
            write_atomically(target.with_name(target.name + ".reason.txt"), reason + "\n")
        self.taken.discard(picture.path)

    def describe(self) -> dict:
        return {"type": "folder", "state": self.state, "path": str(self.folder), "error": self.last_error}


def _move(path: Path, folder: Path, sha256: str) -> Path | None:
    """Move ``path`` into ``folder`` (a name already there gets the content's digest); ``None`` if it is gone.

    A hard link, then an unlink: the watched folder sees a deletion. A rename would be an ``IN_MOVED_FROM``, which
    watchdog holds back 0.5 s to pair with its ``IN_MOVED_TO``, and every later event (the next pictures' closes)
    waits behind it. Where the file system has no hard links, a rename.
    """
    target = folder / path.name
    if target.exists() and not _same_file(path, target):  # the same name again (another part): keep both
        target = folder / f"{path.stem}-{sha256[:8]}{path.suffix}"
    try:
        os.link(path, target)
    except FileExistsError:  # linked by a run that crashed before the unlink
        pass
    except FileNotFoundError:  # moved already
        return None
    except OSError:  # no hard links here (some network shares)
        try:
            os.replace(path, target)
        except FileNotFoundError:
            return None
        return target
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return target


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _watch(folder: Path, loop: asyncio.AbstractEventLoop, on_complete):
    """A watchdog observer that tells ``on_complete`` (on ``loop``) of files closed after writing or renamed in."""
    # watchdog: the `lines` extra, needed only where a folder listens for events
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers import Observer

    class Handler(FileSystemEventHandler):
        def on_closed(self, event) -> None:
            loop.call_soon_threadsafe(on_complete, os.fsdecode(event.src_path))

        def on_moved(self, event) -> None:
            loop.call_soon_threadsafe(on_complete, os.fsdecode(event.dest_path))

    observer = Observer()
    observer.schedule(Handler(), str(folder), recursive=False)
    observer.daemon = True
    observer.start()
    return observer


# ---------------------------------------------------------------------- cameras
class Camera:
    """Frames read on a thread of their own; the chosen ones (every Nth, at a rate, or triggered) are handed to the
    line. A stream that drops is reopened with back-off; a video file ends (or loops)."""

    def __init__(self, config: CameraSource):
        self.config = config
        self.live = not (isinstance(config.device, str) and "://" not in config.device)  # a file is not live
        self.state = "starting"
        self.last_error: str | None = None
        self.frames_read = 0
        self.reconnects = 0
        self._chosen: deque[Picture] = deque()
        self.dropped = 0
        self._triggers: deque[str | None] = deque()
        self._trigger_event = threading.Event()
        self._stop = threading.Event()
        self._available = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._last_taken = 0.0
        self._finished = False  # the reading thread ended (a video's end, or stop)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._read, name="camera", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._trigger_event.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def trigger(self, part: str | None = None) -> int:
        """Score the next frame (trigger mode); thread-safe. Returns the triggers not yet served."""
        self._triggers.append(part)
        self._trigger_event.set()
        return len(self._triggers)

    @property
    def waiting(self) -> int:
        return len(self._chosen)

    def _choose(self, index: int) -> tuple[bool, str | None]:
        mode = self.config.mode
        if mode == "every_nth":
            return index % self.config.every == 0, None
        if mode == "rate":
            now = time.monotonic()
            if now - self._last_taken >= 1.0 / self.config.rate_hz:
                self._last_taken = now
                return True, None
            return False, None
        if self._triggers:
            return True, self._triggers.popleft()
        return False, None

    def _read(self) -> None:  # the camera thread
        backoff = FIRST_BACKOFF_S
        name = str(self.config.device)
        while not self._stop.is_set():
            capture = open_capture(self.config.device)
            if not capture.isOpened():
                capture.release()
                self._down(f"{name} does not open", backoff)
                backoff = min(backoff * 2, self.config.reconnect_max_s)
                continue
            if self.state != "connected":
                log.info("camera connected", extra={"device": name})
            self.state, self.last_error = "connected", None
            backoff = FIRST_BACKOFF_S
            ended = self._frames(capture, name)
            capture.release()
            if self._stop.is_set():
                break
            if ended and not self.live:
                if self.config.loop:
                    continue
                self.state = "ended"
                log.info("video ended", extra={"device": name, "frames": self.frames_read})
                break
            self._down(f"{name} stopped sending frames", backoff)
            backoff = min(backoff * 2, self.config.reconnect_max_s)
        if self.state != "ended":
            self.state = "stopped"
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._over)  # after the frames handed over before it

    def _over(self) -> None:  # on the event loop
        self._finished = True
        self._available.set()

    def _frames(self, capture, name: str) -> bool:
        """Reads until the capture fails or ends (True) or the source stops (False)."""
        while not self._stop.is_set():
            if self.config.mode == "trigger" and not self.live:
                # a file has no time of its own: wait for a trigger, then read the next frame
                while not self._triggers and not self._stop.is_set():
                    self._trigger_event.wait(0.2)
                    self._trigger_event.clear()
                if self._stop.is_set():
                    return False
            if not capture.grab():
                return True
            index = self.frames_read
            self.frames_read += 1
            chosen, part = self._choose(index)
            if not chosen:
                continue
            ok, frame = capture.retrieve()
            if not ok:
                return True
            picture = Picture(f"{name}#{index}", encode_frame(frame), time.time(), part=part)
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._hand_over, picture)
        return False

    def _hand_over(self, picture: Picture) -> None:  # on the event loop
        if len(self._chosen) >= FRAME_QUEUE:
            self._chosen.popleft()
            self.dropped += 1
        self._chosen.append(picture)
        self._available.set()

    def _down(self, why: str, backoff: float) -> None:
        if self.state != "reconnecting":
            log.warning("camera down; reopening with back-off", extra={"device": str(self.config.device), "error": why})
        self.state, self.last_error = "reconnecting", why
        self.reconnects += 1
        self._stop.wait(backoff)

    async def pictures(self):
        while True:
            while not self._chosen:
                if self._finished:
                    return
                self._available.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._available.wait(), 0.5)
            yield self._chosen.popleft()

    def describe(self) -> dict:
        return {
            "type": "camera",
            "state": self.state,
            "device": _public(self.config.device),
            "mode": self.config.mode,
            "frames_read": self.frames_read,
            "reconnects": self.reconnects,
            "dropped": self.dropped,
            "triggers_waiting": len(self._triggers),
            "error": self.last_error,
        }


def _public(device: int | str) -> str:
    """The device without credentials (rtsp://user:password@host/...)."""
    text = str(device)
    if "://" in text and "@" in text.split("://", 1)[1].split("/", 1)[0]:
        scheme, rest = text.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return text
