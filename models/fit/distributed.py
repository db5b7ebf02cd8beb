"""Fitting across processes with ``torch.distributed`` (torchrun): who does what, and together.

A :class:`Shard` says which rank this process is and how many there are. Every collective is
preceded by an agreement on failure (:func:`together`), so that a rank that fails (an
unreadable file, say) stops every rank with its message instead of leaving the others waiting
in the collective forever.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from padim.models.errors import RankFailed as RankFailed  # re-exported: raised here
from padim.models.errors import UsageError


@dataclass(frozen=True)
class Shard:
    """This process's place in a ``torch.distributed`` group."""

    rank: int
    world: int

    @property
    def main(self) -> bool:
        """Rank 0: the one that finishes the fit and writes the file."""
        return self.rank == 0


#: Seconds a collective may wait for the other ranks before the group fails (``$PADIM_DIST_TIMEOUT_S``).
#: The longest wait is one slice of the finish on the slowest rank, or rank 0 writing the file.
DEFAULT_TIMEOUT_S = 1800


def from_environment(device: torch.device) -> Shard | None:
    """Join the group torchrun describes in the environment (NCCL on GPUs, Gloo on CPUs).

    On GPUs this rank's device is ``cuda:LOCAL_RANK`` from here on (call it before anything is
    put on ``cuda``), and NCCL is bound to it. Collectives time out after ``$PADIM_DIST_TIMEOUT_S``
    seconds (default :data:`DEFAULT_TIMEOUT_S`).

    Returns ``None`` when the process was not started by torchrun with several processes.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    timeout = timedelta(seconds=timeout_seconds(os.environ.get("PADIM_DIST_TIMEOUT_S")))
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise UsageError(
                f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} GPU(s); "
                "start torchrun with --nproc-per-node at most the GPU count"
            )
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return Shard(dist.get_rank(), dist.get_world_size())


def timeout_seconds(text: str | None) -> float:
    """``$PADIM_DIST_TIMEOUT_S`` as seconds (:data:`DEFAULT_TIMEOUT_S` when unset)."""
    if text is None or not text.strip():
        return float(DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise UsageError(f"PADIM_DIST_TIMEOUT_S={text!r}: give a positive number of seconds")
    return seconds


def leave(shard: Shard | None) -> None:
    """Leave the group joined by :func:`from_environment` (nothing without one)."""
    if shard is not None:
        dist.destroy_process_group()


def folds_of(groups: Sequence[Sequence], shard: Shard | None) -> list[list]:
    """This rank's share of ``groups`` (calibration folds): whole folds, contiguous, about equal in images.

    Out-of-fold scores need every image of a fold on one rank. Rank ``r`` takes the folds that
    start within its ``1 / world`` of the images (all of them without a shard).
    """
    folds = [list(g) for g in groups]
    if shard is None:
        return folds
    total = sum(len(g) for g in folds)
    mine, seen = [], 0
    for group in folds:
        if shard.rank * total <= seen * shard.world < (shard.rank + 1) * total:
            mine.append(group)
        seen += len(group)
    return mine


def together(run: Callable[[], None], shard: Shard | None, device: torch.device) -> None:
    """Run ``run`` on every rank; a failure on any rank stops every rank before the next collective."""
    if shard is None:
        run()
        return
    error: Exception | None = None
    try:
        run()
    except Exception as caught:  # reported below, once every rank knows
        error = caught
    failed = torch.tensor([1.0 if error else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if float(failed) > 0:
        raise RankFailed(f"{int(failed)} other rank(s) failed; see their messages")


def gather(value, shard: Shard | None) -> list:
    """Every rank's ``value`` (picklable, small), in rank order, on every rank."""
    if shard is None:
        return [value]
    gathered: list = [None] * shard.world
    dist.all_gather_object(gathered, value)
    return gathered


def sum_(tensor: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """``tensor`` summed over every rank, in place."""
    if shard is not None:
        dist.all_reduce(tensor)
    return tensor
