"""The model file: safetensors tensors plus a JSON header. Never a pickle.

The header lives in the safetensors metadata under the key ``"padim"``. Files are written to a
temporary name beside the target and renamed into place, so an interrupted write leaves the
previous file (or none), never half a file.

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
    ('resnet18', (2, 3), 2, True)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

FORMAT_VERSION = 2
#: Header keys added by this module (never part of what the caller saved).
INTEGRITY_KEYS = ("tensor_sha256", "header_sha256", "verified")
HEADER_KEY = "padim"


class ArtifactError(Exception):
    """A model file that cannot be used; the message is one line meant for the user."""


def save_artifact(path: str | os.PathLike, tensors: dict[str, torch.Tensor], header: dict) -> None:
    """Write ``tensors`` and ``header`` atomically to ``path``, with their digests."""
    from safetensors.torch import save_file

    path = Path(path)
    payload = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    full_header = {k: v for k, v in header.items() if k not in INTEGRITY_KEYS}
    full_header["format_version"] = FORMAT_VERSION
    full_header["tensor_sha256"] = {name: tensor_sha256(t) for name, t in payload.items()}
    full_header["header_sha256"] = _header_sha256(full_header)
    metadata = {HEADER_KEY: json.dumps(full_header, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(payload, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        # readable by a server running as another user; keep an existing file's mode
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes as stored (contiguous, native byte order)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest() if flat.numel() else hashlib.sha256(b"").hexdigest()


def _header_sha256(header: dict) -> str:
    rest = {k: v for k, v in header.items() if k not in ("header_sha256", "verified")}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode("utf-8")).hexdigest()


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header alone, without reading the tensors."""
    return _open(Path(path), load_tensors=False)[1]


def load_artifact(path: str | os.PathLike, skip_prefixes: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a model file, leaving out tensors whose names start with ``skip_prefixes``.

    Raises:
        ArtifactError: missing, truncated, foreign or newer-format file (one-line message).
    """
    return _open(Path(path), load_tensors=True, skip_prefixes=skip_prefixes)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _open(path: Path, load_tensors: bool, skip_prefixes: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        raise ArtifactError(f"{path}: no such model file")
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory, not a model file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if HEADER_KEY not in metadata:
                raise ArtifactError(f"{path}: a safetensors file, but not a padim model")
            header = _parse_header(path, metadata[HEADER_KEY])
            keys = [k for k in handle.keys() if not k.startswith(skip_prefixes)] if load_tensors else []
            tensors = {k: handle.get_tensor(k) for k in keys}
    except ArtifactError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ArtifactError(
            f"{path}: not a readable padim model file (truncated or foreign: {reason})"
        ) from None
    if header["verified"]:
        digests = header["tensor_sha256"]
        for name, tensor in tensors.items():
            if name not in digests:
                raise ArtifactError(f"{path}: tensor {name!r} has no digest in the header; the file was altered")
            if tensor_sha256(tensor) != digests[name]:
                raise ArtifactError(f"{path}: tensor {name!r} does not match its digest; the file is damaged "
                                    "(copy it again, or retrain)")
    return tensors, header


def _parse_header(path: Path, text: str) -> dict:
    try:
        header = json.loads(text)
    except json.JSONDecodeError:
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
            raise ArtifactError(f"{path}: the model header does not match its digest; the file is damaged "
                                "(copy it again, or retrain)")
    header["verified"] = version >= 2
    return header


def pack_lower(matrices: torch.Tensor) -> torch.Tensor:
    """Lower triangle (diagonal included) of ``(P, D, D)`` as ``(P, D (D + 1) / 2)``."""
    dim = matrices.shape[-1]
    rows, cols = torch.tril_indices(dim, dim, device=matrices.device)
    return matrices[:, rows, cols]


def unpack_lower(packed: torch.Tensor, dim: int, symmetric: bool = False) -> torch.Tensor:
    """Inverse of :func:`pack_lower`: lower-triangular, or symmetric if ``symmetric``."""
    rows, cols = torch.tril_indices(dim, dim, device=packed.device)
    full = packed.new_zeros(packed.shape[0], dim, dim)
    full[:, rows, cols] = packed
    if symmetric:
        full[:, cols, rows] = packed
    return full
