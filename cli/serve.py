"""``padim serve`` and ``padim health``: the HTTP service."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from padim.models.choices import DEVICES, RUNTIMES

from .common import RUNTIME_HELP, UserError


def settings_names() -> str:
    """Every service setting as its PADIM_* variable (pydantic only: ``padim --help`` stays torch-free)."""
    from padim.service.settings import ServiceSettings

    return ", ".join(f"PADIM_{name.upper()}" for name in ServiceSettings.model_fields)


def register(commands, runtime: argparse.ArgumentParser, quiet: argparse.ArgumentParser) -> None:
    serve = commands.add_parser(
        "serve", parents=[quiet], help="serve models over HTTP (FastAPI): POST /score, and the inspection console at /",
        description="Serve one or more model files or export directories. Each is named by its file stem; the first "
        "is the default. Open http://HOST:PORT/ in a browser for the inspection console; the API is described at "
        "/docs. "
        f"Flags override PADIM_* environment variables ({settings_names()}; see the README's table). "
        "The API key is read from PADIM_API_KEY only, never from a flag.",
    )
    serve.add_argument("model_args", type=Path, nargs="*", metavar="MODEL",
                       help="model files (padim train) or export directories (padim export)")
    serve.add_argument("--model", type=Path, action="append", dest="models", metavar="MODEL",
                       help="the same, as a flag (repeatable; the older spelling)")
    serve.add_argument("--model-dir", type=Path, help="serve every *.padim and export directory in this directory")
    serve.add_argument("--default-model", help="name of the default model (default: the first)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 in Docker)")
    serve.add_argument("--port", type=int, help="default 8000")
    serve.add_argument("--device", choices=DEVICES, help="default auto: cuda when torch sees a GPU")
    serve.add_argument("--runtime", choices=RUNTIMES, help=RUNTIME_HELP)
    serve.add_argument("--max-batch-size", type=int, help="largest device batch (default 32)")
    serve.add_argument("--max-delay-ms", type=float, help="longest wait for a batch to fill (default 5)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    serve.set_defaults(handler=cmd_serve)

    health = commands.add_parser(
        "health", parents=[quiet], help="exit 0 when a local `padim serve` is ready (Docker HEALTHCHECK)",
        description="GET http://127.0.0.1:$PADIM_PORT/health/ready; exit 0 on 200, 1 otherwise. Imports no torch.",
    )
    health.add_argument("--url", help="default http://127.0.0.1:${PADIM_PORT:-8000}/health/ready")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    health.set_defaults(handler=cmd_health)


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from padim.service.server import serve
    from padim.service.settings import ServiceSettings

    args.models = [*args.model_args, *(args.models or [])] or None
    if args.quiet and args.log_level is None:
        args.log_level = "warning"
    flags = {k: getattr(args, k) for k in ("models", "model_dir", "default_model", "host", "port", "device",
                                           "runtime", "max_batch_size", "max_delay_ms", "log_level")}
    try:
        settings = ServiceSettings(**{k: v for k, v in flags.items() if v is not None})
    except ValidationError as error:
        first = error.errors()[0]
        raise UserError(f"{'.'.join(map(str, first['loc'])) or 'settings'}: {first['msg']} "
                        f"(given {first.get('input')!r})") from None
    try:
        return serve(settings)
    except ValueError as error:
        raise UserError(str(error)) from None


def cmd_health(args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    url = args.url or f"http://127.0.0.1:{os.environ.get('PADIM_PORT', '8000')}/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            ready = response.status == 200
    except (urllib.error.URLError, OSError) as error:
        print(f"padim health: {url}: {getattr(error, 'reason', error)}", file=sys.stderr)
        return 1
    return 0 if ready else 1
