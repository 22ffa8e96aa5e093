"""Point-to-point channels between pipeline stages.

Usage, once per schedule slot (all of a slot's receives and sends together)::

    sends_h, recvs_h = channels.exchange(
        sends=[Send(peer=2, kind="hidden", tensor=out, step=s, patch=p)],
        recvs=[Recv(peer=0, kind="hidden", shape=(2, 64, 32), dtype=torch.bfloat16, step=s, patch=p + 1)],
    )
    x = recvs_h[0].wait()        # pool buffer, valid until release()
    ...compute on x...
    recvs_h[0].release()         # buffer goes back to the pool
    sends_h[0].wait()            # `out` must not be modified before this returns

Rules this module enforces or makes natural (see docs/design.md §5):

* gloo sends are rendezvous (a send's wait blocks until the peer posted the
  receive), NCCL's are for large messages. ``issue`` posts everything before anyone
  waits, so a call's operations never wait on each other; the caller must still not
  wait on a send before it has posted the receives that its peer's progress depends
  on, and on NCCL must issue operations in an order both ends of every pair keep
  (the engine's one order of messages: ``xfuse.parallel.protocol``).
* No tags: on both backends messages between one (src, dst) pair match in issue
  order, and ``kind`` is only a label. (gloo honours tags, NCCL ignores them;
  tagging on gloo would let CPU tests pass orders that NCCL mismatches.) A
  receive matched to a larger message aborts the receiving process on gloo
  ("Received data size doesn't match expected size", SIGABRT), so sender and
  receiver schedules must agree exactly: that is what the pure schedule tests check.
* Sent tensors must be contiguous: a non-contiguous one raises ValueError rather
  than being copied, because a silent copy per patch is the allocation on the hot
  path that this layer exists to avoid. Call ``.contiguous()`` where a copy is intended.
* Receives land in preallocated buffers (``RecvBufferPool``); at most
  ``max_inflight`` receives per (peer, kind) channel may be outstanding (posted
  and not released). One more raises InflightLimitError before anything is posted.
* Every wait is bounded by ``timeout_s`` (from the moment wait() is called). Any
  failure is fatal: the channels refuse further work and every later wait raises.
* Two ways to wait. gloo (CPU): wait() blocks the host until the operation is
  complete, bounded by ``timeout_s``. NCCL (CUDA): wait() is *stream-ordered*: a
  receive makes the current stream wait for it, a send nothing, and both return at
  once, so the host queues the next task's kernels while the message is in flight
  (no host/device synchronisation per message). A watchdog thread
  (``watchdog.py``) bounds them instead: past ``timeout_s`` it fails the channels
  with the same CommTimeout, aborts the communicators, and the main thread raises
  it at its next call here. A released receive buffer is reused only after the
  compute that read it is done on the device: release() records an event on the
  current stream, and the next receive into that buffer is queued behind it.
  NCCL coalesces a batch into one Work, so waiting on one receive of a batch also
  orders the stream after that batch's sends.
* Operations go out in the caller's order (``issue``; ``exchange`` posts receives
  first), in batches (one NCCL group each) that hold at most one operation per peer
  (``in_order``): NCCL does not define what happens when two ranks group the
  operations between them differently, and one rank's call may hold several parts'
  receives from a peer that sends them one call at a time.

Not thread-safe: one engine thread drives the channels.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from xfuse.stderr import write_stderr

from .batches import in_order
from .bounded_call import call_bounded
from .buffers import BufferSlot, RecvBufferPool
from .errors import CommError, CommTimeout, InflightLimitError, describe_op, describe_place, error_from_backend
from .groups import DirectionGroups
from .stats import OpLog, OpRecord, TrafficCounters, WaitState
from .watchdog import CommWatchdog

__all__ = ["Send", "Recv", "PendingSend", "PendingRecv", "P2PChannels"]


ABORT_WAIT_S = 10.0  # how long a failure waits for NCCL to abort the communicators before it goes on


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors elementwise makes no sense here
class Send:
    """Send ``tensor`` (contiguous, on the channels' device) to global rank ``peer``."""

    peer: int
    kind: str
    tensor: torch.Tensor
    step: int | str | None  # None: the start-up connection exchange (``P2PChannels.connect``); str: a named phase
    patch: int | None  # None: a whole-image step
    part: int | None = None  # batch part of a whole-image step streamed in parts (None: the whole batch)


@dataclass(frozen=True)
class Recv:
    """Receive a ``shape``/``dtype`` tensor of ``kind`` from global rank ``peer``."""

    peer: int
    kind: str
    shape: tuple
    dtype: torch.dtype
    step: int | str | None  # None: the start-up connection exchange (``P2PChannels.connect``); str: a named phase
    patch: int | None  # None: a whole-image step
    part: int | None = None  # batch part of a whole-image step streamed in parts (None: the whole batch)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


class _Expired(Exception):
    """Our own deadline passed (polling path, or a backend wait that returned False)."""


class _Pending:
    """Common part of a posted operation's handle."""

    def __init__(self, channels: P2PChannels, work, record: OpRecord) -> None:
        self._channels = channels
        self._work = work  # may be shared with other handles (NCCL coalesces a batch into one Work)
        self.record = record
        self.state = "posted"  # -> "done" | "failed" (| "released" for receives)

    @property
    def done(self) -> bool:
        """True once wait() returned successfully (never polls: gloo only completes inside wait()).

        Stream-ordered (NCCL): the wait is queued on the device; the watchdog retires the op when it completes."""
        return self.state in ("done", "released")

    def is_completed(self) -> bool:
        """Whether the device finished the operation (``CommWatchdog`` polls it; NCCL's Work reports it)."""
        return self._work.is_completed()

    def retire(self, now: float) -> None:
        """The device finished the operation (stream-ordered waits; called by the watchdog thread)."""
        self.record.status, self.record.t_done = "done", now

    def __repr__(self) -> str:
        r = self.record
        where = f"{r.direction} {r.kind} peer {r.peer} {describe_place(r.step, r.patch, r.part)}"
        return f"<{type(self).__name__} {where}: {self.state}>"


class PendingSend(_Pending):
    """Handle of a posted send; keeps the tensor alive until the send is complete."""

    def __init__(self, channels, work, record, tensor: torch.Tensor) -> None:
        super().__init__(channels, work, record)
        self._tensor: torch.Tensor | None = tensor

    def wait(self) -> None:
        """Block until the peer has the data (bounded by ``timeout_s``); idempotent.

        Stream-ordered (NCCL): returns at once; the tensor is kept alive until the device has sent it, and the
        caller must not write into it (the engine never does: it sends fresh outputs)."""
        self._channels._wait(self)
        if not self._channels.stream_ordered:
            self._tensor = None  # the caller may reuse its tensor now

    def retire(self, now: float) -> None:
        super().retire(now)
        self._tensor = None


class PendingRecv(_Pending):
    """Handle of a posted receive into a pooled buffer.

    Lifetime rule: the tensor returned by wait() belongs to the pool; it is valid until
    release(), after which a later receive of the same shape will overwrite it. Copy
    it (or finish using it) before releasing. Also usable as ``with handle as x: ...``.
    """

    def __init__(self, channels, work, record, slot: BufferSlot) -> None:
        super().__init__(channels, work, record)
        self._slot = slot

    def wait(self) -> torch.Tensor:
        """Block until the data has arrived (bounded by ``timeout_s``) and return the buffer; idempotent."""
        if self.state == "released":
            raise RuntimeError(f"{self!r}: wait() after release(); the buffer may hold another message now")
        self._channels._wait(self)
        return self._slot.tensor

    def release(self) -> None:
        """Give the buffer back to the pool. Only after wait(): before that the receive may still write to it."""
        if self.state == "released":
            return
        if self.state == "posted":
            raise RuntimeError(f"{self!r}: release() before wait(); the receive may still write into the buffer")
        if self.state == "done":
            self._channels._release_slot(self._slot)
        # After a failure the buffer stays marked busy: the channels are dead anyway.
        self.state = "released"

    def __enter__(self) -> torch.Tensor:
        return self.wait()

    def __exit__(self, *exc) -> None:
        if self.state != "posted":
            self.release()


class P2PChannels:
    """Point-to-point sends and receives of one rank; see the module docstring.

    ``rank`` and every ``peer`` are global ranks. ``device`` is where receive buffers
    live and sent tensors must be. CPU tensors are assumed to travel over gloo, whose
    ``Work.wait(timeout=...)`` is a real bounded wait; any other device is assumed to
    use a stream-based backend (NCCL) whose ``wait()`` only orders streams, so there
    waits are stream-ordered and bounded by the watchdog (``stream_ordered``, default: the device is CUDA; on CPU
    gloo's wait() still blocks and the watchdog bounds it). With ``stream_ordered=False`` on CUDA the host polls
    ``Work.is_completed()`` against the deadline instead (``comm.wait: host``).
    """

    def __init__(
        self,
        *,
        rank: int,
        timeout_s: float,
        max_inflight: int,
        device: torch.device | str,
        groups: DirectionGroups | None = None,
        log_size: int = 256,
        stream_ordered: bool | None = None,
        watchdog_grace_s: float = 2.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.max_inflight = max_inflight
        self.device = torch.device(device)
        self.groups = groups or DirectionGroups()
        self.counters = TrafficCounters()
        self.op_log = OpLog(log_size)
        self.failure: CommError | None = None  # the first fatal error; the channels are dead after it
        # (record, since) while a wait blocks: the failure monitor reports it
        self.waiting_on: tuple[OpRecord, float] | None = None
        self.closed = False  # set by close(): part of xfuse.runtime.world.shutdown, before the groups go
        self._pool = RecvBufferPool(self.device)
        self.stream_ordered = self.device.type == "cuda" if stream_ordered is None else bool(stream_ordered)
        self._cuda_events = self.stream_ordered and self.device.type == "cuda"
        self.watchdog = (
            CommWatchdog[_Pending](timeout_s=self.timeout_s, fail=self._expire, grace_s=watchdog_grace_s)
            if self.stream_ordered
            else None
        )
        if self.device.type == "cuda" and self.device.index is not None:
            # batch_isend_irecv on NCCL hangs if the current device is not the one the tensors live on.
            if torch.cuda.current_device() != self.device.index:
                raise ValueError(f"call torch.cuda.set_device({self.device}) before creating channels on it")

    # ------------------------------------------------------------------ public

    def exchange(
        self, sends: Sequence[Send] = (), recvs: Sequence[Recv] = ()
    ) -> tuple[list[PendingSend], list[PendingRecv]]:
        """Post all ``recvs``, then all ``sends`` (``issue``); return their handles in the same order."""
        handles = self.issue([*recvs, *sends])
        return handles[len(recvs) :], handles[: len(recvs)]  # type: ignore[return-value]

    def issue(self, ops: Sequence[Send | Recv]) -> list[PendingSend | PendingRecv]:
        """Post ``ops`` in their order, and return their handles in the same order.

        They go out in ``batch_isend_irecv`` calls (one NCCL group each) cut by ``in_order``: in order, a call ending
        before an operation whose peer it already has or whose direction group differs. The order is the caller's
        to choose: the engine issues every rank's operations in one order of messages
        (``xfuse.parallel.protocol``), which is what makes NCCL's streams unable to deadlock. Raises
        InflightLimitError / ValueError before posting anything.
        """
        self._raise_expired()
        if self.failure is not None:
            raise CommError(f"rank {self.rank}: channels unusable after an earlier failure: {self.failure}")
        if self.closed:
            raise CommError(f"rank {self.rank}: channels closed (xfuse.runtime.world.shutdown); build a new pipeline")
        recvs = [op for op in ops if isinstance(op, Recv)]
        for op in ops:
            if isinstance(op, Send):
                self._check_send(op)
            else:
                self._check_peer(op.peer, op.kind)
        slots = iter(self._acquire_all(recvs))
        now = time.monotonic()
        posted: list[tuple[dist.ProcessGroup | None, dist.P2POp, PendingSend | PendingRecv]] = []
        for op in ops:
            if isinstance(op, Recv):
                slot = next(slots)
                if self._cuda_events and slot.read_done is not None:  # a reused buffer: its last reader goes first
                    torch.cuda.current_stream(self.device).wait_event(slot.read_done)
                tensor, nbytes = slot.tensor, slot.tensor.nbytes
                rec = OpRecord("recv", op.kind, op.peer, op.shape, op.dtype, nbytes, op.step, op.patch, now, op.part)
                group = self.groups.group_for(op.peer, self.rank)
                posted.append(
                    (group, dist.P2POp(dist.irecv, tensor, op.peer, group), PendingRecv(self, None, rec, slot))
                )
            else:
                tensor, nbytes = op.tensor, op.tensor.nbytes
                shape = tuple(tensor.shape)
                rec = OpRecord("send", op.kind, op.peer, shape, tensor.dtype, nbytes, op.step, op.patch, now, op.part)
                group = self.groups.group_for(self.rank, op.peer)
                posted.append(
                    (group, dist.P2POp(dist.isend, tensor, op.peer, group), PendingSend(self, None, rec, tensor))
                )
        for _, _, pending in posted:
            self.op_log.add(pending.record)
        for batch in in_order(posted, lambda item: (item[2].record.peer, item[0])):
            self._post([(p2p_op, pending) for _, p2p_op, pending in batch])
        return [pending for _, _, pending in posted]

    def connect(self, peers: Sequence[int]) -> None:
        """Form the connections to and from ``peers`` now: every rank of these channels calls this at start-up, with
        its peers, in the same order relative to its other ``connect`` calls.

        NCCL connects a pair of ranks at their first send or receive, and the call that connects blocks the host
        until the peer makes its matching call. The pipeline's ring is asymmetric: the first stage posts its receive
        from the last stage before it computes its next part, and the last stage sends only once that part has
        arrived, so connecting during the first step holds the first stage's host and the pipeline stops (two ranks
        on one H100, NCCL 2.28 over sockets: ``benchmarks/results/gpu.md``). One exchange of a one-element tensor with
        every peer, both ways, connects every pair symmetrically: each rank issues them in one order of messages (by
        pair, the lower rank's send first), so the matching operations of a pair come in the same order on both ends.
        The connection traffic is not counted (``counters``); the op log shows it (kind ``connect``, step None).
        """
        token = torch.zeros(1, device=self.device)
        ops: list[tuple[tuple[int, int, int], Send | Recv]] = []
        for peer in peers:
            pair = (min(peer, self.rank), max(peer, self.rank))
            ops.append(((*pair, int(self.rank > peer)), Send(peer, "connect", token, None, None)))
            ops.append(((*pair, int(peer > self.rank)), Recv(peer, "connect", (1,), token.dtype, None, None)))
        ops.sort(key=lambda op: op[0])
        for handle in self.issue([op for _, op in ops]):
            if isinstance(handle, PendingRecv):
                handle.wait()
                handle.release()
            else:
                handle.wait()
        if self.device.type == "cuda":  # a stream-ordered wait only queues: the pairs are connected once this returns
            torch.cuda.current_stream(self.device).synchronize()
        self.counters.reset()

    def close(self) -> None:
        """Refuse further work and drop the pooled receive buffers; idempotent.

        Buffers of receives still outstanding (an error path) stay referenced: the backend may write into them
        until the process group is destroyed, which comes after this in ``shutdown``.
        """
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._pool.num_busy() == 0:
            self._pool.clear()

    def reset_buffers(self) -> None:
        """Drop all pooled receive buffers (for a new request shape). Refused while any is in use."""
        self._pool.clear()

    def outstanding(self, peer: int, kind: str) -> int:
        """Receives on channel (peer, kind) posted and not yet released."""
        return self._pool.busy(peer, kind)

    @property
    def num_buffers(self) -> int:
        """Receive buffers currently allocated by the pool."""
        return self._pool.num_buffers()

    def wait_state(self) -> WaitState | None:
        """What this rank's channels are blocked on now (None when not waiting); stream-ordered, the oldest
        operation the device still waits for. Safe to call from another thread."""
        waiting = self.waiting_on
        if waiting is None and self.watchdog is not None:  # stream-ordered: what the device waits for
            oldest = self.watchdog.oldest()
            waiting = None if oldest is None else (oldest[0].record, oldest[1])
        if waiting is None:
            return None
        record, since = waiting
        return WaitState.of(record, since, time.monotonic())

    @contextlib.contextmanager
    def bounded_by(self, timeout_s: float):
        """Every wait bounded by ``timeout_s`` instead of ``self.timeout_s`` inside the block (a request whose peers
        compile new shapes first: ``compile.timeout_s``); every rank of a message's pair must use the same bound."""
        saved = self.timeout_s
        self.timeout_s = float(timeout_s)
        if self.watchdog is not None:
            self.watchdog.timeout_s = self.timeout_s
        try:
            yield self
        finally:
            self.timeout_s = saved
            if self.watchdog is not None:
                self.watchdog.timeout_s = saved

    def in_bounded_wait(self) -> bool:
        """Whether this rank is inside a wait of these channels that their bound still covers (what the host deadline
        does not count, ``xfuse.runtime.host_deadline``): not once the channels failed, nor past ``timeout_s`` and the
        watchdog's grace, where the comm timeout should have ended it (an abort that never returns must not excuse
        the host for ever). Safe to call from another thread."""
        state = self.wait_state()
        if state is None or self.failure is not None:
            return False
        grace = self.watchdog.grace_s if self.watchdog is not None else 0.0
        return state.waited_s <= self.timeout_s + grace

    def format_op_log(self) -> str:
        """The recent operations, with state and timing, for failure reports."""
        state = "healthy" if self.failure is None else f"FAILED: {self.failure}"
        return self.op_log.format(f"rank {self.rank} p2p channels ({state})")

    # ------------------------------------------------------------------ internals

    def _check_peer(self, peer: int, kind: str) -> None:
        if not isinstance(peer, int) or peer < 0 or peer == self.rank:
            raise ValueError(f"rank {self.rank}: invalid peer {peer!r} for {kind!r}")
        if not kind or not isinstance(kind, str):
            raise ValueError(f"rank {self.rank}: kind must be a non-empty string, got {kind!r}")

    def _check_send(self, s: Send) -> None:
        self._check_peer(s.peer, s.kind)
        t = s.tensor
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rank {self.rank}: send of {s.kind} to rank {s.peer}: expected a tensor, got {type(t)}")
        if t.device != self.device:
            raise ValueError(
                f"rank {self.rank}: send of {s.kind} to rank {s.peer}: tensor on {t.device}, channels on {self.device}"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"rank {self.rank}: send of {s.kind} {tuple(t.shape)} to rank {s.peer} "
                f"at {describe_place(s.step, s.patch, s.part)}: "
                "tensor is not contiguous; call .contiguous() where a copy is intended"
            )

    def _acquire_all(self, recvs: Sequence[Recv]) -> list[BufferSlot]:
        """One buffer per receive, or none at all (InflightLimitError) if any channel would overflow."""
        slots: list[BufferSlot] = []
        try:
            for r in recvs:
                busy = self._pool.busy(r.peer, r.kind)
                if busy >= self.max_inflight:
                    raise InflightLimitError(
                        describe_op(
                            rank=self.rank,
                            op="recv",
                            kind=r.kind,
                            shape=r.shape,
                            dtype=r.dtype,
                            nbytes=_nbytes(r.shape, r.dtype),
                            peer=r.peer,
                        )
                        + f" at {describe_place(r.step, r.patch, r.part)} would be receive #{busy + 1} outstanding "
                        f"on channel (peer {r.peer}, {r.kind!r}), but max_inflight={self.max_inflight}: release() the "
                        "buffers of earlier receives first. This is a scheduling bug; nothing was posted."
                    )
                slots.append(self._pool.acquire(r.peer, r.kind, r.shape, r.dtype))
        except BaseException:
            for slot in slots:
                self._pool.release(slot)
            raise
        return slots

    def _post(self, batch: list[tuple[dist.P2POp, _Pending]]) -> None:
        try:
            works = dist.batch_isend_irecv([op for op, _ in batch])
        except Exception as exc:
            self._fail(batch[0][1], exc)
        # gloo returns one Work per op; NCCL coalesces the batch into a single Work that completes
        # when all of its ops have, so there every handle waits on that one.
        if len(works) == len(batch):
            for w, (_, h) in zip(works, batch, strict=True):
                h._work = w
        else:
            for _, h in batch:
                h._work = works[-1]

    def _fields(self, h: _Pending) -> dict:
        r = h.record
        return dict(
            rank=self.rank,
            peer=r.peer,
            op=r.direction,
            kind=r.kind,
            shape=r.shape,
            dtype=r.dtype,
            nbytes=r.nbytes,
            step=r.step,
            patch=r.patch,
            part=r.part,
        )

    def _wait(self, h: _Pending) -> None:
        if h.state == "done":
            return
        self._raise_expired()
        if h.state == "failed" or self.failure is not None:
            raise CommError.for_op(
                what="not waited: the process group is unusable after an earlier failure",
                detail=str(self.failure),
                **self._fields(h),
            )
        if self.stream_ordered:
            self._wait_on_stream(h)
            return
        self.waiting_on = (h.record, time.monotonic())  # read by the failure monitor's thread
        try:
            if self.device.type != "cpu":  # NCCL's wait() would not block the host: poll against the deadline
                self._wait_polling(h._work, time.monotonic() + self.timeout_s)
            # timedelta(0) would mean "the group's default timeout", so the timeout is always > 0.
            elif h._work.wait(timeout=timedelta(seconds=self.timeout_s)) is False:
                raise _Expired()
        except Exception as exc:
            self._fail(h, exc)
        finally:
            self.waiting_on = None
        h.state = "done"
        h.record.status, h.record.t_done = "done", time.monotonic()
        self.counters.add(h.record.direction, h.record.kind, h.record.nbytes)

    @staticmethod
    def _wait_polling(work, deadline: float) -> None:
        """Host-blocking bounded wait on NCCL (``comm.wait: host``): one host/device synchronisation per message."""
        pause = 5e-5
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise _Expired()
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)  # latency first, then stop spinning a core
        work.wait()  # orders the current stream after the op and surfaces an error it ended with

    def _wait_on_stream(self, h: _Pending) -> None:
        """Queue the wait on the device and hand the operation to the watchdog; no host synchronisation.

        CUDA: a receive orders the current stream after it, a send is left to the device; the watchdog retires
        both when ``is_completed()``. CPU (gloo, a drill of this path): gloo completes an operation only inside
        ``wait()``, which blocks, unbounded, while the watchdog ages it; it is retired when the wait returns."""
        watchdog = self.watchdog
        assert watchdog is not None  # stream-ordered channels always have one
        watchdog.watch(h)
        h.record.status = "queued"  # until the device (or gloo's wait) completed it
        try:
            if not self._cuda_events:
                h._work.wait()
                watchdog.retire(h)
            elif isinstance(h, PendingRecv):
                h._work.wait()  # NCCL: the current stream waits for the receive; the host goes on
        except Exception as exc:
            watchdog.forget(h)
            self._fail(h, exc)
        h.state = "done"
        self.counters.add(h.record.direction, h.record.kind, h.record.nbytes)

    def _release_slot(self, slot) -> None:
        if self._cuda_events:  # reused only once the compute queued so far (which read it) is done on the device
            if slot.read_done is None:
                slot.read_done = torch.cuda.Event()
            slot.read_done.record(torch.cuda.current_stream(self.device))
        self._pool.release(slot)

    def _raise_expired(self) -> None:
        """Main thread: raise the watchdog's timeout once (later calls see ``failure`` like any other failure)."""
        watchdog = self.watchdog
        if watchdog is not None and watchdog.error is not None and not watchdog.raised.is_set():
            watchdog.raised.set()
            raise watchdog.error

    def _expire(self, h: _Pending, elapsed_s: float) -> CommError:
        """Watchdog thread: the first stream-ordered operation past ``timeout_s``. Fail the channels, abort the
        communicators so the device stops waiting, and return the error for the main thread to raise."""
        err = CommTimeout.for_op(what=f"timed out after {self.timeout_s} s", **self._fields(h))
        h.state = "failed"
        h.record.status = "failed"
        if self.failure is None:
            self.failure = err
        err.op_log = self.format_op_log()
        self._abort_communicators()
        return err

    def _abort_communicators(self) -> None:
        """NCCL: abort this channel's process groups (the default group stands for all of them), so kernels waiting
        on the lost message end and the device is free again. gloo cannot be aborted from another thread: there the
        watchdog's ``on_stuck`` ends the process if the main thread stays blocked."""
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return
        groups = {self.groups.up, self.groups.down}

        def abort() -> None:
            for group in [None] if None in groups else groups:
                dist.distributed_c10d._abort_process_group(group)

        self.abort_bounded(abort)

    def abort_bounded(self, abort: Callable[[], object]) -> None:
        """``abort()`` given ``ABORT_WAIT_S``: NCCL's abort synchronises the communicator's stream (NVIDIA/nccl#829),
        so on a device stopped by a kernel that never ends it never returns (FLUX.2 [klein] at degree 2 on one H100,
        ``docs/performance/gpu.md``); past the bound the failure goes on to its report and the end of the process."""
        try:
            if not call_bounded(abort, ABORT_WAIT_S, f"xfuse-abort-{self.rank}"):
                write_stderr(f"rank {self.rank}: aborting the communicators did not return within {ABORT_WAIT_S:g} s "
                             "(NCCL's abort waits for the device); going on without it")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the report matters more; the process ends anyway
            write_stderr(f"rank {self.rank}: aborting the communicators failed: {exc}")

    def _fail(self, h: _Pending, exc: Exception) -> NoReturn:
        """Record the failure, make the channels unusable, raise the CommError."""
        if isinstance(exc, _Expired):
            err: CommError = CommTimeout.for_op(what=f"timed out after {self.timeout_s} s", **self._fields(h))
        else:
            err = error_from_backend(exc, timeout_s=self.timeout_s, **self._fields(h))
        h.state = "failed"
        h.record.status, h.record.t_done = "failed", time.monotonic()
        if self.failure is None:
            self.failure = err
        err.op_log = self.format_op_log()  # travels with the error (also when pickled to another process)
        raise err from (None if isinstance(exc, _Expired) else exc)
