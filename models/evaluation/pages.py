"""What the HTML reports share (``padim evaluate --report``, ``padim drift --report``): their Jinja2
templates (each extends ``page.html``: the look, the head), images as data URIs, atomic writes."""

from __future__ import annotations

import base64
import os
import tempfile
from pathlib import Path

import jinja2

#: The templates beside this module (values are HTML-escaped by the template).
TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("padim.models.evaluation", "."), autoescape=True, undefined=jinja2.StrictUndefined
)


def data_uri(data: bytes, mime: str) -> str:
    """``data`` embedded in the page, so that it opens offline and can be mailed."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder (never half a file)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # as an ordinary file, not mkstemp's 0600
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
