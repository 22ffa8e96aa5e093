"""Byte/op counters per tensor kind, a ring buffer of recent operations, and what a rank waits for.

Counters feed benchmarks (traffic per kind: hidden vs skip vs latent is exactly
what separates the linear and folded placements). The op log feeds failure
reports: when a rank times out, the last few dozen operations with their state
and timing usually show which side of the schedule went wrong. The wait state is what the failure monitor
publishes to the other ranks, as data, so a timed-out rank can follow who waits for whom.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass

import torch

from xfuse.comm.errors import describe_place

__all__ = ["TrafficCounters", "OpRecord", "OpLog"]


class TrafficCounters:
    """Completed operations per kind: ``sent_bytes["hidden"]``, ``recv_bytes``, ``sent_ops``, ``recv_ops``.

    An operation counts when its wait() succeeds, so failed or never-waited
    operations are not counted. Missing kinds read as 0 (``collections.Counter``).
    """

    def __init__(self) -> None:
        self.sent_bytes: Counter[str] = Counter()
        self.recv_bytes: Counter[str] = Counter()
        self.sent_ops: Counter[str] = Counter()
        self.recv_ops: Counter[str] = Counter()

    def add(self, op: str, kind: str, nbytes: int) -> None:
        # A channel label "skip:12" (one channel per skip edge) counts under its kind, "skip".
        kind = kind.partition(":")[0]
        if op == "send":
            self.sent_bytes[kind] += nbytes
            self.sent_ops[kind] += 1
        else:
            self.recv_bytes[kind] += nbytes
            self.recv_ops[kind] += 1

    def reset(self) -> None:
        for c in (self.sent_bytes, self.recv_bytes, self.sent_ops, self.recv_ops):
            c.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        """Plain dicts (picklable, JSON-friendly), e.g. ``{"sent_bytes": {"hidden": 16384}, ...}``."""
        return {
            "sent_bytes": dict(self.sent_bytes),
            "recv_bytes": dict(self.recv_bytes),
            "sent_ops": dict(self.sent_ops),
            "recv_ops": dict(self.recv_ops),
        }

    def __repr__(self) -> str:
        return f"TrafficCounters({self.as_dict()})"


@dataclass
class OpRecord:
    """One posted operation. ``status`` is "posted", "done" or "failed"; times are ``time.monotonic()``."""

    direction: str  # "send" | "recv"
    kind: str
    peer: int
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    step: int | str | None  # None: the start-up connection exchange (P2PChannels.connect); str: a named phase
    patch: int | None  # None: a whole-image step
    t_post: float
    part: int | None = None  # batch part of a whole-image step streamed in parts
    t_done: float | None = None
    status: str = "posted"

    def format(self, now: float) -> str:
        arrow = "to  " if self.direction == "send" else "from"
        dtype = str(self.dtype).removeprefix("torch.")
        head = (
            f"{self.t_post - now:+9.3f}s {self.direction:4} {self.kind:<8} {arrow} rank {self.peer:<3} "
            f"{str(self.shape):<18} {dtype:<9} {self.nbytes:>10} B  step {self.step} patch {self.patch}"
            + ("" if self.part is None else f" part {self.part}")
        )
        if self.t_done is None:
            return f"{head}  {self.status.upper()} for {now - self.t_post:.3f} s"
        return f"{head}  {self.status} in {1e3 * (self.t_done - self.t_post):.1f} ms"


@dataclass(frozen=True)
class WaitState:
    """One operation a rank's channels are blocked on (or the device waits for): published by the failure monitor
    (``xfuse.runtime.monitor``) and followed through ``peer`` to the rank where a chain of waits ends."""

    direction: str  # "send" | "recv"
    kind: str
    peer: int
    step: int | str | None  # None: the start-up connection exchange; str: a named phase
    patch: int | None  # None: a whole-image step
    part: int | None  # batch part of a whole-image step streamed in parts
    waited_s: float

    @classmethod
    def of(cls, record: OpRecord, since: float, now: float) -> WaitState:
        """The wait on ``record``'s operation, blocked since ``since`` (``time.monotonic()``)."""
        r = record
        return cls(r.direction, r.kind, r.peer, r.step, r.patch, r.part, round(now - since, 3))

    def sentence(self) -> str:
        """E.g. ``waiting 3.2 s: recv of hidden from rank 1 at step 2, patch 0``: what failure reports print."""
        preposition = "from" if self.direction == "recv" else "to"
        return (
            f"waiting {self.waited_s:.1f} s: {self.direction} of {self.kind} {preposition} rank {self.peer} "
            f"at {describe_place(self.step, self.patch, self.part)}"
        )


class OpLog:
    """The last ``maxlen`` operations, oldest first."""

    def __init__(self, maxlen: int = 256) -> None:
        self.records: deque[OpRecord] = deque(maxlen=maxlen)

    def add(self, record: OpRecord) -> OpRecord:
        self.records.append(record)
        return record

    def format(self, header: str = "") -> str:
        now = time.monotonic()
        lines = [header] if header else []
        lines.append(f"last {len(self.records)} p2p ops (times relative to now):")
        lines += ["  " + r.format(now) for r in self.records]
        return "\n".join(lines)
