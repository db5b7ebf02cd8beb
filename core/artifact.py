"""The model file: safetensors tensors plus a JSON header. Never a pickle.

The file is in the safetensors format (an 8-byte length, a JSON table of the tensors, then
their bytes; any safetensors reader opens it), and the header lives in its metadata under the
key ``"padim"``. Files are written to a temporary name beside the target and renamed into
place, so an interrupted write leaves the previous file (or none), never half a file.

**Streamed, never copied.** The largest model files (the statistics of wide_resnet50_2 at
224 px are 3.8 GB) are written and read without a second copy in memory: a tensor may be given
as a :class:`TensorStream`, whose chunks are written one after another (the precision factors
come straight from the fit's scratch file, converted to their storage dtype chunk by chunk),
and reading fills each tensor's own memory from the file with ``preadv``: no memory map whose
pages would count twice. Digests are computed on the way, and the header, which holds them, is
written last into space reserved for it.

**Integrity** (format 2): the header carries the sha256 of every tensor's bytes
(``tensor_sha256``) and of the header itself (``header_sha256``, over its canonical JSON
without that key). Loading verifies the header and every tensor it reads, and refuses a
mismatch with a one-line error naming the tensor: one flipped bit in a threshold or a mean
must stop a model, not change its verdicts. Format 1 files (no digests) still load; the
header then says ``"verified": false``.

Example:
    >>> import tempfile, torch, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "m.padim"
    >>> save_artifact(path, {"mean": torch.zeros(2, 3)}, {"backbone": "resnet18"})
    >>> tensors, header = load_artifact(path)
    >>> header["backbone"], tuple(tensors["mean"].shape), header["format_version"], header["verified"]
    ('resnet18', (2, 3), 20, True)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ArtifactError as ArtifactError  # re-exported: raised here

FORMAT_VERSION = 20
#: Header keys added by this module (never part of what the caller saved).
INTEGRITY_KEYS = ("tensor_sha256", "header_sha256", "verified")
HEADER_KEY = "padim"
#: safetensors' names of the dtypes a model file holds.
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPE_OF = {name: dtype for dtype, name in DTYPES.items()}
#: Largest JSON table a file may declare (safetensors' own limit).
MAX_HEADER_BYTES = 100_000_000
#: Bytes read or hashed at a time.
CHUNK_BYTES = 64 * 2**20
#: Bytes written between two requests that the disk write what it was given so far (:class:`_Writeback`).
WRITEBACK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class TensorStream:
    """A tensor given as its chunks, for tensors too large to hold in memory beside the rest.

    Attributes:
        dtype, shape: of the whole tensor.
        chunks: called once when the tensor is written; yields tensors of ``dtype`` whose bytes,
            one after another, are the whole tensor's in row-major order.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


def save_artifact(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor | TensorStream], header: dict) -> None:
    """Write ``tensors`` and ``header`` atomically to ``path``, with their digests.

    Tensors are laid out widest dtype first (so that each starts aligned), then by name.
    """
    path = Path(path)
    entries = {name: t if isinstance(t, TensorStream) else _stream_of(t) for name, t in tensors.items()}
    order = sorted(entries, key=lambda n: (-_itemsize(entries[n].dtype), n))
    table, offset = {}, 0
    for name in order:
        entry = entries[name]
        if entry.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {entry.dtype} cannot be stored")
        table[name] = {
            "dtype": DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    full_header = {k: v for k, v in header.items() if k not in INTEGRITY_KEYS}
    full_header["format_version"] = FORMAT_VERSION
    placeholder = {**full_header, "tensor_sha256": {name: "0" * 64 for name in order}, "header_sha256": "0" * 64}
    reserved = len(_table_bytes(table, placeholder))
    reserved += -(8 + reserved) % 8  # the data starts 8-byte aligned, as safetensors writes it
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.seek(8 + reserved)
            with _Writeback(handle) as writeback:
                digests = {name: _write_stream(handle, name, entries[name], writeback) for name in order}
            full_header["tensor_sha256"] = digests
            full_header["header_sha256"] = _header_sha256(full_header)
            text = _table_bytes(table, full_header)
            if len(text) > reserved:
                raise AssertionError("the header outgrew the space reserved for it")
            handle.seek(0)
            handle.write(reserved.to_bytes(8, "little") + text + b" " * (reserved - len(text)))
            handle.flush()
            os.fsync(handle.fileno())
        # readable by a server running as another user; keep an existing file's mode
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def copy_artifact(
    source: str | os.PathLike,
    target: str | os.PathLike,
    header: dict,
    replaced: Mapping[str, torch.Tensor | None] | None = None,
) -> None:
    """Write ``source``'s tensors (verified on the way) with a new ``header`` to ``target``, atomically.

    The tensors are streamed from one file to the other; ``target`` may be ``source``. ``replaced`` names tensors
    written instead of (or besides) the source's, and with ``None`` those left out.
    """
    source = Path(source)
    table, data_start, old = _model_table(source)
    replaced = replaced or {}
    tensors: dict[str, torch.Tensor | TensorStream] = {
        name: _file_stream(source, table, data_start, name, _expected_digest(source, old, name))
        for name in table
        if name not in replaced
    }
    tensors.update({name: tensor for name, tensor in replaced.items() if tensor is not None})
    save_artifact(target, tensors, header)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored (contiguous, native byte order)."""
    digest = hashlib.sha256()
    digest.update(_bytes_of(tensor.detach().contiguous().cpu()))
    return digest.hexdigest()


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header alone, without reading the tensors."""
    return _open(Path(path), load_tensors=False)[1]


def load_artifact(path: str | os.PathLike, skip_prefixes: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a model file, leaving out tensors whose names start with ``skip_prefixes``.

    Raises:
        ArtifactError: missing, truncated, foreign or newer-format file (one-line message).
    """
    return _open(Path(path), load_tensors=True, skip_prefixes=skip_prefixes)


def tensor_sizes(path: str | os.PathLike) -> dict[str, int]:
    """Bytes of each tensor of a model file, from its table alone (validated, nothing else read).

    Raises:
        ArtifactError: missing, truncated or foreign file.
    """
    table, _, _ = _read_table(Path(path))
    return {
        name: entry["data_offsets"][1] - entry["data_offsets"][0]
        for name, entry in table.items()
        if name != "__metadata__"
    }


@contextlib.contextmanager
def locked_file(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (made when missing): one thread of one process at a time, among all
    processes that open it, also on a shared volume."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------- writing
def _stream_of(tensor: torch.Tensor) -> TensorStream:
    """A tensor in memory as its chunks: views of its flat storage (no copy of a contiguous CPU tensor)."""
    tensor = tensor.detach()

    def chunks():  # a GPU tensor comes to the host a chunk at a time
        flat = tensor.contiguous().reshape(-1)
        step = max(1, CHUNK_BYTES // max(1, flat.element_size()))
        for first in range(0, flat.numel(), step):
            yield flat[first : first + step].cpu()
        if not flat.numel():
            yield flat.cpu()

    return TensorStream(tensor.dtype, tuple(tensor.shape), chunks)


def _write_stream(handle, name: str, entry: TensorStream, writeback: _Writeback) -> str:
    """Write the chunks and return their sha256, hashed while the disk writes (:class:`_Sha256`)."""
    written = 0
    with _Sha256() as digest:
        for chunk in entry.chunks():
            if chunk.dtype != entry.dtype:
                raise ValueError(f"tensor {name!r}: a chunk of {chunk.dtype}, declared {entry.dtype}")
            data = _bytes_of(chunk.detach().contiguous().cpu())
            digest.update(data)
            handle.write(data)
            writeback.wrote(len(data))
            written += len(data)
        hexdigest = digest.hexdigest()
    if written != entry.nbytes:
        raise ValueError(f"tensor {name!r}: {written} bytes written for a declared {entry.nbytes}")
    return hexdigest


class _Writeback:
    """Has the disk write what was written so far (``fdatasync`` on a worker thread) every :data:`WRITEBACK_BYTES`,
    while the caller goes on writing and hashing. On a machine with much memory a file of several GB would otherwise
    wait whole in the page cache and the final ``fsync`` would write all of it after the last byte was hashed
    (measured on a GPU node: 2 of a 4 GB file's 3.7 s). A context manager: errors of a flush are raised, the thread
    ends with it."""

    def __init__(self, handle):
        self._handle, self._since, self._pending = handle, 0, None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="writeback")

    def wrote(self, size: int) -> None:
        self._since += size
        if self._since < WRITEBACK_BYTES or (self._pending is not None and not self._pending.done()):
            return
        self._wait()
        self._handle.flush()
        self._pending = self._pool.submit(_FLUSH, self._handle.fileno())
        self._since = 0

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def __enter__(self) -> _Writeback:
        return self

    def __exit__(self, kind, *rest) -> None:
        try:
            if kind is None:
                self._wait()  # a flush that failed fails the write
        finally:
            self._pool.shutdown(wait=True)  # a write already failing raises its own error, not the flush's


#: ``fdatasync`` where the system has it (Linux), else ``fsync`` (macOS).
_FLUSH = getattr(os, "fdatasync", os.fsync)


class _Sha256:
    """sha256 of pieces fed in order, each hashed on a worker thread while the caller reads or
    writes the next one (hashlib and file I/O both release the GIL). A context manager: the
    thread ends with it."""

    def __init__(self):
        self._digest, self._pending = hashlib.sha256(), None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")

    def update(self, data) -> None:
        self._wait()  # one piece at a time, in order; ``data`` must not change until hashed
        self._pending = self._pool.submit(self._digest.update, data)

    def hexdigest(self) -> str:
        self._wait()
        return self._digest.hexdigest()

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def __enter__(self) -> _Sha256:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)


def _table_bytes(table: dict, header: dict) -> bytes:
    return json.dumps({**table, "__metadata__": {HEADER_KEY: json.dumps(header, sort_keys=True)}}).encode("utf-8")


def _header_sha256(header: dict) -> str:
    rest = {k: v for k, v in header.items() if k not in ("header_sha256", "verified")}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------- reading
def _read_table(path: Path) -> tuple[dict, int, int]:
    """The safetensors table, the file's size and where the tensor data starts (validated)."""
    if not path.exists():
        raise ArtifactError(f"{path}: no such model file")
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory, not a model file")

    def foreign(reason: str) -> ArtifactError:
        return ArtifactError(f"{path}: not a readable padim model file (truncated or foreign: {reason})")

    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise foreign("shorter than a header")
        length = int.from_bytes(prefix, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise foreign("its header length runs past the end of the file")
        raw = handle.read(length)
    try:
        table = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise foreign("its header is not JSON") from None
    if not isinstance(table, dict):
        raise foreign("its header is not a table")
    data_start, end = 8 + length, 0
    spans = []
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = entry["data_offsets"]
            shape, dtype = [int(d) for d in entry["shape"]], DTYPE_OF[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise foreign(f"tensor {name!r} is not described") from None
        if stop - begin != _numel(shape) * _itemsize(dtype):
            raise foreign(f"tensor {name!r} has {stop - begin} bytes for its shape {shape}")
        spans.append((begin, stop))
    for begin, stop in sorted(spans):
        if begin != end:
            raise foreign("its tensors leave gaps or overlap")
        end = stop
    if data_start + end != size:
        raise foreign(f"{size} bytes, its header declares {data_start + end}")
    return table, size, data_start


def _file_stream(path: Path, table: dict, data_start: int, name: str, expected: str | None) -> TensorStream:
    """A tensor of a model file as chunks read from it, checked against its digest (``expected``) at the end."""
    entry = table[name]
    dtype, shape = DTYPE_OF[entry["dtype"]], tuple(entry["shape"])
    begin, stop = entry["data_offsets"]

    def chunks():
        itemsize = _itemsize(dtype)
        step = max(1, CHUNK_BYTES // itemsize)
        with open(path, "rb") as handle, _Sha256() as digest:
            for first in range(0, (stop - begin) // itemsize, step):
                count = min(step, (stop - begin) // itemsize - first)
                out = torch.empty(count, dtype=dtype)
                _read_into(
                    handle.fileno(),
                    out,
                    data_start + begin + first * itemsize,
                    path,
                    digest if expected is not None else None,
                )
                yield out
            if expected is not None:
                _check_digest(path, name, digest.hexdigest(), expected)

    return TensorStream(dtype, shape, chunks)


def _model_table(path: Path) -> tuple[dict, int, dict]:
    """The tensor table (``__metadata__`` left out), where the tensor data starts, and the padim header."""
    table, _, data_start = _read_table(path)
    metadata = table.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or HEADER_KEY not in metadata:
        raise ArtifactError(f"{path}: a safetensors file, but not a padim model")
    return table, data_start, _parse_header(path, metadata[HEADER_KEY])


def _expected_digest(path: Path, header: dict, name: str) -> str | None:
    """The sha256 the header gives tensor ``name`` (``None`` for an unverified format-1 file)."""
    if not header["verified"]:
        return None
    if name not in header["tensor_sha256"]:
        raise ArtifactError(f"{path}: tensor {name!r} has no digest in the header; the file was altered")
    return header["tensor_sha256"][name]


def _check_digest(path: Path, name: str, got: str, expected: str) -> None:
    if got != expected:
        raise ArtifactError(
            f"{path}: tensor {name!r} does not match its digest; the file is damaged (copy it again, or retrain)"
        )


def _open(path: Path, load_tensors: bool, skip_prefixes: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    table, data_start, header = _model_table(path)
    tensors: dict[str, torch.Tensor] = {}
    if not load_tensors:
        return tensors, header
    with open(path, "rb") as handle:
        for name, entry in table.items():
            if name.startswith(skip_prefixes):
                continue
            expected = _expected_digest(path, header, name)
            out = torch.empty([int(d) for d in entry["shape"]], dtype=DTYPE_OF[entry["dtype"]])
            with _Sha256() as digest:
                _read_into(
                    handle.fileno(),
                    out,
                    data_start + entry["data_offsets"][0],
                    path,
                    digest if expected is not None else None,
                )
                if expected is not None:
                    _check_digest(path, name, digest.hexdigest(), expected)
            tensors[name] = out
    return tensors, header


def _read_into(fd: int, out: torch.Tensor, offset: int, path: Path, digest: _Sha256 | None = None) -> None:
    """Fill ``out`` from the file at ``offset``, each chunk read fed to ``digest`` (hashed while the next is read)."""
    view, done = _bytes_of(out), 0
    while done < len(view):
        got = os.preadv(fd, [view[done : done + CHUNK_BYTES]], offset + done)
        if got <= 0:
            raise ArtifactError(f"{path}: not a readable padim model file (truncated or foreign: it ends early)")
        if digest is not None:
            digest.update(view[done : done + got])
        done += got


def _parse_header(path: Path, text: str) -> dict:
    try:
        header = json.loads(text)
    except (TypeError, json.JSONDecodeError):
        raise ArtifactError(f"{path}: the model header is not valid JSON; the file is damaged") from None
    version = header.get("format_version") if isinstance(header, dict) else None
    if not isinstance(version, int):
        raise ArtifactError(f"{path}: the model header has no format version")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: written in model format {version}, this padim reads format "
            f"{FORMAT_VERSION} and older; upgrade padim to load it"
        )
    if version >= 2:
        if not isinstance(header.get("tensor_sha256"), dict) or header.get("header_sha256") != _header_sha256(header):
            raise ArtifactError(
                f"{path}: the model header does not match its digest; the file is damaged (copy it again, or retrain)"
            )
    header["verified"] = version >= 2
    return header


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _numel(shape) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
