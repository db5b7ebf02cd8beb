"""A deadline for the awaits inside it, without a task of its own (``asyncio.timeout`` where Python has it).

``asyncio.wait_for`` wraps what it waits for in a new task: tens of microseconds, on every read of a request body.
A deadline is a timer that cancels the task it is in, turned into ``TimeoutError`` when it fired.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator


def uncancel(task: asyncio.Task) -> None:
    """Forget one cancellation of ``task`` (Python 3.11+), once it is answered: a later one is not taken for it."""
    if sys.version_info >= (3, 11):
        task.uncancel()


if sys.version_info >= (3, 11):
    deadline = asyncio.timeout
else:  # pragma: no cover - Python 3.10

    @contextlib.asynccontextmanager
    async def deadline(seconds: float | None) -> AsyncIterator[None]:
        """Cancel the current task after ``seconds``; the cancellation comes out as ``TimeoutError``."""
        if seconds is None:
            yield
            return
        task = asyncio.current_task()
        assert task is not None
        fired = False

        def fire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(seconds, fire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise TimeoutError from None
            raise
        finally:
            timer.cancel()
