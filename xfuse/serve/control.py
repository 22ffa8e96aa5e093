"""The control plane of ``xfuse serve``: rank 0 tells every rank what to do next, over the gloo control group.

Only each rank's main thread calls in here. A message is ``(kind, payload)``, broadcast from rank 0:

* ``tick``: rank 0 is idle (sent at least every ``serve.heartbeat_interval_s``); every rank answers.
* ``job``: a validated `GenerationJob` as a dict; every rank runs the pipeline call, then answers.
* ``shutdown``: every rank answers and leaves its loop; the only way a worker's loop ends without an error.

Messages are pickled (between the ranks of one world only) and broadcast as a length and the bytes, each wait
bounded: rank 0's by ``heartbeat_timeout_s``, an idle worker's by ``comm.timeout_s`` (the ticks keep it far from that).
An *answer round* is a gloo ``monitored_barrier`` (rank 0 waits ``heartbeat_timeout_s`` for every rank and names the
ones that did not come: dead or stalled) followed by an ``all_gather_object`` of each rank's answer. No NCCL here: a
gloo operation runs on the CPU, has no watchdog to kill the process, and a dead peer shows up in milliseconds as a
closed connection.
"""

from __future__ import annotations

import pickle
import re
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

TICK, JOB, SHUTDOWN = "tick", "job", "shutdown"
_BARRIER_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


class RankLost(RuntimeError):
    """Ranks did not answer rank 0 within the heartbeat timeout (dead or stalled); ``ranks`` empty: not known which
    (a message rank 0 posted was not taken; the failure report names ranks whose heartbeat stopped)."""

    def __init__(self, ranks: list[int], timeout_s: float, cause: BaseException):
        self.ranks = ranks
        cause_text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        if ranks:
            names = ", ".join(map(str, ranks))
            what = f"rank{'s' if len(ranks) > 1 else ''} {names} did not answer the heartbeat within {timeout_s:.1f} s"
        elif "timed out" in cause_text.lower():
            what = f"a rank did not take rank 0's message within {timeout_s:.1f} s"
        else:
            what = "a rank's connection closed under rank 0's message"
        super().__init__(f"{what} (dead or stalled): {cause_text}")


class ControlPlane:
    """Messages from rank 0 and answer rounds (see the module docstring). A single rank needs none of it."""

    def __init__(self, *, rank: int, world_size: int, group, heartbeat_timeout_s: float, idle_timeout_s: float):
        self.rank, self.world_size, self.group = rank, world_size, group
        self.heartbeat_timeout_s, self.idle_timeout_s = heartbeat_timeout_s, idle_timeout_s

    def post(self, kind: str, payload: Any = None) -> None:
        """Rank 0: send the next message to every rank; a rank that does not take it within the heartbeat timeout
        is lost (`RankLost`)."""
        if self.world_size > 1:
            try:
                self._broadcast(pickle.dumps((kind, payload)), self.heartbeat_timeout_s)
            except RuntimeError as err:
                raise RankLost([], self.heartbeat_timeout_s, err) from err

    def receive(self) -> tuple[str, Any]:
        """Workers: wait for rank 0's next message, at most ``idle_timeout_s`` (``comm.timeout_s``)."""
        return pickle.loads(self._broadcast(None, self.idle_timeout_s))

    def _broadcast(self, payload: bytes | None, timeout_s: float) -> bytes:
        """Rank 0's ``payload`` on every rank: its length, then its bytes, each wait bounded by ``timeout_s``
        (``broadcast_object_list`` would wait the group's whole timeout)."""
        length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        _bounded(dist.broadcast(length, src=0, group=self.group, async_op=True), timeout_s)
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            data = torch.empty(int(length.item()), dtype=torch.uint8)
        _bounded(dist.broadcast(data, src=0, group=self.group, async_op=True), timeout_s)
        return payload if payload is not None else data.numpy().tobytes()

    def answer_round(self, answer: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``answer``, by rank; raise `RankLost` on rank 0 naming the ranks that did not come."""
        if self.world_size == 1:
            return [answer]
        # Workers wait longer than rank 0: rank 0 must be the one that times out, because it names the missing.
        timeout = self.heartbeat_timeout_s if self.rank == 0 else 2 * self.heartbeat_timeout_s + 1.0
        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        except RuntimeError as err:
            found = _BARRIER_RANKS.search(str(err))
            if self.rank == 0 and found:
                raise RankLost([int(r) for r in found.group(1).replace(" ", "").split(",") if r], timeout, err) from err
            raise
        answers: list[Any] = [None] * self.world_size
        dist.all_gather_object(answers, answer, group=self.group)
        return answers


def _bounded(work, timeout_s: float) -> None:
    """Wait for a gloo operation at most ``timeout_s`` (gloo's ``wait(timeout)`` is a real bounded wait)."""
    if work.wait(timeout=timedelta(seconds=timeout_s)) is False:
        raise RuntimeError(f"timed out after {timeout_s:.1f} s")
