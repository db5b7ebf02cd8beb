"""What several ``padim`` commands share: the run options, ``--runtime``, ``-q``.

Torch-free: ``padim --help`` builds every parser from here and :mod:`padim.models.choices`.
"""

from __future__ import annotations

import argparse

from padim.models import options
from padim.models.choices import DEFAULT_BATCH_SIZE, DEFAULT_WORKERS, RUNTIMES


def run_options() -> argparse.ArgumentParser:
    """``--device``, ``--batch-size``, ``--decode-workers``: how a command runs, never what it computes."""
    parent = argparse.ArgumentParser(add_help=False)
    options.add_flags(parent.add_argument_group("how it runs"), "run")
    return parent


RUNTIME_HELP = (
    "what runs the scorer (default auto: onnxruntime on a CPU when it is installed, 1.2-1.45x faster "
    "than torch there; torch on a GPU). A .padim file is exported once for onnxruntime/openvino and "
    "the export cached beside it (or in $PADIM_CACHE_DIR); an export directory (padim export) runs as is"
)


def runtime_option() -> argparse.ArgumentParser:
    """``--runtime``: torch, onnxruntime or openvino (predict and evaluate; serve has its own flag)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--runtime", choices=RUNTIMES, default="auto", help=RUNTIME_HELP)
    return parent


def quiet_option() -> argparse.ArgumentParser:
    """``-q`` after the command as well as before it."""
    parent = argparse.ArgumentParser(add_help=False)
    add_quiet(parent)
    return parent


def add_quiet(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``-q`` on ``parser`` (a command's, or one of its help's sections)."""
    # SUPPRESS: without -q here, the value given before the command stands
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no progress bars or info logs (warnings and errors still print)",
    )


def batch_size(args: argparse.Namespace) -> int:
    return DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size


def workers(args: argparse.Namespace) -> int:
    """``--decode-workers`` (``--workers`` before): threads decoding pictures."""
    return DEFAULT_WORKERS if args.decode_workers is None else args.decode_workers


def some(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``: a few names of a long list, for one-line messages."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
