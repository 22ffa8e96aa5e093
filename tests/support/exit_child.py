"""One rank of tests/launch/test_exit.py: a 2-rank xfuse world whose rank exits normally while its failure monitor's
thread is held inside a rendezvous-store call.

    python -m tests.support.exit_child RANK STORE_FILE

Prints ``ready`` once the world is up, then waits for a line on stdin (the test has locked the FileStore's file, so
every store call blocks inside C++ with the GIL released). It prints ``exiting`` once the monitor thread has sat in
one store call for 0.5 s, and returns from main. ``SlowTeardown`` keeps interpreter finalization open for 3 s, as
the teardown of a real rank does (process groups, torch, CUDA): before issue 15's fix the store call returned into
that finalizing interpreter and the rank died of SIGABRT ("terminate called without an active exception").
"""

import sys
import threading
import time

STORE_CALLS = {"publish_state", "first"}  # FailureMonitor's methods that call into the store from its thread


class SlowTeardown:
    """Collected when the interpreter clears ``__main__``, i.e. after finalization has begun."""

    def __del__(self):
        print("finalizing", flush=True)
        time.sleep(3.0)


def monitor_thread(rank: int) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == f"xfuse-monitor-{rank}")


def wait_until_inside_store_call(thread: threading.Thread, held_s: float = 0.5, limit_s: float = 20.0) -> None:
    since, deadline = None, time.monotonic() + limit_s
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)
        inside = frame is not None and frame.f_code.co_name in STORE_CALLS
        since = (since or time.monotonic()) if inside else None
        if since is not None and time.monotonic() - since >= held_s:
            return
        time.sleep(0.01)
    raise TimeoutError("the monitor thread never blocked in a store call")


def main(rank: int, store_path: str) -> None:
    import torch.distributed as dist

    from xfuse.config import XfuseConfig
    from xfuse.runtime.world import init_parallel

    # The caller's own world (as a user embedding xfuse would create it): xfuse does not own the default group.
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    init_parallel(XfuseConfig(parallel={"pipefusion_degree": 2}, comm={"timeout_s": 10}, runtime={"device": "cpu"}))
    print("ready", flush=True)
    sys.stdin.readline()
    wait_until_inside_store_call(monitor_thread(rank))
    print("exiting", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
    teardown = SlowTeardown()  # a module global: deleted while the interpreter finalizes
