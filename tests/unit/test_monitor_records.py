"""The failure monitor's records: what one rank publishes and another reads back, as data (JSON through the
store), and the sentences the failure reports print from them."""

import pytest
import torch
import torch.distributed as dist

from xfuse.comm.errors import CommTimeout, PeerLost
from xfuse.comm.stats import OpRecord, WaitState
from xfuse.runtime.monitor import FailureMonitor, FailureRecord, RankState

FIELDS = {"rank": 2, "op": "recv", "kind": "hidden", "shape": (2, 8, 4), "dtype": torch.float32, "nbytes": 256}


def _wait(peer: int, patch: int | None = 0, part: int | None = None) -> WaitState:
    record = OpRecord("recv", "hidden", peer, (2, 8, 4), torch.float32, 256, 2, patch, t_post=10.0, part=part)
    return WaitState.of(record, since=10.0, now=13.25)


@pytest.mark.parametrize(
    ("wait", "sentence"),
    [
        (_wait(1), "waiting 3.2 s: recv of hidden from rank 1 at step 2, patch 0"),
        (_wait(3, None, part=1), "waiting 3.2 s: recv of hidden from rank 3 at step 2, whole image, batch part 1"),
    ],
)
def test_a_wait_reads_as_the_reports_print_it(wait, sentence):
    assert wait.sentence() == sentence


def test_rank_states_round_trip_and_name_the_rank_they_wait_for():
    waiting = RankState((_wait(1), _wait(3)), idle_s=0.0)
    assert RankState.from_json(waiting.to_json()) == waiting
    assert waiting.waits_for == 1  # the first wait: where who-waits-for-whom goes next
    assert waiting.sentence() == (
        "waiting 3.2 s: recv of hidden from rank 1 at step 2, patch 0; "
        "waiting 3.2 s: recv of hidden from rank 3 at step 2, patch 0"
    )
    idle = RankState((), idle_s=5.04)
    assert RankState.from_json(idle.to_json().encode()) == idle  # the store hands back bytes
    assert idle.waits_for is None and idle.sentence() == "not communicating for 5.0 s (computing, or stalled)"


@pytest.mark.parametrize(
    ("error", "lost_peer"),
    [
        (PeerLost.for_op(what="failed: peer lost", step=2, patch=1, peer=3, **FIELDS), 3),
        (CommTimeout.for_op(what="timed out after 5.0 s", step=2, patch=1, peer=3, **FIELDS), None),
        (RuntimeError("recv from rank 7 failed: peer lost"), None),  # only a real PeerLost lost a peer
        (ValueError("rank 1 refused its input"), None),
    ],
)
def test_failure_records_round_trip_and_say_whether_a_peer_was_lost(error, lost_peer):
    record = FailureRecord.of_error(2, error)
    assert FailureRecord.from_json(record.to_json()) == record
    assert record.lost_peer == lost_peer
    assert str(record) == f"rank 2: {type(error).__name__}: {error}"


def test_the_first_failure_is_the_first_writers_and_reads_back_as_a_record(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    first, later = FailureMonitor(0, store, poll_s=0.05), FailureMonitor(1, store, poll_s=0.05)
    try:
        lost = PeerLost.for_op(what="failed: peer lost", step=1, patch=0, peer=3, **FIELDS)
        assert first.record(lost) == FailureRecord.of_error(0, lost)
        assert later.record(ValueError("later")) == FailureRecord.of_error(0, lost)  # compare_set: first wins
        reader = FailureMonitor(2, store, poll_s=0.05)
        assert reader.first() == FailureRecord.of_error(0, lost) and reader.first().lost_peer == 3
        reader.stop()
    finally:
        assert first.stop() and later.stop()


def test_diagnose_follows_the_published_waits_to_the_rank_that_is_not_waiting(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    monitor = FailureMonitor(0, store, poll_s=0.05, world_size=3)
    try:
        monitor.stop()  # this test publishes the other ranks' states itself
        store.set("xfuse/state/1", RankState((_wait(2),), idle_s=0.0).to_json())
        store.set("xfuse/state/2", RankState((), idle_s=5.0).to_json())
        assert monitor.diagnose(1) == (
            "who waits for whom:\n"
            "  rank 1: waiting 3.2 s: recv of hidden from rank 2 at step 2, patch 0\n"
            "  rank 2: not communicating for 5.0 s (computing, or stalled)"
        )
    finally:
        monitor.stop()
