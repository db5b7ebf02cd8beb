"""Tensors parked during a fit: the embeddings of pass 1 (on disk, or in a GPU's memory where they fit there),
the factors before they are saved (on disk).

A fit reads every image through the backbone once. Its embeddings are kept, float32 as they
were accumulated, in an :class:`EmbeddingSpool` so that the calibration can use them again
after the precision factors exist, slice of pixels by slice of pixels. The factors themselves
are written to a :class:`ScratchFile` as they are derived, so that the model file can be
written without holding them and the statistics in memory at once.

Both live in an *unlinked* temporary file: it has no name from the moment it is made, so its
disk space is given back when the process ends, however it ends (an error, Ctrl-C, a kill),
and nothing is left behind. It is read and written with ``pread``/``pwrite`` (never mapped
into memory), so its pages count against the page cache, not the process's memory.

Example:
    >>> import tempfile, torch
    >>> spool = EmbeddingSpool(tempfile.gettempdir(), capacity=4, pixels=5, dim=3, slice_pixels=2)
    >>> x = torch.randn(3, 5, 3)                                  # (B, P, D)
    >>> spool.append(x)
    range(0, 3)
    >>> torch.equal(spool.read(2, 1, 3), x[1:3, 4:5])             # slice 2 holds pixel 4
    True
    >>> spool.close()
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

#: The largest float16 (a value beyond it would be kept as infinity).
_HALF_MAX = torch.finfo(torch.float16).max


class ScratchFile:
    """An unlinked temporary file of tensors at byte offsets.

    Args:
        directory: where to make it (its file system holds the data).
        prefix: for the (short-lived) name, as ``ls`` would show it while it is being made.
    """

    def __init__(self, directory: str | os.PathLike, prefix: str = ".padim-scratch-"):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
        os.unlink(name)  # nameless from now on: the space is freed when fd closes, however the process ends
        self.fd: int | None = fd
        self.directory = directory
        self.nbytes = 0  # the highest byte written

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s bytes (made contiguous on the CPU) at ``offset``."""
        data = _bytes_of(tensor.detach().to("cpu").contiguous())
        written = 0
        while written < len(data):
            written += os.pwrite(self._fd(), data[written:], offset + written)
        self.nbytes = max(self.nbytes, offset + len(data))

    def read(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new CPU tensor of ``shape`` and ``dtype`` read from ``offset``."""
        out = torch.empty(shape, dtype=dtype)
        view = _bytes_of(out)
        done = 0
        while done < len(view):
            got = os.preadv(self._fd(), [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"scratch file in {self.directory} ended at byte {offset + done}")
            done += got
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError("the scratch file is closed")
        return self.fd

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class EmbeddingSpool:
    """``(rows, P, D)`` float32 embeddings, appended batch by batch and read a slice of pixels at a time.

    On disk (the default), the file is laid out slice by slice: slice ``s`` (pixels ``s * c .. (s + 1) * c``) holds
    every row's ``(c, D)`` block, row after row, so one slice of consecutive rows is one
    contiguous read. Space for ``capacity`` rows is reserved (sparsely: unwritten rows use no
    disk).

    In a device's memory (``device``: a fit on a GPU whose memory holds the spool beside the rest of the fit), the
    rows wait in one ``(capacity, P, D)`` tensor there, allocated at once: a batch is appended without a copy to
    the host and read back without the disk; reads are views of it, read-only to the caller.

    ``dtype`` ``float16`` keeps the rows in half the bytes (reads give them back as float32, rounded to float16's
    11 significant bits): for rows that are already an approximation, as the int8 backbone's are. A batch with a
    value beyond float16's range widens the spool to float32 first (the rows so far copied over, exactly), so
    nothing is clipped.

    Args:
        directory: where the file is made (unused in a device's memory).
        capacity: most rows that will be appended.
        pixels, dim: ``P`` and ``D``.
        slice_pixels: ``c``, pixels per slice (the last slice may be shorter).
        device: hold the rows in this device's memory instead of a file.
        dtype: how the rows are kept: ``float32`` (as given) or ``float16``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity: int,
        pixels: int,
        dim: int,
        slice_pixels: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"a spool keeps float32 or float16 rows, not {dtype}")
        self.held: torch.Tensor | None = None
        self.file: ScratchFile | None = None
        self.directory, self.dtype = directory, dtype
        if device is not None:
            self.held = torch.empty(capacity, pixels, dim, dtype=dtype, device=device)
        else:
            self.file = ScratchFile(directory, prefix=".padim-embeddings-")
        self.capacity, self.pixels, self.dim = capacity, pixels, dim
        self.slice_pixels = max(1, min(slice_pixels, pixels))
        self.rows = 0

    @staticmethod
    def size(rows: int, pixels: int, dim: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes that ``rows`` rows take on disk."""
        return rows * pixels * dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes written so far."""
        return self.size(self.rows, self.pixels, self.dim, self.dtype)

    @property
    def slices(self) -> list[tuple[int, int]]:
        """``(start, stop)`` pixels of every slice."""
        return [(p, min(p + self.slice_pixels, self.pixels)) for p in range(0, self.pixels, self.slice_pixels)]

    def append(self, batch: torch.Tensor) -> range:
        """Add ``(B, P, D)`` embeddings as the next ``B`` rows; returns their row numbers."""
        count = batch.shape[0]
        if batch.shape[1:] != (self.pixels, self.dim):
            raise ValueError(
                f"cannot spool a batch of shape {tuple(batch.shape)} with (P, D)=({self.pixels}, {self.dim})"
            )
        if self.rows + count > self.capacity:
            raise ValueError(f"the spool holds {self.capacity} rows; {self.rows + count} were given")
        batch = batch.detach()
        if self.dtype == torch.float16 and count and not bool(batch.abs().amax() <= _HALF_MAX):
            self._widen()
        if self.held is not None:
            self.held[self.rows : self.rows + count].copy_(batch)
        else:
            assert self.file is not None, "a spool is held in memory or on disk"
            batch = batch.to("cpu", self.dtype)
            for index, (start, stop) in enumerate(self.slices):
                self.file.write(self._offset(index, self.rows), batch[:, start:stop])
        rows = range(self.rows, self.rows + count)
        self.rows += count
        return rows

    def read(self, index: int, first: int, stop: int) -> torch.Tensor:
        """Rows ``first .. stop`` of slice ``index``: ``(stop - first, c, D)`` float32 on the CPU (a spool on disk) or
        on their device (a view of the rows, not to be written to, where they are kept in float32)."""
        if not 0 <= first <= stop <= self.rows:
            raise ValueError(f"rows {first}..{stop} are not in the spool's {self.rows}")
        start, end = self.slices[index]
        if self.held is not None:
            return self.held[first:stop, start:end].float()  # float32 rows: the view itself
        assert self.file is not None, "a spool is held in memory or on disk"
        return self.file.read(self._offset(index, first), (stop - first, end - start, self.dim), self.dtype).float()

    def _offset(self, index: int, row: int, dtype: torch.dtype | None = None) -> int:
        start, stop = self.slices[index]
        return (dtype or self.dtype).itemsize * self.dim * (self.capacity * start + row * (stop - start))

    def _widen(self) -> None:
        """Keep the rows in float32 from now on: those so far copied over (float16 widens exactly), slice by slice."""
        if self.held is not None:
            self.held = self.held.float()
        else:
            assert self.file is not None, "a spool is held in memory or on disk"
            old, new = self.file, ScratchFile(self.directory, prefix=".padim-embeddings-")
            with old:
                for index, (start, stop) in enumerate(self.slices):
                    shape = (self.rows, stop - start, self.dim)
                    rows = old.read(self._offset(index, 0), shape, self.dtype)
                    new.write(self._offset(index, 0, torch.float32), rows.float())
            self.file = new
        self.dtype = torch.float32

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.held = None  # the device's memory is given back with the last view

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def free_disk(directory: str | os.PathLike) -> int:
    """Bytes free for this user in ``directory``'s file system (its nearest existing parent)."""
    path = Path(directory).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")
