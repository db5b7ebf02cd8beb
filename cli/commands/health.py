"""``padim health``: exit 0 when a local ``padim serve`` is ready (Docker's HEALTHCHECK). Imports no torch."""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

from ..options import quiet_option


def register(commands) -> None:
    health = commands.add_parser(
        "health",
        parents=[quiet_option()],
        help="exit 0 when a local `padim serve` is ready (Docker HEALTHCHECK)",
        description="GET http://127.0.0.1:$PADIM_PORT/health/ready; exit 0 on 200, 1 otherwise. Imports no torch.",
    )
    health.add_argument("--url", help="default http://127.0.0.1:${PADIM_PORT:-8000}/health/ready")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    health.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    url = args.url or f"http://127.0.0.1:{os.environ.get('PADIM_PORT', '8000')}/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            ready = response.status == 200
    except (urllib.error.URLError, OSError) as error:
        print(f"padim health: {url}: {getattr(error, 'reason', error)}", file=sys.stderr)
        return 1
    return 0 if ready else 1
