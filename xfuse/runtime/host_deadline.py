"""A bound on a rank whose host stops inside the denoising loop where no wait of xfuse's is running to time out.

Every wait of xfuse's for a message is bounded by ``comm.timeout_s`` (``xfuse.comm.p2p``: the host's own wait, or the
comm watchdog aging what the device waits for). A host can also stop outside them: on CUDA it blocks inside a kernel
launch once the device's queue is full and the device itself waits on something that never completes (two ranks of
FLUX.2 [klein] over NCCL on one H200, both hosts inside a ``Linear`` at step 0 with no watched operation overdue:
``docs/performance/gpu.md``, "Second GPU run"). Then nothing of the comm layer fires, and before this module the run
hung until something outside it ended it.

``HostDeadline`` ages the host between the loop's tasks: ``beat(place)`` at each task of the engine's program,
``request()`` around one request (a served rank waiting for its next request is not aged). Time the rank spends in
one of its bounded waits (``waiting()``: a channel's ``wait_state``) does not count: the comm timeout names that
better. Past ``timeout_s`` without a beat, a thread reports ``HostStalled`` naming the rank, the last task it
finished and where its main thread is now, through ``on_stuck`` (the failure monitor's ``fail_from_thread``: the
other ranks learn it, the process ends). That thread needs the interpreter lock; a host frozen holding it (a C call
that never returns without releasing it) is ended by ``faulthandler``'s own timer instead: the thread re-arms it at
each look, so it fires only when the thread has not run for ``timeout_s`` and more, and it writes every thread's
stack (headed ``Timeout (h:mm:ss)!``) and exits 1 without running any Python.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from xfuse.comm.watchdog import exit_on_stuck

# faulthandler's timer is re-armed at most this often (re-arming starts a thread), to ``timeout_s`` + 2 x this: it
# ends a process whose Python threads have not run for between ``timeout_s`` + this and ``timeout_s`` + 2 x this.
BACKSTOP_S = 5.0
FRAMES = 4  # innermost frames of the main thread quoted in the report


def register_stack_dump() -> None:
    """From now on SIGUSR1 writes every thread's stack to stderr (faulthandler's C handler: it needs no Python thread
    to run) and the process goes on."""
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__ or 2, all_threads=True)


class HostStalled(RuntimeError):
    """A rank's host finished no task of the denoising loop for ``comm.host_timeout_s`` outside a bounded wait."""


def main_thread_frames(limit: int = FRAMES) -> str:
    """The main thread's ``limit`` innermost frames, innermost last, one ``file:line in function`` each."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "(no main thread)"
    stack = traceback.extract_stack(frame)[-limit:]
    return " <- ".join(f"{entry.filename}:{entry.lineno} in {entry.name}" for entry in reversed(stack))


class HostDeadline:
    """See the module docstring.

    Args:
        rank: this global rank, for the report.
        timeout_s: how long the host may go without a ``beat`` outside a bounded wait.
        waiting: whether the rank is inside one of its bounded waits now (safe to call from another thread).
        on_stuck: ``on_stuck(error)``, called on the deadline's thread; must not return normally.
        poll_s: how often the thread looks.
    """

    def __init__(
        self,
        rank: int,
        timeout_s: float,
        waiting: Callable[[], bool] = lambda: False,
        on_stuck: Callable[[BaseException], None] = exit_on_stuck,
        poll_s: float = 0.25,
    ):
        self.rank, self.timeout_s, self.poll_s = rank, timeout_s, poll_s
        self.waiting, self.on_stuck = waiting, on_stuck
        self._since = 0.0  # the last beat (or bounded wait seen)
        self._place: object = None  # what the last beat finished (None: nothing yet in this request)
        self._describe: Callable[[object], str] = str
        self._armed_at = 0.0  # when faulthandler's timer was last set
        self._active = False
        self._in_wait = False  # inside another bounded wait of the loop (``in_wait``)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def request(self, describe: Callable[[object], str] = str):
        """Age the host from now until the block ends (one request's denoising loop); ``describe(place)`` names a
        beat's place in a report only (the loop beats with its task objects: nothing is formatted per task)."""
        self._describe = describe
        with self._lock:
            self._active = True
            self._since, self._place = time.monotonic(), None
            self._arm(self._since)
        if self._thread is None:
            # daemon: a deadline nobody stopped must not keep a finished process alive
            self._thread = threading.Thread(target=self._run, name=f"xfuse-host-deadline-{self.rank}", daemon=True)
            self._thread.start()
        try:
            yield self
        finally:
            with self._lock:  # with the thread's re-arming: no timer left set after this
                self._active = False
                faulthandler.cancel_dump_traceback_later()

    @contextlib.contextmanager
    def bounded_by(self, timeout_s: float):
        """``timeout_s`` (if longer) instead of ``self.timeout_s`` inside the block: a request that compiles new
        shapes first (``compile.timeout_s``), where the host finishes no task while a block compiles."""
        with self._lock:
            saved = self.timeout_s
            self.timeout_s = max(saved, float(timeout_s))
            if self._active:
                self._arm(time.monotonic())
        try:
            yield self
        finally:
            with self._lock:
                self.timeout_s = saved
                if self._active:
                    self._arm(time.monotonic())

    @contextlib.contextmanager
    def in_wait(self):
        """A wait of the loop's own that is bounded elsewhere (a stop decision from rank 0, bounded by
        ``comm.timeout_s`` and named by it): not aged, like a wait for a message."""
        self._in_wait = True
        try:
            yield
        finally:
            self._in_wait = False

    def beat(self, place: object) -> None:
        """The host finished ``place`` (a task of the loop): start aging again."""
        with self._lock:
            self._since, self._place = time.monotonic(), place

    def _arm(self, now: float) -> None:
        """Set faulthandler's timer (under ``_lock``, while a request is aged)."""
        self._armed_at = now
        faulthandler.dump_traceback_later(self.timeout_s + 2 * BACKSTOP_S, exit=True, file=sys.__stderr__ or 2)

    def stop(self) -> None:
        """End the thread and the backstop; idempotent."""
        self._stop.set()
        with self._lock:
            self._active = False
            faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            waiting = self.waiting() or self._in_wait  # outside the lock: it asks the channels
            now = time.monotonic()
            with self._lock:
                if not self._active:
                    continue
                if now - self._armed_at >= BACKSTOP_S:  # this thread runs: the interpreter is not frozen
                    self._arm(now)
                if waiting:  # bounded by comm.timeout_s, and named better by it
                    self._since = now
                idle, place = now - self._since, self._place
                if idle > self.timeout_s:
                    faulthandler.cancel_dump_traceback_later()  # this report instead of the bare stacks
            if idle > self.timeout_s:
                last = "none yet" if place is None else self._describe(place)
                self.on_stuck(
                    HostStalled(
                        f"rank {self.rank}: no task of the denoising loop finished for {idle:.1f} s "
                        f"(comm.host_timeout_s: {self.timeout_s:g}) outside a wait for a message; the last one "
                        f"finished was {last}; the host is inside {main_thread_frames()}"
                    )
                )
                return
