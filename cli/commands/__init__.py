"""One module per ``padim`` command, in the order ``padim --help`` lists them.

Each module has ``register(commands)``, which adds its parser (help, flags) to the subparsers,
and ``run(args) -> int``, what the command does. ``run`` imports the library inside itself (torch
comes with it), so that building every parser (``padim --help``) and ``padim health`` load no
torch; ``tests/cli/test_commands.py`` checks that they do not.
"""

from . import (
    drift,
    evaluate,
    export,
    fetch_weights,
    health,
    info,
    merge,
    predict,
    records,
    repository,
    serve,
    synth,
    train,
    watch,
)

#: Every command, in the order of ``padim --help``.
COMMANDS = (
    train,
    merge,
    predict,
    evaluate,
    drift,
    export,
    serve,
    watch,
    repository,
    records,
    health,
    info,
    fetch_weights,
    synth,
)
