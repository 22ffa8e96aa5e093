"""Between-step cancellation: a request stops before a step on every rank, decided by one rank, without a hang.

Global rank 0 (the *decider*: the rank that serves HTTP and knows when a client went away) asks its ``condition``
once per step whether the request goes on, at its ``decision_points`` (``xfuse.parallel.schedule``: one step ahead
of every rank's need), and publishes each answer in the world's rendezvous store (the c10d ``TCPStore``, which
every rank already reaches: no collective, so the decider never waits on a slower rank). Every other rank reads
the answer for step S at its own stop point for S, where it normally finds it already written. A request stopped
before S then runs, on every rank, the tasks of the steps before S and nothing else, sends only what those need,
and returns no latents; the pipeline raises ``RequestCancelled`` on every rank (``XfusePipeline._run``).

In a stream of requests (``XfusePipeline.run_stream``) each request stops on its own: the decider asks each
request's condition (``conditions``) at that request's decision points, and a stopped request's tasks no longer run
while the others' go on.

Keys: ``xfuse/stop/<cancellation>/<call>/<run>/<request>/<step>`` (``run``: a two-expert call runs the engine
twice; ``request``: the request of a stream, 0 alone). The decider deletes a call's keys in the next call, after
that call's first collective, when every rank has read them: a service that runs for weeks keeps at most one call's
keys.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import timedelta

from xfuse.comm.errors import CommTimeout

STOP_KEY = "xfuse/stop"
DECIDER = 0  # the global rank that decides
# Each Cancellation's keys have their own prefix: every rank makes its pipelines' cancellations in the same order, so
# the n-th of rank 0 and the n-th of rank 1 share one, and two pipelines in one world never read each other's.
_MADE = itertools.count()


class Cancellation:
    """One pipeline's cancellation on one rank (``XfusePipeline.enable_cancellation``).

    Args:
        rank, world_size: this rank's place in the world.
        store: the world's c10d store (``None`` for a world of one rank, which decides alone).
        timeout_s: how long a rank waits for the decider's answer (``comm.timeout_s``).
        space: the keys' namespace, the same on every rank (default: the n-th cancellation made in this process).
    """

    def __init__(self, *, rank: int, world_size: int, store, timeout_s: float, space: str | None = None):
        if world_size > 1 and store is None:
            raise ValueError("cancellation in a world of more than one rank needs the world's store")
        self.rank, self.world_size, self.store, self.timeout_s = rank, world_size, store, timeout_s
        self.condition: Callable[[], bool] | None = None  # the decider's: True once the request should stop
        # the decider's, in a stream: each request's condition (None: that request is never stopped)
        self.conditions: list[Callable[[], bool] | None] | None = None
        self._call, self._run = 0, 0
        self._prefix = f"{STOP_KEY}/{next(_MADE) if space is None else space}"
        self._written: list[str] = []  # the keys the decider wrote and has not deleted yet
        self._stale: list[str] = []  # the previous call's keys: read by every rank once this call began

    @property
    def is_decider(self) -> bool:
        return self.rank == DECIDER

    def begin_call(self) -> None:
        """Every rank, at the start of each pipeline call (before any collective of the call)."""
        self._call, self._run = self._call + 1, 0
        self._stale, self._written = self._written, []

    def begin_run(self) -> None:
        """Every rank, before each run of the engine in the call."""
        self._run += 1

    def _key(self, stop: int, request: int) -> str:
        return f"{self._prefix}/{self._call}/{self._run}/{request}/{stop}"

    def decide(self, stop: int, request: int = 0) -> bool:
        """The decider: whether the request (``request`` of a stream) stops before step ``stop`` (its condition),
        published for the others."""
        assert self.is_decider
        condition = self.condition if self.conditions is None else self.conditions[request]
        stopping = condition is not None and bool(condition())
        if self.world_size > 1:
            for key in self._stale:  # the previous call's: this call's first collective is behind every rank
                self.store.delete_key(key)
            self._stale = []
            key = self._key(stop, request)
            self.store.set(key, b"1" if stopping else b"0")
            self._written.append(key)
        return stopping

    def read(self, stop: int, request: int = 0) -> bool:
        """The others: the decider's answer for step ``stop`` (of ``request`` of a stream), waiting at most
        ``timeout_s`` for it."""
        assert not self.is_decider
        key = self._key(stop, request)
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        except RuntimeError as err:  # c10d's DistStoreError (a RuntimeError) on timeout or a lost store
            cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CommTimeout(
                f"rank {self.rank}: no word from rank {DECIDER} within {self.timeout_s:.1f} s (comm.timeout_s) on "
                f"whether the request{f' {request} of the stream' if request else ''} stops before step {stop}: "
                f"{cause}",
                rank=self.rank,
                peer=DECIDER,
                op="recv",
                kind="stop decision",
                step=stop,
                detail=cause,
            ) from err
        return self.store.get(key) == b"1"
