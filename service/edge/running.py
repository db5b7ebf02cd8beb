"""How a uvicorn server of the service runs: JSON log lines, a drain that turns readiness red first, a clean exit
after it, the ``Server`` header. One process serving, and each process of several, run their server this way."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Iterator

import uvicorn

#: The ``Server`` header: the product, no version (uvicorn's own names the server software).
SERVER_HEADER = "padim"

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the process's role when the service runs in several
    (``supervisor``, ``scoring``, ``api-N``) and any ``extra`` fields."""

    def __init__(self, role: str | None = None):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.role is not None:
            entry["process"] = self.role
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, role: str | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter(role)
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT: readiness goes red first, then uvicorn stops accepting and lets
    in-flight requests finish (up to ``drain_timeout_s``), then the models are released."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        self.state.draining = True
        super().handle_exit(sig, frame)


@contextlib.contextmanager
def quiet_signals() -> Iterator[None]:
    """uvicorn re-raises the signal it drained on once its own handlers are gone; with these no-op handlers in place
    a clean drain ends with exit code 0 instead of death by signal."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
