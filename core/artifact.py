"""The model file: safetensors tensors plus a JSON header. Never a pickle.

The header lives in the safetensors metadata under the key ``"padim"``. Files are written to a
temporary name beside the target and renamed into place, so an interrupted write leaves the
previous file (or none), never half a file.

Example:
    >>> import tempfile, torch, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "m.padim"
    >>> save_artifact(path, {"mean": torch.zeros(2, 3)}, {"backbone": "resnet18"})
    >>> tensors, header = load_artifact(path)
    >>> header["backbone"], tuple(tensors["mean"].shape), header["format_version"]
    ('resnet18', (2, 3), 1)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

FORMAT_VERSION = 1
HEADER_KEY = "padim"


class ArtifactError(Exception):
    """A model file that cannot be used; the message is one line meant for the user."""


def save_artifact(path: str | os.PathLike, tensors: dict[str, torch.Tensor], header: dict) -> None:
    """Write ``tensors`` and ``header`` atomically to ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    full_header = {"format_version": FORMAT_VERSION, **header}
    metadata = {HEADER_KEY: json.dumps(full_header, sort_keys=True)}
    payload = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
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
    return tensors, header


def _parse_header(path: Path, text: str) -> dict:
    try:
        header = json.loads(text)
    except json.JSONDecodeError:
        raise ArtifactError(f"{path}: the model header is not valid JSON") from None
    version = header.get("format_version") if isinstance(header, dict) else None
    if not isinstance(version, int):
        raise ArtifactError(f"{path}: the model header has no format version")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: written in model format {version}, this padim reads format "
            f"{FORMAT_VERSION} and older; upgrade padim to load it"
        )
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
