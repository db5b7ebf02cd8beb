"""The ``padim`` command line: the parser with every command registered, and one way errors end.

The commands are :mod:`padim.commands` (one module each); the library they call is
:mod:`padim.models` and :mod:`padim.service`. An error of the family
(:class:`~padim.core.errors.PadimError`) is printed as one line and exits with the status of
:data:`padim.models.errors.OUTCOMES`; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from padim.core import __version__
from padim.core.errors import PadimError
from padim.models.errors import DiskFull, disk_full, outcome

from .commands import COMMANDS

EXAMPLES = """\
examples:
  padim synth demo-data --categories weave               # a small generated data set
  padim train demo-data/weave/train/good --output weave.padim --weights random
  padim predict weave.padim demo-data/weave/test --output predictions
  padim evaluate weave.padim demo-data/weave --report weave-report     # metrics, and an HTML report
  padim serve weave.padim                                # then open http://127.0.0.1:8000/ in a browser
  padim export weave.padim --format onnx --output weave-onnx     # one graph for onnxruntime / OpenVINO / Triton
"""

#: Commands that draw progress bars.
PROGRESS_COMMANDS = {"train", "merge", "predict", "evaluate", "export", "synth"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="padim",
        description="PaDiM visual anomaly detection: fit on normal images, score new ones.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"padim {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info logs")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, title="commands (padim COMMAND --help for each)"
    )
    for command in COMMANDS:
        command.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # `padim` alone: what it can do, not a usage error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.quiet or args.command not in PROGRESS_COMMANDS:
            return args.handler(args)
        from tqdm.contrib.logging import logging_redirect_tqdm  # tqdm only for commands that draw bars

        with logging_redirect_tqdm():  # a log line during a progress bar gets a line of its own
            return args.handler(args)
    except KeyboardInterrupt:
        print(f"padim {args.command}: interrupted; no partial model file was written", file=sys.stderr)
        return 130
    except PadimError as error:
        print(f"padim {args.command}: error: {error}", file=sys.stderr)
        return outcome(error).exit_status
    except OSError as error:
        if not disk_full(error):
            raise
        full = DiskFull.of(error, "free space, or write the output (and --scratch-dir) elsewhere")
        print(f"padim {args.command}: error: {full}", file=sys.stderr)
        return outcome(full).exit_status
    except RuntimeError as error:
        if type(error).__name__ != "OutOfMemoryError":  # torch.OutOfMemoryError (torch is not imported here)
            raise
        print(
            f"padim {args.command}: error: the GPU ran out of memory ({str(error).splitlines()[0]}); use a smaller "
            "--batch-size, free the GPU (nvidia-smi shows who holds it), or --device cpu",
            file=sys.stderr,
        )
        return 1
