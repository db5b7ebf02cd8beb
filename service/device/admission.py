"""The queue bound: images admitted per model and not yet answered, across every process of the service.

A request takes its places before its pictures are decoded (:meth:`Places.admit`), so an overloaded service answers
503 ``overloaded`` at once instead of decoding what it cannot score; it gives them back when it is answered, failed
or abandoned. While an image is being decoded it also counts as *arriving*: the scheduler waits for images on their
way rather than sending a batch that is about to grow (:mod:`padim.service.device.batching`).

:class:`LocalPlaces` counts in one process. :class:`SharedPlaces` counts in shared memory for the API processes and
the scoring process of one service (:mod:`padim.service.processes`): a row a process, each row written by its own
process only, and a check and take made under a file lock, so the bound holds across processes, and a process that
dies takes its row with it (its replacement starts the row at zero).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from ..edge.errors import ApiError


class Places(Protocol):
    """Images admitted per model: held (admitted and not yet answered) and arriving (admitted, not yet queued)."""

    max_queue: int

    def admit(self, model: str, count: int) -> Admission:
        """Take ``count`` places of ``model`` before decoding.

        Raises:
            ApiError: 503 ``overloaded`` (with ``Retry-After``) when the model has no room now.
        """

    def held(self, model: str) -> int:
        """Places of ``model`` taken, by every process."""

    def arriving(self, model: str) -> int:
        """Images of ``model`` admitted and not yet queued for the device, by every process."""

    def adjust(self, model: str, held: int, arriving: int) -> None:
        """Add to this process's counts (its own row)."""


def overloaded(held: int, max_queue: int) -> ApiError:
    return ApiError(
        "overloaded",
        f"the queue is full ({held} of {max_queue} places taken); retry shortly",
        headers={"Retry-After": "1"},
    )


class Admission:
    """The places one request took; :meth:`queued` says some of its images reached the device's queue, and leaving
    the ``with`` block (answered, failed, abandoned) gives every place back."""

    def __init__(self, places: Places, model: str, count: int):
        self.places, self.model, self.count = places, model, count
        self.arriving = count

    def queued(self, count: int) -> None:
        count = min(count, self.arriving)
        self.arriving -= count
        self.places.adjust(self.model, 0, -count)

    def release(self) -> None:
        if self.count:
            self.places.adjust(self.model, -self.count, -self.arriving)
            self.count = self.arriving = 0

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class LocalPlaces:
    """The places of a service that runs in one process."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self._counts: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def admit(self, model: str, count: int) -> Admission:
        with self._lock:
            counts = self._counts.setdefault(model, [0, 0])
            if counts[0] + count > self.max_queue:
                raise overloaded(counts[0], self.max_queue)
            counts[0] += count
            counts[1] += count
        return Admission(self, model, count)

    def held(self, model: str) -> int:
        return self._counts.get(model, [0, 0])[0]

    def arriving(self, model: str) -> int:
        return self._counts.get(model, [0, 0])[1]

    def adjust(self, model: str, held: int, arriving: int) -> None:
        with self._lock:
            counts = self._counts.setdefault(model, [0, 0])
            counts[0] += held
            counts[1] += arriving


#: Models a shared table can count (a model served after this many is refused at load).
MAX_MODELS = 256
_CELL = struct.Struct("<qq")  # held, arriving


class SharedPlaces:
    """The places of a service in several processes: ``rows`` rows of :data:`MAX_MODELS` cells in the file ``path``
    (shared memory), this process writing row ``row``; model names to cells through ``index`` (the scoring process
    numbers models, :mod:`padim.service.processes.shared`).

    Reads of other rows take no lock: a count read while it changes is off by that change, which the next read sees.
    """

    def __init__(self, path: Path, rows: int, row: int, max_queue: int, index):
        self.max_queue, self.rows, self.row, self.index = max_queue, rows, row, index
        self._file = open(path, "r+b")  # noqa: SIM115 - held for the process's life
        self._map = mmap.mmap(self._file.fileno(), rows * MAX_MODELS * _CELL.size)
        self._lock_file = open(str(path) + ".lock", "a+b")  # noqa: SIM115
        self._thread_lock = threading.Lock()

    @staticmethod
    def create(path: Path, rows: int) -> None:
        """A zeroed table for ``rows`` processes (by the supervisor, before any process starts)."""
        with open(path, "wb") as handle:
            handle.truncate(rows * MAX_MODELS * _CELL.size)
        Path(str(path) + ".lock").touch()

    def _offset(self, row: int, cell: int) -> int:
        return (row * MAX_MODELS + cell) * _CELL.size

    def _total(self, cell: int) -> tuple[int, int]:
        held = arriving = 0
        for row in range(self.rows):
            h, a = _CELL.unpack_from(self._map, self._offset(row, cell))
            held += h
            arriving += a
        return held, arriving

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_file, fcntl.LOCK_UN)

    def admit(self, model: str, count: int) -> Admission:
        cell = self.index(model)
        with self._locked():
            held, _ = self._total(cell)
            if held + count > self.max_queue:
                raise overloaded(held, self.max_queue)
            self._add(cell, count, count)
        return Admission(self, model, count)

    def held(self, model: str) -> int:
        return self._total(self.index(model))[0]

    def arriving(self, model: str) -> int:
        return self._total(self.index(model))[1]

    def adjust(self, model: str, held: int, arriving: int) -> None:
        with self._thread_lock:  # this process's row: its own threads only
            self._add(self.index(model), held, arriving)

    def _add(self, cell: int, held: int, arriving: int) -> None:
        offset = self._offset(self.row, cell)
        h, a = _CELL.unpack_from(self._map, offset)
        _CELL.pack_into(self._map, offset, h + held, a + arriving)

    def reset_row(self, row: int) -> None:
        """Zero ``row``: a process starting in a row whose previous owner died (its places went with it)."""
        with self._locked():
            self._map[self._offset(row, 0) : self._offset(row + 1, 0)] = bytes(MAX_MODELS * _CELL.size)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        self._file.close()
        self._lock_file.close()
