"""A record's row from what a score answered, and the client's own fields that travel with it."""

from __future__ import annotations

import json
import random
import re
import time

from .store import new_id

#: A field's name: lower-case letters, digits and ``_``, starting with a letter (``part``, ``line``, ``station``).
FIELD_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
MAX_FIELDS = 16
MAX_VALUE = 256
#: The fields a line usually sends (any name that matches :data:`FIELD_NAME` is kept).
KNOWN_FIELDS = ("part", "line", "station", "camera")


class InvalidFields(ValueError):
    """Client fields that are not a small map of names to strings; the message says what is wrong."""


def parse_fields(text: str | None, many: int | None) -> list[dict[str, str]] | dict[str, str]:
    """The client's fields from their JSON (the ``fields`` form field or the ``X-Padim-Fields`` header).

    Args:
        many: ``None`` for one picture (a JSON object), else the number of pictures (an object for all of them,
            or a list of as many objects, in the order of the files).

    Raises:
        InvalidFields: not JSON, not objects of strings, too many or too long, or a list of the wrong length.
    """
    if text is None or text == "":
        return [{} for _ in range(many)] if many is not None else {}
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidFields('fields: not JSON; send an object such as {"part": "A-1234", "line": "3"}') from None
    if many is None:
        return _one(value)
    if isinstance(value, list):
        if len(value) != many:
            raise InvalidFields(f"fields: a list of {len(value)} objects for {many} files; send one per file, in order")
        return [_one(v) for v in value]
    one = _one(value)
    return [dict(one) for _ in range(many)]


def _one(value) -> dict[str, str]:
    if not isinstance(value, dict):
        raise InvalidFields("fields: expected an object of names to strings")
    if len(value) > MAX_FIELDS:
        raise InvalidFields(f"fields: {len(value)} names; at most {MAX_FIELDS}")
    for key, item in value.items():
        if not FIELD_NAME.match(key):
            raise InvalidFields(
                f"fields: name {key!r}: use 1-32 lower-case letters, digits or '_', starting with a letter"
            )
        if not isinstance(item, str) or len(item) > MAX_VALUE:
            raise InvalidFields(f"fields: {key!r} must be a string of at most {MAX_VALUE} characters")
    return dict(value)


def make_row(
    model: str,
    version: int,
    result: dict,
    input_distance: float | None,
    picture: tuple[int, int],
    sha256: str,
    size: int,
    fields: dict[str, str],
    sample: float,
    source: str = "http",
    now: float | None = None,
    key: str | None = None,
) -> dict:
    """The row of one answered picture (JSON-ready: it goes through the journal); ``key``: an idempotency key its id
    is made from (:func:`~.store.new_id`)."""
    now = time.time() if now is None else now
    anomalous = bool(result["is_anomaly"])
    return {
        "id": new_id(now, key),
        "time": now,
        "model": model,
        "version": int(version),
        "raw_score": float(result["raw_score"]),
        "score": float(result["score"]),
        "threshold": float(result["threshold"]),
        "raw_threshold": result.get("raw_threshold"),
        "is_anomaly": anomalous,
        "anomalous_area": float(result["anomalous_area"]),
        "input_distance": None if input_distance is None else float(input_distance),
        "width": int(picture[0]),
        "height": int(picture[1]),
        "sha256": sha256,
        "picture_bytes": int(size),
        "fields": fields,
        "part": fields.get("part"),
        "source": source,
        "sampled": (not anomalous) and random.random() < sample,
    }
