"""``padim serve``: the HTTP service (FastAPI) and its inspection console."""

from __future__ import annotations

import argparse
from pathlib import Path

from padim.models.choices import DEVICES, RUNTIMES
from padim.models.errors import UsageError

from ..options import RUNTIME_HELP, quiet_option

DESCRIPTION = (
    "Serve one or more model files or export directories. Each is named by its file stem; the first "
    "is the default. Open http://HOST:PORT/ in a browser for the inspection console; the API is described at "
    "/docs. A flag overrides its PADIM_* environment variable (--max-batch-size: PADIM_MAX_BATCH_SIZE; MODEL: "
    "PADIM_MODELS; --record: PADIM_RECORD_DIR); the other settings (keys, limits, the record, the monitor) are "
    "variables only: docs/settings.md lists every one with its default. The keys (PADIM_API_KEY, "
    "PADIM_ADMIN_KEY, PADIM_REVIEW_KEY) are never flags."
)


def register(commands) -> None:
    serve = commands.add_parser(
        "serve",
        parents=[quiet_option()],
        help="serve models over HTTP (FastAPI): POST /score, and the inspection console at /",
        description=DESCRIPTION,
    )
    _what_is_served(serve)
    serve.add_argument("--default-model", help="name of the default model (default: the first)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 in Docker)")
    serve.add_argument("--port", type=int, help="default 8000")
    serve.add_argument("--device", choices=DEVICES, help="default auto: cuda when torch sees a GPU")
    serve.add_argument("--runtime", choices=RUNTIMES, help=RUNTIME_HELP)
    serve.add_argument(
        "--workers",
        type=int,
        help="API processes that speak HTTP and decode, beside one scoring process that owns the device; 1: "
        "everything in one process (default: from the usable CPUs, 1 on a CPU; docs/sizing.md). Decoding threads: "
        "PADIM_DECODE_WORKERS",
    )
    serve.add_argument("--max-batch-size", type=int, help="largest device batch (default 32)")
    serve.add_argument("--max-delay-ms", type=float, help="longest wait for a batch to fill (default 5)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    serve.set_defaults(handler=run)


def _what_is_served(serve: argparse.ArgumentParser) -> None:
    """The models (files, a folder, a repository), the record and the lines."""
    serve.add_argument(
        "model_args",
        type=Path,
        nargs="*",
        metavar="MODEL",
        help="model files (padim train) or export directories (padim export)",
    )
    serve.add_argument(
        "--model",
        type=Path,
        action="append",
        dest="models",
        metavar="MODEL",
        help="the same, as a flag (repeatable; the older spelling)",
    )
    serve.add_argument("--model-dir", type=Path, help="serve every *.padim and export directory in this directory")
    serve.add_argument(
        "--repository",
        type=Path,
        metavar="DIR",
        help="serve a model repository (DIR/NAME/N/; see `padim repository --help`): each model's active "
        "version; with PADIM_ADMIN_KEY set, versions are uploaded, activated and rolled back over HTTP "
        "without a restart (docs/deployment.md)",
    )
    serve.add_argument(
        "--record",
        type=Path,
        metavar="DIR",
        dest="record_dir",
        help="keep the inspection record in DIR: a row for every scored picture and the picture as "
        "sent, for review and for updates that learn from it (SQLite there unless PADIM_RECORD_URL "
        "names PostgreSQL; docs/record.md)",
    )
    serve.add_argument(
        "--lines",
        type=Path,
        metavar="FILE",
        help="run the lines of FILE (lines.yaml) beside HTTP: hot folders and cameras scored as pictures arrive, "
        "verdicts to MQTT, webhooks and OPC UA (docs/lines.md)",
    )
    serve.add_argument(
        "--check-lines",
        action="store_true",
        help="check the models and the --lines file (folders, cameras, hosts, secrets) as a start would, and exit",
    )


def run(args: argparse.Namespace) -> int:
    # imported here: `padim --help` and `padim health` load no torch
    from padim.service.server import check_lines, serve, served_files

    args.models = [*args.model_args, *(args.models or [])] or None
    if args.quiet and args.log_level is None:
        args.log_level = "warning"
    flags = {
        k: getattr(args, k)
        for k in (
            "models",
            "model_dir",
            "repository",
            "default_model",
            "host",
            "port",
            "device",
            "runtime",
            "max_batch_size",
            "max_delay_ms",
            "workers",
            "log_level",
            "record_dir",
            "lines",
        )
    }
    settings = make_settings(flags)
    if args.check_lines:
        if settings.lines is None:
            raise UsageError("--check-lines needs a lines file: --lines FILE or PADIM_LINES")
        check_lines(settings, served_files(settings))
        print(f"{settings.lines}: the lines are ready to start")
        return 0
    return serve(settings)


def make_settings(flags: dict):
    """The service's settings: the environment's, overridden by the flags given; one line when they are wrong."""
    # pydantic only, no torch: imported here as every command's library is
    from pydantic import ValidationError

    from padim.service.settings import ServiceSettings

    try:
        return ServiceSettings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as error:
        first = error.errors()[0]
        raise UsageError(
            f"{'.'.join(map(str, first['loc'])) or 'settings'}: {first['msg']} (given {first.get('input')!r})"
        ) from None
