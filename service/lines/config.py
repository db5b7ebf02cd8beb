"""``lines.yaml``: the lines a service runs, each a source, a model and its sinks (docs/lines.md).

The file is read whole and checked before anything starts; a mistake is one line that names the line and the
field (``lines.yaml: line 'press-3': source.path: folder /data/in does not exist``), never a traceback.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from padim.models.errors import ConfigError

from .capture import open_capture

#: A line's name: it is a metric label, an MQTT topic level and a file name.
LINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: What a hot folder takes by default (Pillow decodes each).
PICTURE_PATTERNS = ("*.png", "*.jpg", "*.jpeg", "*.bmp", "*.tif", "*.tiff", "*.webp")
#: What a verdict message holds; an OPC UA sink maps some of these to nodes.
MESSAGE_FIELDS = (
    "id",
    "line",
    "station",
    "camera",
    "part",
    "model",
    "version",
    "score",
    "raw_score",
    "is_anomaly",
    "verdict",
    "threshold",
    "anomalous_area",
    "time",
    "source",
    "sha256",
    "heatmap",
    "latency_ms",
)


class LineConfigError(ConfigError):
    """``lines.yaml`` is wrong: the message names the file, the line and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FolderSource(_Strict):
    """New picture files in a folder (a local disk or a network share)."""

    type: Literal["folder"]
    path: Path = Field(description="the folder the camera software writes into (relative: to the lines file's folder)")
    patterns: tuple[str, ...] = Field(PICTURE_PATTERNS, description="file names taken (glob, case-insensitive)")
    settle_s: float = Field(
        0.5,
        ge=0,
        description="a file whose size and time have not changed for this long is complete; a file closed "
        "after writing (Linux inotify) or renamed into the folder is taken at once",
    )
    poll_s: float = Field(1.0, gt=0, description="look at the folder this often (network shares send no events)")
    events: bool = Field(True, description="also listen for file-system events (watchdog) to take files sooner")
    after: Literal["move", "leave"] = Field(
        "move", description="move: to done/ or flagged/ once its verdict is journaled; leave: where it is"
    )
    done: Path | None = Field(None, description="where normal pictures go (default PATH/done)")
    flagged: Path | None = Field(None, description="where anomalous pictures go (default PATH/flagged)")
    rejected: Path | None = Field(
        None, description="undecodable pictures, with NAME.reason.txt (default PATH/rejected)"
    )
    part_from_name: bool = Field(True, description="the file's name without its suffix is the part id")

    def folder(self, which: str) -> Path:
        return getattr(self, which) or self.path / which


class MqttConnection(_Strict):
    host: str
    port: int = Field(1883, ge=1, le=65535)
    username: str | None = None
    password_env: str | None = Field(None, description="the environment variable that holds the password")
    tls: bool = False
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    keepalive_s: int = Field(30, ge=5)

    def password(self) -> str | None:
        return os.environ.get(self.password_env) if self.password_env else None


class MqttTrigger(MqttConnection):
    topic: str = Field(
        description="a message on this topic scores the next frame (its payload, if any, is the part id)"
    )


class CameraSource(_Strict):
    """Frames from a USB camera (an index), an RTSP or HTTP (MJPEG) stream, or a video file (OpenCV)."""

    type: Literal["camera"]
    device: int | str = Field(description="a camera index (0), a stream URL (rtsp://, http://) or a video file")
    mode: Literal["every_nth", "rate", "trigger"] = Field(
        "rate",
        description="every_nth: every Nth frame; rate: at most rate_hz frames a second; trigger: the next "
        "frame after a trigger (POST /lines/{name}/trigger, or an MQTT message)",
    )
    every: int = Field(1, ge=1, description="every_nth: score one frame in this many")
    rate_hz: float = Field(2.0, gt=0, description="rate: frames scored per second")
    trigger: MqttTrigger | None = Field(None, description="trigger mode: an MQTT topic that triggers")
    loop: bool = Field(False, description="a video file starts again at its end (else the source ends)")
    reconnect_max_s: float = Field(10.0, gt=0, description="longest wait between tries to reopen a dropped stream")


class MqttSink(MqttConnection):
    type: Literal["mqtt"]
    topic: str | None = Field(
        None, description="default padim/LINE/verdicts; the latest is also kept, retained, on TOPIC/last"
    )
    qos: Literal[0, 1, 2] = 1


class WebhookSink(_Strict):
    type: Literal["webhook"]
    url: str = Field(description="http:// or https:// URL that is POSTed each verdict (JSON)")
    secret_env: str | None = Field(
        None, description="environment variable with the HMAC-SHA256 key (X-Padim-Signature)"
    )
    timeout_s: float = Field(5.0, gt=0)
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        return url


class OpcUaSink(_Strict):
    """Writes each verdict to nodes of an OPC UA server (a PLC's)."""

    type: Literal["opcua"]
    endpoint: str = Field(description="opc.tcp://HOST:PORT/PATH")
    nodes: dict[str, str] = Field(description="message field -> node id, e.g. is_anomaly: ns=2;s=Line3.Reject")
    username: str | None = None
    password_env: str | None = None
    timeout_s: float = Field(5.0, gt=0)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, endpoint: str) -> str:
        if not endpoint.startswith("opc.tcp://"):
            raise ValueError(f"{endpoint!r} is not an opc.tcp:// endpoint")
        return endpoint

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, nodes: dict[str, str]) -> dict[str, str]:
        if not nodes:
            raise ValueError("name at least one node, e.g. is_anomaly: ns=2;s=Line3.Reject")
        unknown = sorted(set(nodes) - set(MESSAGE_FIELDS))
        if unknown:
            raise ValueError(f"unknown message field {unknown[0]!r}; one of {', '.join(MESSAGE_FIELDS)}")
        for node in nodes.values():
            if not re.match(r"^(ns=\d+;)?[isgb]=.+$", node):
                raise ValueError(f"{node!r} is not a node id (ns=2;s=Name or ns=2;i=1001)")
        return nodes


Source = Annotated[FolderSource | CameraSource, Field(discriminator="type")]
Sink = Annotated[MqttSink | WebhookSink | OpcUaSink, Field(discriminator="type")]


class Outbox(_Strict):
    max_messages: int = Field(100_000, ge=1, description="verdicts a sink's outbox holds at most")
    when_full: Literal["block", "drop_oldest"] = Field(
        "block", description="block: the line takes no picture until there is room; drop_oldest: the oldest goes"
    )


class Line(_Strict):
    name: str
    model: str | None = Field(None, description="the served model that scores it (default: the default model)")
    station: str | None = None
    camera: str | None = None
    threshold: float | None = Field(None, ge=0, le=1, description="a threshold of its own on the score scale")
    latency_budget_ms: float = Field(500.0, gt=0, description="a picture seen to delivered later than this is late")
    heatmaps: bool = Field(False, description="write each picture's heat map (PNG) and put its path in the message")
    max_in_flight: int = Field(8, ge=1, le=256, description="pictures of this line being scored at once")
    source: Source
    sinks: tuple[Sink, ...] = ()
    outbox: Outbox = Outbox()

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not LINE_NAME.match(name):
            raise ValueError(f"{name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")
        return name

    @model_validator(mode="after")
    def _trigger(self) -> Line:
        source = self.source
        if isinstance(source, CameraSource) and source.trigger is not None and source.mode != "trigger":
            raise ValueError("source.trigger is for mode: trigger")
        return self

    def sink_names(self) -> list[str]:
        """``mqtt``, ``webhook``, ``opcua`` (``mqtt-2`` for a second of a kind): outbox and metric labels."""
        names: list[str] = []
        seen: dict[str, int] = {}
        for sink in self.sinks:
            seen[sink.type] = seen.get(sink.type, 0) + 1
            names.append(sink.type if seen[sink.type] == 1 else f"{sink.type}-{seen[sink.type]}")
        return names


class LinesFile(_Strict):
    state_dir: Path | None = Field(None, description="journals and outboxes (default: padim-lines/ beside the file)")
    lines: tuple[Line, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> LinesFile:
        names = [line.name for line in self.lines]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"line {twice[0]!r} is named twice")
        return self


def read_lines(path: Path) -> tuple[LinesFile, Path]:
    """The file's lines and their state folder.

    Raises:
        LineConfigError: not readable, not YAML, or not what docs/lines.md describes.
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as error:
        raise LineConfigError(f"{path}: cannot be read ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        raise LineConfigError(f"{path}: not YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise LineConfigError(f"{path}: expected a mapping with 'lines:' (docs/lines.md)")
    try:
        lines = LinesFile.model_validate(raw)
    except ValidationError as error:
        raise LineConfigError(_message(path, raw, error)) from None
    base = path.resolve().parent
    lines = _anchored(lines, base)
    return lines, lines.state_dir or base / "padim-lines"


def _anchored(model: BaseModel, base: Path):
    """``model`` with every relative path in it (folders, video files, certificates) taken from ``base``: the
    lines file's folder, whatever the service's working directory."""
    update: dict = {}
    for name, value in model:
        if isinstance(value, Path) and not value.is_absolute():
            update[name] = base / value
        elif isinstance(value, BaseModel):
            update[name] = _anchored(value, base)
        elif isinstance(value, tuple) and value and isinstance(value[0], BaseModel):
            update[name] = tuple(_anchored(v, base) for v in value)
        elif name == "device" and isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            update[name] = str(base / value)  # a video file
    return model.model_copy(update=update) if update else model


def _message(path: Path, raw: dict, error: ValidationError) -> str:
    first = error.errors()[0]
    loc = list(first["loc"])
    where = f"{path}: "
    if len(loc) >= 2 and loc[0] == "lines" and isinstance(loc[1], int):
        items = raw.get("lines") or []
        item = items[loc[1]] if loc[1] < len(items) else None
        name = item.get("name") if isinstance(item, dict) else None
        where += f"line {name!r}: " if name else f"line {loc[1] + 1}: "
        loc = loc[2:]
    # a tagged union puts the tag in the path (source.folder.path): leave it out
    if len(loc) >= 2 and loc[0] == "source" and loc[1] in ("folder", "camera"):
        loc = [loc[0], *loc[2:]]
    if len(loc) >= 2 and loc[0] == "sinks" and isinstance(loc[1], int):
        loc = [f"sinks[{loc[1]}]", *loc[2 + (len(loc) > 2 and loc[2] in ("mqtt", "webhook", "opcua")) :]]
    field = ".".join(str(p) for p in loc)
    message = first["msg"].removeprefix("Value error, ")
    given = first.get("input")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif first["type"] == "too_short" and loc == ["lines"]:
        message = "no line: name at least one"
    elif first["type"] == "union_tag_invalid":
        given = first.get("ctx", {}).get("tag", given)
        message = (
            f"type {given!r}: expected folder or camera"
            if loc[:1] == ["source"]
            else f"type {given!r}: expected mqtt, webhook or opcua"
        )
    return where + (f"{field}: " if field else "") + message


def check_lines(lines: LinesFile, models: list[str], default: str | None, path: Path) -> None:
    """What the schema cannot see: models served, folders there, secrets set, hosts that resolve, cameras that open.

    A broker or webhook that refuses connections now is not an error (its verdicts wait in the outbox); a host name
    that does not resolve is.

    Raises:
        LineConfigError: naming the line and the field.
    """
    for line in lines.lines:
        where = f"{path}: line {line.name!r}: "
        if line.model is None and default is None:
            raise LineConfigError(where + "model: no default model is served; name one")
        if line.model is not None and line.model not in models:
            raise LineConfigError(
                where + f"model: no model named {line.model!r}; served: {', '.join(models) or 'none'}"
            )
        source = line.source
        if isinstance(source, FolderSource):
            if not source.path.is_dir():
                raise LineConfigError(where + f"source.path: folder {source.path} does not exist")
        else:
            if source.mode == "trigger" and source.trigger is not None:
                _check_host(where + "source.trigger", source.trigger)
            _check_camera(where, source)
        for index, sink in enumerate(line.sinks):
            field = f"sinks[{index}]"
            if isinstance(sink, MqttSink):
                _check_host(where + field, sink)
            elif isinstance(sink, WebhookSink) and sink.secret_env and sink.secret_env not in os.environ:
                raise LineConfigError(where + f"{field}.secret_env: {sink.secret_env} is not set")
            elif isinstance(sink, OpcUaSink) and sink.password_env and sink.password_env not in os.environ:
                raise LineConfigError(where + f"{field}.password_env: {sink.password_env} is not set")


def _check_host(where: str, connection: MqttConnection) -> None:
    if connection.password_env and connection.password_env not in os.environ:
        raise LineConfigError(f"{where}.password_env: {connection.password_env} is not set")
    for name in ("ca_file", "cert_file", "key_file"):
        file = getattr(connection, name)
        if file is not None and not Path(file).is_file():
            raise LineConfigError(f"{where}.{name}: {file} does not exist")
    try:
        socket.getaddrinfo(connection.host, connection.port)
    except OSError:
        raise LineConfigError(f"{where}.host: {connection.host!r} does not resolve") from None


def _check_camera(where: str, source: CameraSource) -> None:
    device = source.device
    if isinstance(device, str) and "://" in device:
        return  # a stream that is down now is reopened with back-off, not refused
    if isinstance(device, str) and not Path(device).is_file():
        raise LineConfigError(where + f"source.device: video file {device} does not exist")
    capture = open_capture(device)
    try:
        if not capture.isOpened():
            raise LineConfigError(where + f"source.device: camera {device!r} does not open")
    finally:
        capture.release()
