"""Issue 15: a finished run must exit 0. Every background thread xfuse starts is stopped and joined before the
interpreter finalizes (xfuse.runtime.world.shutdown: monitor -> channels -> groups)."""

import fcntl
import os
import selectors
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from tests.support import REPO
from xfuse.comm.errors import CommError
from xfuse.comm.p2p import P2PChannels
from xfuse.runtime.monitor import FailureMonitor, RankState

ROOT = str(REPO)
ENV = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # offline: tests/conftest.py


def expect(proc: subprocess.Popen, word: str, timeout_s: float) -> None:
    """Read ``proc``'s stdout until a line equal to ``word``; fail after ``timeout_s``."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                line = proc.stdout.readline()
                if line.strip() == word:
                    return
                if not line:
                    break
    proc.kill()
    pytest.fail(f"rank never printed {word!r}; stderr: {proc.communicate()[1][-3000:]}")


class LockedStore:
    """Holds an exclusive flock on a FileStore's file: every call of that store blocks in C++ until unlock()."""

    def __init__(self, path) -> None:
        self.file = open(path, "rb+")

    def lock(self) -> None:
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def unlock(self) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)


def test_rank_exits_cleanly_while_its_monitor_is_inside_a_store_call(tmp_path):
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.exit_child", str(rank), str(store)],
            cwd=ROOT,
            env=ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        for proc in ranks:
            expect(proc, "ready", timeout_s=120)
        locked = LockedStore(store)
        locked.lock()
        for proc in ranks:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in ranks:
            expect(proc, "exiting", timeout_s=30)
        # Both ranks are past main; their monitors are inside a store call. Let the calls return 1 s later: into a
        # finalizing interpreter without the fix (SIGABRT), into a shutdown() that is joining them with it.
        time.sleep(1.0)
        locked.unlock()
        results = [proc.communicate(timeout=60) for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()
    for rank, (proc, (out, err)) in enumerate(zip(ranks, results, strict=True)):
        assert "terminate called" not in err and proc.returncode == 0, f"rank {rank} rc {proc.returncode}:\n{err}"
        assert out.strip().splitlines()[-1] == "finalizing"  # the interpreter did finalize, after the join


@pytest.fixture
def file_store(tmp_path):
    path = tmp_path / "store"
    return dist.PrefixStore("default_pg", dist.FileStore(str(path), 1)), LockedStore(path)


def test_stop_joins_the_watcher_promptly(file_store):
    store, _ = file_store
    monitor = FailureMonitor(0, store, poll_s=0.05)
    assert monitor.running
    time.sleep(0.2)
    state = RankState.from_json(store.get("xfuse/state/0"))
    assert state.sentence().startswith("not communicating")  # the watcher published through the store
    start = time.monotonic()
    assert monitor.stop() is True
    assert time.monotonic() - start < 1.0 and not monitor.running
    assert "xfuse-monitor-0" not in [t.name for t in threading.enumerate()]
    assert monitor.stop() is True  # idempotent


def test_stop_waits_for_the_store_call_in_flight_then_reports_if_it_never_ends(file_store, capfd):
    store, locked = file_store
    monitor = FailureMonitor(3, store, poll_s=0.05)
    time.sleep(0.2)
    locked.lock()
    time.sleep(0.3)  # the watcher is now blocked inside a store call
    assert monitor.stop(timeout_s=0.5) is False and monitor.running
    assert "rank 3: the failure monitor is still inside a rendezvous-store call after 0.5 s" in capfd.readouterr().err
    locked.unlock()
    assert monitor.stop(timeout_s=5.0) is True and not monitor.running  # the call returned: the thread saw the stop


def test_closed_channels_refuse_work_by_name():
    channels = P2PChannels(rank=0, timeout_s=1.0, max_inflight=2, device="cpu")
    channels.close()
    channels.close()
    with pytest.raises(CommError, match=r"rank 0: channels closed \(xfuse.runtime.world.shutdown\)"):
        channels.exchange(sends=[], recvs=[])
    assert channels.num_buffers == 0


TEARDOWN_NEVER_RETURNS = """
import sys, threading, time
import torch.distributed as dist
from xfuse.runtime import world

dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
world._RESOURCES.owns_default_group = True  # as init_parallel leaves it when xfuse made the default group
# NCCL's destroy on a device stopped by a kernel that never ends (NVIDIA/nccl#829) cannot run here: one that blocks
dist.destroy_process_group = lambda: threading.Event().wait()
start = time.monotonic()
print(world.shutdown(join_timeout_s=0.5), round(time.monotonic() - start, 2), flush=True)
"""


def test_shutdown_leaves_a_process_group_destroy_that_never_returns_behind(tmp_path):
    """The second GPU runs' ranks reported their failure, then hung in ``destroy_process_group``: ``shutdown`` gives
    it ``join_timeout_s`` and returns False (the CLI then leaves with ``os._exit``), and the process can end."""
    out = subprocess.run([sys.executable, "-c", TEARDOWN_NEVER_RETURNS, str(tmp_path / "store")], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    stopped, seconds = out.stdout.split()
    assert stopped == "False" and 0.5 <= float(seconds) < 3.0, out.stdout
    assert "destroying the process groups did not return within 0.5 s (NCCL waits for the device)" in out.stderr
