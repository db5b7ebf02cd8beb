"""``padim watch``: run the lines of a lines.yaml (hot folders, cameras -> MQTT, webhooks, OPC UA) without HTTP."""

from __future__ import annotations

import argparse
from pathlib import Path

from padim.models.choices import DEVICES, RUNTIMES

from ..options import RUNTIME_HELP, quiet_option
from .serve import make_settings


def register(commands) -> None:
    watch = commands.add_parser(
        "watch",
        parents=[quiet_option()],
        help="run lines without HTTP: hot folders and cameras scored as pictures arrive, verdicts to MQTT, "
        "webhooks and OPC UA",
        description="Run the lines of LINES (docs/lines.md) with the given models, as `padim serve --lines` does, "
        "without the HTTP service. Each picture gets one verdict across restarts (a journal beside the file); "
        "a sink that is down gets its verdicts later from an on-disk outbox. Stops on Ctrl+C or SIGTERM, "
        "finishing the pictures being scored. Settings come from PADIM_* as for `padim serve`.",
    )
    watch.add_argument("lines", type=Path, metavar="LINES", help="the lines file (lines.yaml)")
    watch.add_argument("models", type=Path, nargs="*", metavar="MODEL", help="model files or export directories")
    watch.add_argument("--repository", type=Path, metavar="DIR", help="serve a model repository's active versions")
    watch.add_argument("--record", type=Path, metavar="DIR", dest="record_dir", help="keep the inspection record")
    watch.add_argument("--default-model", help="name of the default model (default: the first)")
    watch.add_argument("--device", choices=DEVICES, help="default auto: cuda when torch sees a GPU")
    watch.add_argument("--runtime", choices=RUNTIMES, help=RUNTIME_HELP)
    watch.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")
    watch.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import asyncio  # the service's modules bring torch: imported here, so `padim --help` stays light

    from padim.service.edge.running import configure_logging
    from padim.service.lines.pipeline import run_lines
    from padim.service.server import check_lines, served_files

    if args.quiet and args.log_level is None:
        args.log_level = "warning"
    flags = {
        k: getattr(args, k) for k in ("repository", "record_dir", "default_model", "device", "runtime", "log_level")
    }
    settings = make_settings({**flags, "models": args.models or None, "lines": args.lines})
    check_lines(settings, served_files(settings))
    configure_logging(settings.log_level)
    return asyncio.run(run_lines(settings))
