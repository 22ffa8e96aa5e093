"""Rank functions for tests/multirank/test_comm.py (World pickles functions by reference).

Each function runs on every rank of a gloo world and returns plain, picklable
results (or CommError objects, which must survive pickling) for the test to check.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from xfuse.comm import CommError, InflightLimitError, P2PChannels, Recv, Send, make_direction_groups

_state: dict = {}  # per rank process, kept between calls


def _sentence(wait) -> str | None:
    """A channel's wait as failure reports print it (None when it waits for nothing)."""
    return None if wait is None else wait.sentence()


def payload(src: int, kind: str, shape: tuple, dtype_name: str, step: int, patch: int) -> torch.Tensor:
    """The tensor ``src`` sends for (kind, step, patch): random bits, the same on every process."""
    # Not hash(): str hashing is randomised per process.
    seed = (src * 1_000_003 + sum(map(ord, kind)) * 10_007 + step * 101 + patch) % (2**31)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(getattr(torch, dtype_name))


def ring_specs(patch: int) -> list[tuple[str, tuple, str]]:
    """(kind, shape, dtype) sent per patch; the last patch is shorter (uneven bands) to exercise two shapes."""
    rows = 3 if patch == 0 else 2
    return [
        ("hidden", (2, rows, 8), "bfloat16"),
        ("skip", (2, rows, 8), "float16"),
        ("latent", (1, 4, rows, 5), "float32"),
    ]


def _groups(separate: bool):
    # new_group is collective: every rank reaches this in the same call, in the same order.
    key = ("groups", separate)
    if key not in _state:
        _state[key] = make_direction_groups(separate=separate)
    return _state[key]


def ring_exchange(
    steps: int, patches: int, separate_groups: bool, stream_ordered: bool = False, connect: bool = False
) -> dict:
    """Each rank sends every spec to rank+1 and receives from rank-1, one exchange per (step, patch); ``connect``:
    first ``P2PChannels.connect`` with every other rank (its op log and counters returned too)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    ch = P2PChannels(
        rank=rank,
        timeout_s=20.0,
        max_inflight=2,
        device="cpu",
        groups=_groups(separate_groups),
        stream_ordered=stream_ordered,
    )
    connected = {}
    if connect:
        ch.connect([peer for peer in range(size) if peer != rank])
        connected = {"op_log": ch.format_op_log(), "counters": ch.counters.as_dict(), "buffers": ch.num_buffers}
    bad, ptrs = [], set()
    for step in range(steps):
        for patch in range(patches):
            specs = ring_specs(patch)
            sends = [Send(nxt, k, payload(rank, k, sh, dt, step, patch), step, patch) for k, sh, dt in specs]
            recvs = [Recv(prv, k, sh, getattr(torch, dt), step, patch) for k, sh, dt in specs]
            send_h, recv_h = ch.exchange(sends, recvs)
            for (k, sh, dt), h in zip(specs, recv_h, strict=True):
                with h as got:
                    ptrs.add(got.data_ptr())
                    want = payload(prv, k, sh, dt, step, patch)
                    if got.dtype != want.dtype or not torch.equal(got, want):
                        bad.append((k, step, patch))
            for h in send_h:
                h.wait()
    watchdog = {}
    if stream_ordered:  # the watchdog retires every op once it completed; then it is stopped and joined
        deadline = time.monotonic() + 10
        while ch.watchdog.outstanding() and time.monotonic() < deadline:
            time.sleep(0.01)
        watchdog = {"outstanding": ch.watchdog.outstanding(), "state": _sentence(ch.wait_state())}
        ch.close()
        watchdog["thread_stopped"] = ch.watchdog._thread is None
    return {
        "connected": connected,
        "watchdog": watchdog,
        "bad": bad,
        "counters": ch.counters.as_dict(),
        "num_buffers": ch.num_buffers,
        "distinct_ptrs": len(ptrs),
        "op_log": ch.format_op_log(),
        "separate": ch.groups.separate,
    }


def grouped_unlike(separate_groups: bool) -> dict:
    """Exchanges that hold different messages on the two sides of a pair (the engine's first posts: a rank posts two
    patches' receives at once, its peer sends one patch per exchange): rank 0 sends patches 0 and 1 (hidden and text
    each) to rank 1 one exchange per patch; rank 1 receives both in one exchange that also sends both on to rank 2;
    rank 2 receives one patch per exchange. Every ``batch_isend_irecv`` call of this rank is recorded (the real one
    runs) as its ops' (op, peer) pairs; the received tensors are compared with what was sent."""
    rank = dist.get_rank()
    ch = P2PChannels(rank=rank, timeout_s=20.0, max_inflight=2, device="cpu", groups=_groups(separate_groups))
    specs = [("hidden", (2, 4, 8)), ("text", (2, 6, 8))]  # two sizes, as the joint families' streams
    calls: list[list[tuple[str, int]]] = []
    real = dist.batch_isend_irecv

    def recording(ops):
        calls.append([("send" if op.op is dist.isend else "recv", op.peer) for op in ops])
        return real(ops)

    def sends(dst: int, patch: int) -> list[Send]:
        return [Send(dst, k, payload(0, k, shape, "float32", 0, patch), 0, patch) for k, shape in specs]

    def recvs(src: int, patch: int) -> list[Recv]:
        return [Recv(src, k, shape, torch.float32, 0, patch) for k, shape in specs]

    bad: list = []
    dist.batch_isend_irecv = recording
    try:
        if rank == 0:
            for patch in (0, 1):
                for h in ch.exchange(sends(1, patch))[0]:
                    h.wait()
        elif rank == 1:
            send_h, recv_h = ch.exchange(sends(2, 0) + sends(2, 1), recvs(0, 0) + recvs(0, 1))
            for i, h in enumerate(recv_h):
                (kind, shape), patch = specs[i % 2], i // 2
                if not torch.equal(h.wait(), payload(0, kind, shape, "float32", 0, patch)):
                    bad.append((kind, patch))
                h.release()
            for h in send_h:
                h.wait()
        else:
            for patch in (0, 1):
                for i, h in enumerate(ch.exchange(recvs=recvs(1, patch))[1]):
                    kind, shape = specs[i]
                    if not torch.equal(h.wait(), payload(0, kind, shape, "float32", 0, patch)):
                        bad.append((kind, patch))
                    h.release()
    finally:
        dist.batch_isend_irecv = real
    return {"calls": calls, "bad": bad}


def counters_reset() -> dict:
    """Counters only count completed ops, per kind, and reset to zero."""
    rank, size = dist.get_rank(), dist.get_world_size()
    ch = P2PChannels(rank=rank, timeout_s=20.0, max_inflight=1, device="cpu")
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    send_h, recv_h = ch.exchange(
        [Send(nxt, "a", torch.zeros(5, dtype=torch.float16), 0, 0)], [Recv(prv, "a", (5,), torch.float16, 0, 0)]
    )
    before_wait = ch.counters.as_dict()
    recv_h[0].wait()
    recv_h[0].release()
    send_h[0].wait()
    after = ch.counters.as_dict()
    ch.counters.reset()
    return {
        "before_wait": before_wait,
        "after": after,
        "after_reset": ch.counters.as_dict(),
        "missing_kind": ch.counters.sent_bytes["nope"],
    }


def buffer_reuse_and_inflight() -> dict:
    """Rank 0 sends to rank 1 in rounds; rank 1 checks buffer reuse and the in-flight bound. Rank 2 idles."""
    rank = dist.get_rank()
    if rank > 1:
        return {}
    ch = P2PChannels(rank=rank, timeout_s=20.0, max_inflight=2, device="cpu")
    shape, out = (2, 4, 8), {}

    def send_round(n: int, tag: int) -> None:
        hs, _ = ch.exchange([Send(1, "hidden", torch.full(shape, float(tag + i)), tag, i) for i in range(n)])
        for h in hs:
            h.wait()

    if rank == 0:
        try:  # a non-contiguous send is refused before anything is posted
            ch.exchange([Send(1, "hidden", torch.zeros(8, 2, 4).transpose(0, 1), 0, 0)])
        except ValueError as exc:
            out["noncontig"] = str(exc)
        for tag in (0, 10, 20):
            send_round(2, tag)
        return out

    def recv_two(tag: int):
        return ch.exchange(recvs=[Recv(0, "hidden", shape, torch.float32, tag, i) for i in range(2)])[1]

    rounds = []
    for tag in (0, 10):
        hs = recv_two(tag)
        got = [h.wait() for h in hs]
        rounds.append(([g.data_ptr() for g in got], [g[0, 0, 0].item() for g in got]))
        for h in hs:
            h.release()
    out["rounds"], out["num_buffers"] = rounds, ch.num_buffers

    hs = recv_two(20)  # two outstanding: the bound is reached
    try:
        ch.exchange(recvs=[Recv(0, "hidden", (3, 3), torch.float32, 20, 2)])  # another shape, same channel
    except InflightLimitError as exc:
        out["overflow"] = str(exc)
    out["outstanding"] = ch.outstanding(0, "hidden")
    try:
        hs[0].release()
    except RuntimeError as exc:
        out["early_release"] = str(exc)
    try:
        ch.reset_buffers()
    except RuntimeError as exc:
        out["busy_reset"] = str(exc)
    out["round3"] = [h.wait()[0, 0, 0].item() for h in hs]
    for h in hs:
        h.release()
    out["outstanding_after"] = ch.outstanding(0, "hidden")
    ch.reset_buffers()
    out["num_buffers_after_reset"] = ch.num_buffers
    out["healthy"] = ch.failure is None
    return out


def unmatched_ops(timeout_s: float) -> dict:
    """Rank 0 waits for a receive and rank 2 for a send that rank 1 never matches; rank 1 idles."""
    rank = dist.get_rank()
    if rank == 1:
        return {}
    ch = P2PChannels(rank=rank, timeout_s=timeout_s, max_inflight=2, device="cpu")
    if rank == 0:
        h = ch.exchange(recvs=[Recv(1, "hidden", (2, 4, 8), torch.float32, 3, 1)])[1][0]
    else:
        # a batch part of a whole-image step: the message names it
        h = ch.exchange([Send(1, "skip", torch.zeros(2, 4, 8, dtype=torch.bfloat16), 7, None, part=1)])[0][0]
    t0 = time.monotonic()
    try:
        h.wait()
        return {"error": None}
    except CommError as exc:
        out = {"error": exc, "elapsed": time.monotonic() - t0}
    try:  # fatal: the channels refuse further work
        ch.exchange(recvs=[Recv(1, "hidden", (1,), torch.float32, 4, 0)])
    except CommError as exc:
        out["after"] = str(exc)
    return out


def stream_ordered_ops_never_matched(timeout_s: float, out_dir: str) -> dict:
    """Stream-ordered waits on ops rank 1 never matches: rank 0 receives from it, rank 2 sends to it. gloo's wait
    blocks the main thread (as a device synchronisation behind a lost message would on CUDA), so the watchdog
    fails the op after ``timeout_s`` and, the main thread not raising within the grace period, calls
    ``on_stuck``; here that pickles the error into ``out_dir`` and ends the process as the real one does."""
    import os
    import pickle

    rank = dist.get_rank()
    if rank == 1:
        return {}
    ch = P2PChannels(
        rank=rank, timeout_s=timeout_s, max_inflight=2, device="cpu", stream_ordered=True, watchdog_grace_s=0.5
    )
    t0 = time.monotonic()

    def on_stuck(error):
        state = _sentence(ch.wait_state())
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
            pickle.dump({"error": error, "elapsed": time.monotonic() - t0, "state": state}, fh)
        os._exit(3)

    ch.watchdog.on_stuck = on_stuck
    if rank == 0:
        (h,) = ch.exchange(recvs=[Recv(1, "hidden", (2, 4, 8), torch.float32, 3, 1)])[1]
    else:
        (h,), _ = ch.exchange([Send(1, "skip", torch.zeros(2, 4, 8, dtype=torch.bfloat16), 7, None, part=1)])
    h.wait()  # never returns
    return {"returned": True}


def wait_on_peer(sleeping_rank: int, timeout_s: float) -> dict:
    """Rank 0 receives from and rank 2 sends to ``sleeping_rank``, which the test kills meanwhile."""
    rank = dist.get_rank()
    if rank == sleeping_rank:
        time.sleep(120)
        return {}
    ch = P2PChannels(rank=rank, timeout_s=timeout_s, max_inflight=1, device="cpu")
    if rank == 0:
        h = ch.exchange(recvs=[Recv(sleeping_rank, "hidden", (64, 64), torch.float32, 5, 2)])[1][0]
    else:
        h = ch.exchange([Send(sleeping_rank, "latent", torch.ones(64, 64), 5, 3)])[0][0]
    t0 = time.monotonic()
    try:
        h.wait()
        return {"error": None}
    except CommError as exc:
        return {"error": exc, "elapsed": time.monotonic() - t0}
