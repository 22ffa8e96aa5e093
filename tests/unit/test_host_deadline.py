"""``HostDeadline`` in one process: what it names, what it does not age, and that it leaves nothing armed.

The real drills (a stalled host and a frozen one, on real rank processes) are in ``tests/launch/test_faults.py``."""

import subprocess
import sys
import threading
import time

import pytest

from tests.support import REPO
from xfuse.runtime.host_deadline import HostDeadline, HostStalled


class Stuck:
    """An ``on_stuck`` that keeps the error and lets the test go on (the real one ends the process)."""

    def __init__(self):
        self.errors: list[BaseException] = []
        self.called = threading.Event()

    def __call__(self, error):
        self.errors.append(error)
        self.called.set()


def deadline(timeout_s=0.3, waiting=lambda: False):
    stuck = Stuck()
    return HostDeadline(3, timeout_s, waiting=waiting, on_stuck=stuck, poll_s=0.02), stuck


def a_host_that_stops_here(stuck: Stuck) -> None:
    stuck.called.wait(5)  # the main thread "blocked" where the report must find it


def test_a_host_without_a_beat_is_named_with_the_last_task_and_where_it_is():
    watch, stuck = deadline()
    with watch.request():
        watch.beat("s2 p1 blocks 0-3")
        start = time.monotonic()
        a_host_that_stops_here(stuck)
        elapsed = time.monotonic() - start
    (error,) = stuck.errors
    assert isinstance(error, HostStalled)
    message = str(error)
    assert message.startswith("rank 3: no task of the denoising loop finished for 0.3 s (comm.host_timeout_s: 0.3)")
    assert "the last one finished was s2 p1 blocks 0-3;" in message
    assert "in a_host_that_stops_here" in message  # the main thread's frames, innermost first
    assert 0.3 < elapsed < 1.0


def test_beats_and_bounded_waits_keep_it_quiet():
    waits = {"now": False}
    watch, stuck = deadline(waiting=lambda: waits["now"])
    with watch.request():
        for _ in range(6):  # tasks finishing every 0.1 s: two timeouts' worth
            time.sleep(0.1)
            watch.beat("a task")
        waits["now"] = True  # then a wait for a message of two timeouts: comm.timeout_s bounds that, not this
        time.sleep(0.6)
        waits["now"] = False
        watch.beat("the task after the wait")
        with watch.in_wait():  # a wait bounded elsewhere (rank 0's stop decision, by comm.timeout_s): not aged
            time.sleep(0.6)
        watch.beat("the task after the decision")
    time.sleep(0.6)  # after the request: a served rank idles between requests, unaged
    assert stuck.errors == []
    watch.stop()


SCRIPT = """
import ctypes, sys, time
import xfuse.runtime.host_deadline as hd
hd.BACKSTOP_S = 0.1  # faulthandler's timer at 0.2 + 0.2 s
watch = hd.HostDeadline(0, 0.2, on_stuck=lambda error: None, poll_s=0.02)
with watch.request():
    watch.beat("a task")
    if sys.argv[1] == "freeze":  # the interpreter lock held: the deadline's thread cannot run, the timer fires
        ctypes.PyDLL(None).sleep(5)
time.sleep(1.0)  # after the request: a timer left set would end this idle process
print("alive after the request")
"""


@pytest.mark.parametrize("how", ["return", "freeze"])
def test_faulthandler_ends_a_frozen_request_and_nothing_after_one(how):
    run = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=60, cwd=REPO)
    if how == "return":
        assert (run.returncode, run.stdout) == (0, "alive after the request\n"), run.stderr
    else:
        assert run.returncode == 1 and run.stdout == "", run.stdout
        assert run.stderr.startswith("Timeout (0:00:00."), run.stderr  # faulthandler's own header, then the stacks
        assert 'File "<string>", line 9 in <module>' in run.stderr, run.stderr  # the frozen call


def test_sigusr1_writes_every_threads_stack_and_the_process_goes_on():
    script = (
        "import os, signal\n"
        "from xfuse.runtime.host_deadline import register_stack_dump\n"
        "def looked_into():\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "register_stack_dump()\n"
        "looked_into()\n"
        "print('went on')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (run.returncode, run.stdout) == (0, "went on\n"), run.stderr
    assert run.stderr.startswith("Current thread 0x"), run.stderr
    assert 'File "<string>", line 4 in looked_into' in run.stderr, run.stderr
