"""Tests for tests.support.world: real gloo ranks in real processes, no mocks."""

import multiprocessing
import os
import re
import threading
import time

import pytest

from tests.support import world_fns as fns
from tests.support.world import _STACKS_WAIT_S as STACKS_WAIT_S
from tests.support.world import RankDied, RemoteError, World, WorldError, WorldTimeout, run_world


def _gone(pid: int) -> bool:
    """True if no process (not even a zombie) has this pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def world():
    # Starting ranks costs ~1 s each on 2 cores: one shared world for the happy-path tests.
    w = World(3)
    yield w
    w.close()
    assert all(_gone(pid) for pid in w.pids)


def test_all_reduce_and_rank_setup(world):
    assert world.alive and len(world.pids) == 3
    assert world.run_ok(fns.all_reduce_sum, 2.0) == [12.0, 12.0, 12.0]  # 2 * (1 + 2 + 3)
    who = world.run_ok(fns.whoami)
    assert [w[:2] for w in who] == [(0, 3), (1, 3), (2, 3)]
    assert [w[2] for w in who] == world.pids
    assert all(w[3] == 1 and w[4] == "1" for w in who)  # threads_per_rank, HF_HUB_OFFLINE


def test_sequential_calls_keep_rank_state(world):
    assert world.run_ok(fns.remember, "a", 1) == [1, 1, 1]
    assert world.run_ok(fns.remember, "b", 2) == [2, 2, 2]
    assert world.run_ok(fns.recall, "a") == [(1, 0), (1, 1), (1, 2)]
    assert world.run_ok(fns.all_reduce_sum) == [6.0] * 3


def test_exception_on_one_rank(world):
    res = world.run(fns.fail_on, 1)
    assert [r.value for r in res] == [0, None, 20]
    assert res[0].ok and res[2].ok
    err = res[1].error
    assert isinstance(err, fns.CustomError) and str(err) == "boom on rank 1"
    assert "world_fns.py" in res[1].traceback and "in fail_on" in res[1].traceback

    with pytest.raises(WorldError, match="boom on rank 1") as info:
        world.run_ok(fns.fail_on, 1)
    assert "in fail_on" in str(info.value) and len(info.value.results) == 3

    # Exceptions that cannot be pickled back arrive as RemoteError with the type name.
    res = world.run(fns.fail_on, 2, "unpicklable")
    assert isinstance(res[2].error, RemoteError)
    assert res[2].error.type_name.endswith("UnpicklableError") and "x/y" in str(res[2].error)
    # So do unpicklable return values; the rank stays usable.
    res = world.run(fns.unpicklable_value)
    assert isinstance(res[0].error, TypeError) and [r.value for r in res[1:]] == ["ok", "ok"]
    assert world.run_ok(fns.all_reduce_sum) == [6.0] * 3


def test_unpicklable_fn_is_rejected_before_sending(world):
    with pytest.raises(TypeError, match="top-level function"):
        world.run(lambda: 1)
    assert world.run_ok(fns.all_reduce_sum) == [6.0] * 3


def test_run_world_one_shot_and_rank_exit():
    res = run_world(2, fns.exit_on, 1, 3)
    assert res[0].value == 0
    assert isinstance(res[1].error, RankDied) and res[1].error.exitcode == 3


def test_hang_times_out_and_kills_everything():
    w = World(2)
    t0 = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        w.run(fns.recv_never_matched, timeout=2.0)
    assert time.monotonic() - t0 < 2.0 + 3.0 + STACKS_WAIT_S
    assert info.value.pending == [0] and info.value.answered[1].value == "done"
    assert "ranks [0] did not answer" in str(info.value) and "rank 1 -> 'done'" in str(info.value)
    # the rank that did not answer wrote where it was before it was killed (every thread: its main one in the call)
    stacks = str(info.value).split("rank 0's stacks when it was killed:\n", 1)[1]
    assert re.search(r'File ".*world_fns\.py", line \d+ in recv_never_matched', stacks), stacks
    assert "rank 1's stacks" not in str(info.value)  # it answered
    assert not w.alive and all(_gone(pid) for pid in w.pids)
    with pytest.raises(RuntimeError, match="world is dead"):
        w.run(fns.whoami)
    w.close()
    w.close()


def test_kill_rank_mid_call():
    with World(2) as w:
        pids = list(w.pids)
        # Rank 1 sleeps before the barrier, rank 0 waits in it; kill rank 1 meanwhile.
        threading.Timer(0.5, w.kill, args=(1,)).start()
        t0 = time.monotonic()
        res = w.run(fns.sleep_then_barrier, 1, 60.0, timeout=30.0)
        # The survivor's barrier fails ("connection closed") or, at worst, the timeout ends it.
        assert time.monotonic() - t0 < 10.0
        assert isinstance(res[1].error, RankDied) and res[1].error.exitcode == -9
        assert "SIGKILL" in str(res[1].error)
        assert res[0].error is not None
        assert not w.alive
        with pytest.raises(RuntimeError, match="world is dead"):
            w.run(fns.whoami)
    assert all(_gone(pid) for pid in pids)


def test_close_is_idempotent():
    w = World(1)
    assert w.run_ok(fns.whoami)[0][:2] == (0, 1)
    w.close()
    assert not w.alive and all(_gone(pid) for pid in w.pids)
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.run(fns.whoami)


def test_start_failure_is_reported_and_cleaned_up():
    before = set(multiprocessing.active_children())  # the module's shared world may still be running
    with pytest.raises(RuntimeError, match="failed to start") as info:
        World(2, backend="no-such-backend", start_timeout=60.0)
    assert "init_process_group" in str(info.value)  # the rank's traceback is in the message
    assert set(multiprocessing.active_children()) == before
