"""One process group per direction of travel, so the two directions' transfers can overlap.

On NCCL every process group has its own communicator and CUDA stream, and a large
send that waits for its receiver stalls everything issued after it on that
stream. A pipeline sends "up" (to higher ranks) and "down" (to lower ranks) at the
same time; on one stream a waiting up-send holds back the down-send behind it. The
engine's one order of messages (``xfuse.parallel.protocol``) keeps that from
deadlocking on one group or on these two alike (NCCL may also serialise the kernels
of two communicators); two groups let the directions' transfers overlap where the
device runs both. A message ``src -> dst`` travels on ``up`` if ``src < dst`` and on
``down`` otherwise; sender and receiver compute the same group.

gloo has no streams (each operation is its own asynchronous request), so the
default group serves both directions there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DirectionGroups", "make_direction_groups"]


@dataclass(frozen=True)
class DirectionGroups:
    """``up`` carries messages to a higher rank, ``down`` to a lower one; None is the default group."""

    up: dist.ProcessGroup | None = None
    down: dist.ProcessGroup | None = None

    def group_for(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The group of a message from global rank ``src`` to global rank ``dst``."""
        return self.up if src < dst else self.down

    @property
    def separate(self) -> bool:
        return self.up is not self.down


def make_direction_groups(
    ranks: Sequence[int] | None = None,
    *,
    separate: bool | None = None,
    device_id: torch.device | None = None,
    timeout: timedelta | None = None,
) -> DirectionGroups:
    """Create the groups for the pipeline over ``ranks`` (default: all ranks).

    ``separate`` defaults to True unless the default backend is plain gloo. With
    separate groups this calls ``torch.distributed.new_group`` twice (up, then down),
    which is collective over the whole world: every rank must call this function
    with the same arguments, in the same order relative to its other group creations,
    including ranks outside ``ranks`` (they get groups they must not use).
    ``device_id`` is passed on so NCCL forms the communicators eagerly: errors show up
    at start-up, and the first batched P2P call need not involve every rank. ``timeout``: the groups' own (NCCL
    aborts a collective or P2P op that runs longer; None is torch's default of 10 minutes).
    """
    if separate is None:
        separate = dist.get_backend() != "gloo"
    if not separate:
        return DirectionGroups(None, None)
    kwargs: dict[str, Any] = {"device_id": device_id} if device_id is not None else {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    ranks = sorted(ranks) if ranks is not None else None
    up = dist.new_group(ranks, **kwargs)
    down = dist.new_group(ranks, **kwargs)
    return DirectionGroups(up, down)
