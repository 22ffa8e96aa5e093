"""Tests for xfuse.comm: in-process unit tests, then real gloo ranks (tests.support.comm_fns), no mocks.

Failure tests (timeouts, a killed peer) break the process group of the ranks involved,
so each runs in its own small world; the shared 3-rank world only sees healthy traffic.
"""

import pickle
import threading
import time

import pytest
import torch

from tests.support import comm_fns as fns
from tests.support.world import RankDied, World
from xfuse.comm import (
    CommError,
    CommTimeout,
    InflightLimitError,
    OpLog,
    OpRecord,
    P2PChannels,
    PeerLost,
    Recv,
    RecvBufferPool,
    TrafficCounters,
    p2p,
)
from xfuse.comm.batches import in_order
from xfuse.comm.bounded_call import call_bounded
from xfuse.comm.errors import error_from_backend
from xfuse.comm.watchdog import CommWatchdog

FIELDS = dict(
    rank=1, peer=0, op="recv", kind="hidden", shape=(2, 64, 32), dtype=torch.float32, nbytes=16384, step=3, patch=1
)


# --------------------------------------------------------------------------- in-process


def test_error_message_names_the_operation_and_pickles():
    err = CommTimeout.for_op(what="timed out after 5.0 s", **FIELDS)
    assert str(err) == (
        "rank 1: recv of hidden (2, 64, 32) float32, 16384 bytes, from rank 0 timed out after 5.0 s at step 3, patch 1"
    )
    back = pickle.loads(pickle.dumps(err))  # errors travel between processes
    assert type(back) is CommTimeout and str(back) == str(err)
    assert (back.rank, back.peer, back.op, back.kind, back.shape, back.dtype, back.nbytes, back.step, back.patch) == (
        1,
        0,
        "recv",
        "hidden",
        (2, 64, 32),
        torch.float32,
        16384,
        3,
        1,
    )
    assert isinstance(err, CommError) and isinstance(err, RuntimeError)


def test_an_error_of_the_start_up_connection_exchange_says_start_up():
    fields = dict(FIELDS, kind="connect", shape=(1,), nbytes=4, step=None, patch=None)
    err = CommTimeout.for_op(what="timed out after 5.0 s", **fields)
    assert str(err) == "rank 1: recv of connect (1,) float32, 4 bytes, from rank 0 timed out after 5.0 s at start-up"


@pytest.mark.parametrize(
    "step, patch, part, where",
    [
        (3, 1, None, "step 3, patch 1"),
        (0, None, None, "step 0, whole image"),
        (0, None, 1, "step 0, whole image, batch part 1"),  # a warm-up step streamed in batch parts
    ],
)
def test_error_message_says_where_in_the_schedule(step, patch, part, where):
    err = CommTimeout.for_op(what="timed out after 5.0 s", **{**FIELDS, "step": step, "patch": patch, "part": part})
    assert str(err).endswith(f"from rank 0 timed out after 5.0 s at {where}")
    back = pickle.loads(pickle.dumps(err))
    assert (back.step, back.patch, back.part) == (step, patch, part) and str(back) == str(err)


def test_backend_errors_are_classified():
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:42917. This is typically caused ...")
    lost = error_from_backend(closed, timeout_s=5.0, **FIELDS)
    assert type(lost) is PeerLost and "peer lost" in str(lost) and "Connection closed by peer" in str(lost)
    reset = error_from_backend(RuntimeError("Connection reset by peer"), timeout_s=5.0, **{**FIELDS, "op": "send"})
    assert type(reset) is PeerLost and "send of hidden" in str(reset) and "to rank 0" in str(reset)
    slow = error_from_backend(
        RuntimeError("Timed out waiting 5000ms for recv operation to complete"), timeout_s=5.0, **FIELDS
    )
    assert type(slow) is CommTimeout and "timed out after 5.0 s" in str(slow)
    # The next op after our own timeout: not a new timeout, not a lost peer.
    other = error_from_backend(RuntimeError("Application timeout caused pair closure"), timeout_s=5.0, **FIELDS)
    assert type(other) is CommError
    assert str(other).endswith("failed at step 3, patch 1: Application timeout caused pair closure")


def test_buffer_pool_reuses_and_refuses_busy_clear():
    pool = RecvBufferPool("cpu")
    a = pool.acquire(0, "hidden", (2, 3), torch.bfloat16)
    b = pool.acquire(0, "hidden", (2, 3), torch.bfloat16)
    assert a.tensor.data_ptr() != b.tensor.data_ptr() and pool.busy(0, "hidden") == 2
    assert a.tensor.dtype == torch.bfloat16 and a.tensor.shape == (2, 3)
    pool.release(a)
    assert pool.acquire(0, "hidden", (2, 3), torch.bfloat16) is a and pool.num_buffers() == 2
    with pytest.raises(RuntimeError, match="in use"):
        pool.clear()
    pool.release(a), pool.release(b)
    with pytest.raises(RuntimeError, match="twice"):
        pool.release(b)
    pool.clear()
    assert pool.num_buffers() == 0


def test_counters_and_op_log_format():
    c = TrafficCounters()
    c.add("send", "hidden", 100), c.add("send", "hidden", 50), c.add("recv", "skip", 8)
    assert c.sent_bytes["hidden"] == 150 and c.sent_ops["hidden"] == 2 and c.recv_bytes["skip"] == 8
    assert c.recv_ops["hidden"] == 0
    assert c.as_dict() == {
        "sent_bytes": {"hidden": 150},
        "recv_bytes": {"skip": 8},
        "sent_ops": {"hidden": 2},
        "recv_ops": {"skip": 1},
    }
    c.reset()
    assert c.as_dict() == {"sent_bytes": {}, "recv_bytes": {}, "sent_ops": {}, "recv_ops": {}}

    log = OpLog(maxlen=2)
    now = time.monotonic()
    for i in range(3):
        log.add(OpRecord("send", "hidden", 1, (2, 4), torch.float16, 16, i, 0, now))
    log.records[-1].status, log.records[-1].t_done = "done", now + 0.002
    text = log.format("hdr")
    assert len(log.records) == 2 and "step 0" not in text  # ring buffer: oldest dropped
    assert "hdr" in text and "POSTED for" in text and "done in 2.0 ms" in text and "float16" in text


def test_channel_arguments_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        P2PChannels(rank=0, timeout_s=0, max_inflight=1, device="cpu")
    with pytest.raises(ValueError, match="max_inflight"):
        P2PChannels(rank=0, timeout_s=1, max_inflight=0, device="cpu")
    ch = P2PChannels(rank=0, timeout_s=1, max_inflight=1, device="cpu")
    with pytest.raises(ValueError, match="invalid peer"):
        ch.exchange(recvs=[Recv(0, "hidden", (1,), torch.float32, 0, 0)])  # to itself
    # Checks run before anything is posted, so no process group is needed for them.
    with pytest.raises(InflightLimitError, match="max_inflight=1"):
        ch.exchange(recvs=[Recv(1, "hidden", (1,), torch.float32, 0, i) for i in range(2)])
    assert ch.outstanding(1, "hidden") == 0 and ch.num_buffers == 1


def test_call_bounded_returns_what_happened_within_its_bound():
    assert call_bounded(lambda: None, 5.0, "quick") is True
    with pytest.raises(ZeroDivisionError):  # an exception of the call is the caller's
        call_bounded(lambda: 1 / 0, 5.0, "raises")
    never = threading.Event()
    start = time.monotonic()
    assert call_bounded(never.wait, 0.2, "xfuse-test-never") is False
    assert 0.2 <= time.monotonic() - start < 2.0
    left = next(t for t in threading.enumerate() if t.name == "xfuse-test-never")
    assert left.daemon  # left behind, it does not keep the process alive
    never.set()


def test_an_abort_that_never_returns_is_given_up_after_its_bound(monkeypatch, capfd):
    """NCCL's abort on a stopped device (NVIDIA/nccl#829) held the comm watchdog for good in the third GPU run, so
    the failure it had found never ended the process; the abort now gets ``ABORT_WAIT_S``."""
    monkeypatch.setattr(p2p, "ABORT_WAIT_S", 0.2)
    channels = P2PChannels(rank=3, timeout_s=1.0, max_inflight=1, device="cpu")
    start = time.monotonic()
    channels.abort_bounded(threading.Event().wait)
    assert time.monotonic() - start < 2.0
    assert "rank 3: aborting the communicators did not return within 0.2 s" in capfd.readouterr().err
    channels.abort_bounded(lambda: 1 / 0)
    assert "rank 3: aborting the communicators failed: division by zero" in capfd.readouterr().err


def test_a_wait_excuses_the_host_only_within_the_channels_bound():
    """``in_bounded_wait`` is what the host deadline does not count: a wait inside ``timeout_s`` and the grace,
    on healthy channels."""
    channels = P2PChannels(rank=0, timeout_s=2.0, max_inflight=1, device="cpu", stream_ordered=True,
                           watchdog_grace_s=1.0)  # fmt: skip
    record = OpRecord("recv", "latent", 1, (1, 4), torch.float32, 16, 0, None, time.monotonic())
    assert channels.in_bounded_wait() is False  # not waiting
    channels.waiting_on = (record, time.monotonic() - 2.5)
    assert channels.in_bounded_wait() is True  # 2.5 s: within timeout_s + grace
    channels.waiting_on = (record, time.monotonic() - 3.5)
    assert channels.in_bounded_wait() is False  # past them: the comm timeout should have ended it
    channels.waiting_on = (record, time.monotonic())
    channels.failure = CommTimeout.for_op(what="timed out after 2.0 s", **FIELDS)
    assert channels.in_bounded_wait() is False  # failed channels excuse nothing
    channels.close()


class _DeviceWork:
    """Stands in for an NCCL Work (which needs a GPU): completion set by the test, as the device would."""

    def __init__(self):
        self.completed = threading.Event()

    def is_completed(self):
        return self.completed.is_set()


class _Op:
    """A ``Watched`` operation on that device work."""

    def __init__(self, name):
        self.name, self._work, self.retired_at = name, _DeviceWork(), None

    def is_completed(self):
        return self._work.is_completed()

    def retire(self, now):
        self.retired_at = now


@pytest.mark.parametrize(
    "ops, batches",
    [
        ([], []),
        ([(1, "up"), (2, "up")], [[1, 2]]),  # one operation per peer: one call
        ([(1, "up")] * 4, [[1], [1], [1], [1]]),  # two patches' hidden and text from one peer: a call each
        ([(0, "up"), (2, "up"), (2, "up"), (0, "up")], [[0, 2], [2, 0]]),  # cut before a peer the call has
        ([(1, "down"), (2, "up"), (3, "up")], [[1], [2, 3]]),  # a call is on one process group
    ],
)
def test_in_order_cuts_operations_into_calls_of_one_per_peer_and_group_keeping_their_order(ops, batches):
    groups = {"up": object(), "down": object()}
    items = [(peer, groups[group], i) for i, (peer, group) in enumerate(ops)]
    cut = in_order(items, lambda item: (item[0], item[1]))
    assert [[peer for peer, _, _ in batch] for batch in cut] == batches
    assert [item for batch in cut for item in batch] == items  # nothing lost, nothing twice, the order kept


@pytest.mark.parametrize("main_thread_raises", [True, False], ids=["main-thread-raises", "stuck-main-thread"])
def test_watchdog_retires_completed_ops_and_fails_the_first_expired_one(main_thread_raises):
    # The CUDA path of the watchdog (the wait returned at once; the device completes the op later). Its gloo path
    # runs for real in test_stream_ordered_waits_are_bounded_by_the_watchdog.
    failed, stuck = [], []
    watchdog = CommWatchdog(
        timeout_s=0.4,
        fail=lambda op, elapsed: failed.append((op.name, elapsed)) or RuntimeError(f"{op.name} expired"),
        grace_s=0.3,
        on_stuck=stuck.append,
    )
    done, lost = _Op("done"), _Op("lost")
    watchdog.watch(done)
    watchdog.watch(lost)
    assert watchdog.oldest()[0] is done and watchdog.outstanding() == 2
    done._work.completed.set()
    time.sleep(0.2)
    assert done.retired_at is not None and watchdog.oldest()[0] is lost and not failed
    time.sleep(0.4)
    assert [name for name, _ in failed] == ["lost"] and 0.4 < failed[0][1] < 0.6
    assert str(watchdog.error) == "lost expired"
    if main_thread_raises:
        watchdog.raised.set()  # what P2PChannels does when its next call raises the error
    time.sleep(0.5)
    assert stuck == ([] if main_thread_raises else [watchdog.error]) and len(failed) == 1
    assert watchdog.stop() and watchdog._thread is None


# --------------------------------------------------------------------------- shared 3-rank world


@pytest.fixture(scope="module")
def world():
    w = World(3)
    yield w
    w.close()


def _ring_expected(steps: int, patches: int) -> dict:
    exp = {"sent_bytes": {}, "recv_bytes": {}, "sent_ops": {}, "recv_ops": {}}
    for _ in range(steps):
        for patch in range(patches):
            for kind, shape, dtype in fns.ring_specs(patch):
                n = torch.empty(shape, dtype=getattr(torch, dtype)).nbytes
                for key, val in (("sent_bytes", n), ("recv_bytes", n), ("sent_ops", 1), ("recv_ops", 1)):
                    exp[key][kind] = exp[key].get(kind, 0) + val
    return exp


@pytest.mark.parametrize("separate_groups", [False, True], ids=["one-group", "direction-groups"])
def test_ring_exchange_dtypes_counters_and_reuse(world, separate_groups):
    steps, patches = 3, 2
    results = world.run_ok(fns.ring_exchange, steps, patches, separate_groups, timeout=60)
    expected = _ring_expected(steps, patches)
    # bf16 (2,3,8)+(2,2,8), fp16 the same, fp32 (1,4,3,5)+(1,4,2,5); 3 steps.
    assert expected["sent_bytes"] == {"hidden": 3 * (96 + 64), "skip": 3 * (96 + 64), "latent": 3 * (240 + 160)}
    for r in results:
        assert r["bad"] == []  # bf16, fp16 and fp32 arrive bit-exact
        assert r["counters"] == expected
        assert r["separate"] is separate_groups
        # 3 kinds x 2 shapes (uneven last patch): one buffer each, reused across all 3 steps.
        assert r["num_buffers"] == 6 and r["distinct_ptrs"] == 6
        assert "step 2 patch 1" in r["op_log"] and "POSTED" not in r["op_log"] and "healthy" in r["op_log"]


@pytest.mark.parametrize("separate_groups", [False, True], ids=["one-group", "direction-groups"])
def test_connect_exchanges_with_every_peer_uncounted_and_the_ring_runs_after_it(world, separate_groups):
    """What the world does at start-up (P2PChannels.connect, see its docstring for the NCCL hang it prevents): one
    exchange with every other rank, both ways; shown in the op log at start-up, not counted as traffic."""
    steps, patches = 2, 2
    results = world.run_ok(fns.ring_exchange, steps, patches, separate_groups, False, True, timeout=60)
    for rank, r in enumerate(results):
        connected = r["connected"]
        assert connected["counters"] == {"sent_bytes": {}, "recv_bytes": {}, "sent_ops": {}, "recv_ops": {}}
        assert connected["buffers"] == len(results) - 1  # a pooled (1,) float32 buffer per peer, released
        log = connected["op_log"]
        assert log.count(" connect ") == 2 * (len(results) - 1) and "POSTED" not in log, log
        for peer in (p for p in range(len(results)) if p != rank):
            assert f"send connect  to   rank {peer}" in log and f"recv connect  from rank {peer}" in log, log
        assert r["bad"] == [] and r["counters"] == _ring_expected(steps, patches)


def test_stream_ordered_waits_deliver_the_same_and_the_watchdog_retires_every_op(world):
    # On CPU gloo's wait() still blocks; what runs here is the stream-ordered bookkeeping: waits handed to the
    # watchdog thread, retired when complete, counted, and the thread joined at close().
    steps, patches = 2, 2
    results = world.run_ok(fns.ring_exchange, steps, patches, True, True, timeout=60)
    for r in results:
        assert r["bad"] == [] and r["counters"] == _ring_expected(steps, patches)
        assert r["watchdog"] == {"outstanding": 0, "state": None, "thread_stopped": True}
        assert "QUEUED" not in r["op_log"] and "POSTED" not in r["op_log"]


@pytest.mark.parametrize("separate_groups", [False, True], ids=["one-group", "direction-groups"])
def test_a_batch_call_holds_one_operation_per_peer_whatever_the_exchanges_hold(world, separate_groups):
    """NCCL leaves it undefined when two ranks group the operations between them differently (NVIDIA/nccl#1279):
    however an exchange's messages differ from its peer's, each ``batch_isend_irecv`` call holds at most one
    operation per peer and one process group, in the exchange's order, and everything arrives."""
    zero, one, two = world.run_ok(fns.grouped_unlike, separate_groups, timeout=60)
    assert zero["calls"] == [[("send", 1)]] * 4  # one call per message, two exchanges of two
    # rank 1's one exchange: its four receives from rank 0, then its four sends to rank 2, in order (both "up" under
    # direction groups), the last receive and the first send in one call
    assert one["calls"] == [[("recv", 0)]] * 3 + [[("recv", 0), ("send", 2)]] + [[("send", 2)]] * 3
    assert two["calls"] == [[("recv", 1)]] * 4
    assert zero["bad"] == one["bad"] == two["bad"] == []


def test_counters_count_completed_ops_and_reset(world):
    for r in world.run_ok(fns.counters_reset, timeout=30):
        assert r["before_wait"] == {"sent_bytes": {}, "recv_bytes": {}, "sent_ops": {}, "recv_ops": {}}
        assert r["after"] == {
            "sent_bytes": {"a": 10},
            "recv_bytes": {"a": 10},
            "sent_ops": {"a": 1},
            "recv_ops": {"a": 1},
        }
        assert r["after_reset"]["sent_bytes"] == {} and r["missing_kind"] == 0


def test_buffer_reuse_and_inflight_bound(world):
    sender, receiver, _ = world.run_ok(fns.buffer_reuse_and_inflight, timeout=30)
    assert "not contiguous" in sender["noncontig"] and "call .contiguous()" in sender["noncontig"]
    (ptrs1, vals1), (ptrs2, vals2) = receiver["rounds"]
    assert len(set(ptrs1)) == 2 and ptrs2 == ptrs1  # same buffers, same order, for the same shape
    assert vals1 == [0.0, 1.0] and vals2 == [10.0, 11.0]
    assert receiver["num_buffers"] == 2
    msg = receiver["overflow"]
    assert msg.startswith("rank 1: recv of hidden (3, 3) float32, 36 bytes, from rank 0 at step 20, patch 2")
    assert "receive #3 outstanding" in msg and "max_inflight=2" in msg and "scheduling bug" in msg
    assert receiver["outstanding"] == 2  # the refused receive took nothing
    assert "release() before wait()" in receiver["early_release"]
    assert "in use" in receiver["busy_reset"]
    assert receiver["round3"] == [20.0, 21.0]  # refused ops did not disturb message order
    assert receiver["outstanding_after"] == 0 and receiver["num_buffers_after_reset"] == 0
    assert receiver["healthy"]


# --------------------------------------------------------------------------- failures (own worlds)


def test_unmatched_ops_time_out_with_a_full_message():
    timeout_s = 1.0
    with World(3) as w:
        r0, _, r2 = w.run_ok(fns.unmatched_ops, timeout_s, timeout=30)
    err = r0["error"]
    assert type(err) is CommTimeout
    assert str(err) == (
        "rank 0: recv of hidden (2, 4, 8) float32, 256 bytes, from rank 1 timed out after 1.0 s at step 3, patch 1"
    )
    assert timeout_s - 0.05 <= r0["elapsed"] < timeout_s + 1.0
    assert (err.rank, err.peer, err.op, err.nbytes) == (0, 1, "recv", 256)
    assert "FAILED" in err.op_log and "recv hidden" in err.op_log
    assert "unusable after an earlier failure" in r0["after"]

    err = r2["error"]
    assert type(err) is CommTimeout and r2["elapsed"] < timeout_s + 1.0
    assert str(err) == (
        "rank 2: send of skip (2, 4, 8) bfloat16, 128 bytes, to rank 1 timed out after 1.0 s "
        "at step 7, whole image, batch part 1"
    )
    assert (err.patch, err.part) == (None, 1) and "step 7 patch None part 1  failed in" in err.op_log


def test_stream_ordered_waits_are_bounded_by_the_watchdog(tmp_path):
    timeout_s = 1.0
    with World(3) as w:
        results = w.run(fns.stream_ordered_ops_never_matched, timeout_s, str(tmp_path), timeout=30)
    for rank, op in ((0, "recv of hidden (2, 4, 8) float32, 256 bytes, from rank 1"),
                     (2, "send of skip (2, 4, 8) bfloat16, 128 bytes, to rank 1")):  # fmt: skip
        assert isinstance(results[rank].error, RankDied) and results[rank].error.exitcode == 3
        with open(tmp_path / f"rank{rank}.pkl", "rb") as fh:
            got = pickle.load(fh)
        err = got["error"]
        assert type(err) is CommTimeout
        patch = "step 3, patch 1" if rank == 0 else "step 7, whole image, batch part 1"
        assert str(err) == f"rank {rank}: {op} timed out after 1.0 s at {patch}"
        # the watchdog's timeout, then its grace period for the main thread (0.5 s), then on_stuck
        assert timeout_s + 0.5 <= got["elapsed"] < timeout_s + 1.5
        assert "FAILED" in err.op_log
        assert got["state"].startswith("waiting 1.") and got["state"].endswith(f" rank 1 at {patch}")


def test_killed_peer_is_reported_quickly():
    timeout_s = 30.0
    with World(3) as w:
        threading.Timer(1.5, w.kill, args=(1,)).start()
        t0 = time.monotonic()
        res = w.run(fns.wait_on_peer, 1, timeout_s, timeout=60)
        wall = time.monotonic() - t0
    assert isinstance(res[1].error, RankDied)
    assert wall < 10.0  # noticed within moments of the kill, not at timeout_s
    for r, op in (
        (res[0], "recv of hidden (64, 64) float32, 16384 bytes, from rank 1"),
        (res[2], "send of latent (64, 64) float32, 16384 bytes, to rank 1"),
    ):
        err = r.value["error"]
        assert isinstance(err, PeerLost), err
        assert str(err).startswith(f"rank {r.rank}: {op} failed: peer lost at step 5")
        assert err.peer == 1 and r.value["elapsed"] < 8.0
