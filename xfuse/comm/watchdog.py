"""Bounded waits without a host stall: a thread that ages every operation the device is waiting on.

With NCCL, ``Work.wait()`` only makes the current CUDA stream wait for the operation and returns at once, so the
host can queue the next task's kernels while the message is still in flight. What it gives up is the bound: a
receive that never arrives would stall the GPU (and, once the launch queue fills, the host) forever. The watchdog
gives the bound back. Each stream-ordered wait hands its operation to the watchdog; a daemon thread polls
``Work.is_completed()`` (an event query, no synchronisation) every ``poll_s`` and

* retires completed operations (their op-log record becomes "done" with the device's completion time, give or take
  ``poll_s``; a send's tensor is dropped only then, so the memory stays alive until the device has sent it);
* fails the first one older than ``timeout_s`` (counted from its wait, as the host-blocking waits count): the
  channels get the same :class:`CommTimeout` a blocking wait raises (rank, peer, op, kind, shape, bytes, step,
  patch), the communicators are aborted so the device stops waiting, and the main thread raises that error at its
  next call into the channels. If the main thread does not get there within ``grace_s`` (it is blocked in a device
  synchronisation behind the stuck operation), ``on_stuck(error)`` reports from this thread and ends the process.

The thread is started by the first stream-ordered wait and stopped and joined by ``stop()`` (``P2PChannels.close``,
called by ``xfuse.runtime.world.shutdown`` before the interpreter finalizes: see ``xfuse.runtime.monitor`` for why a
thread must not be left inside a C++ call then).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from xfuse.stderr import write_stderr


class Watched(Protocol):
    """What the watchdog ages: a posted operation whose completion the device reports (``xfuse.comm.p2p``'s
    handles)."""

    def is_completed(self) -> bool:
        """Whether the device finished the operation (polled by the watchdog's thread)."""
        ...

    def retire(self, now: float) -> None:
        """Mark the operation done at ``now`` (``time.monotonic()``)."""
        ...


__all__ = ["CommWatchdog", "exit_on_stuck"]


def exit_on_stuck(error: BaseException) -> None:
    """Default ``on_stuck``: print the error (with the op log it carries) and end the process at once.

    ``os._exit`` because the main thread is blocked in the device and cannot unwind; the failure monitor, when the
    process has one, installs its own handler that also records the failure for the other ranks first.
    """
    write_stderr(f"{error}\n{getattr(error, 'op_log', '')}".rstrip())
    os._exit(1)


W = TypeVar("W", bound=Watched)  # the handles one watchdog ages


class CommWatchdog(Generic[W]):
    """Ages the operations of one ``P2PChannels`` that the device waits on (see the module docstring).

    Args:
        timeout_s: how long an operation may stay incomplete after its wait.
        fail: ``fail(handle, elapsed_s) -> error``: called on this thread for the first expired operation; marks
            the channels failed, aborts the communicators and returns the error.
        poll_s: how often ``is_completed()`` is polled.
        grace_s: how long the main thread has to raise the error itself before ``on_stuck`` runs.
        on_stuck: ``on_stuck(error)``, called on this thread when the main thread did not raise in time; must not
            return normally (the default prints and ``os._exit(1)``).
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        fail: Callable,
        poll_s: float = 0.02,
        grace_s: float = 2.0,
        on_stuck: Callable[[BaseException], None] = exit_on_stuck,
    ) -> None:
        self.timeout_s, self.poll_s, self.grace_s = timeout_s, poll_s, grace_s
        self.fail, self.on_stuck = fail, on_stuck
        self.error: BaseException | None = None  # set once an operation expired
        self.raised = threading.Event()  # set by the main thread when it raised ``error``
        self._entries: list[tuple[W, float]] = []  # (handle, since), oldest first
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- main thread --------------------------------------------------------------------------------------
    def watch(self, handle: W) -> None:
        """Age ``handle`` (a pending operation whose wait was just queued on the device) until it completes."""
        with self._lock:
            self._entries.append((handle, time.monotonic()))
        if self._thread is None:
            # daemon: a watchdog nobody stopped must not keep a finished process alive; stop() joins it.
            self._thread = threading.Thread(target=self._run, name="xfuse-comm-watchdog", daemon=True)
            self._thread.start()

    def retire(self, handle: W) -> None:
        """The operation is known complete (gloo: its blocking wait returned): stop aging it, mark it done."""
        self.forget(handle)
        handle.retire(time.monotonic())

    def forget(self, handle: W) -> None:
        """Stop aging ``handle`` (completed, or failed on the main thread)."""
        with self._lock:
            self._entries = [e for e in self._entries if e[0] is not handle]

    def oldest(self) -> tuple[W, float] | None:
        """(handle, since) of the oldest operation still in flight on the device, or None. Thread-safe."""
        with self._lock:
            return self._entries[0] if self._entries else None

    def outstanding(self) -> int:
        with self._lock:
            return len(self._entries)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop and join the thread; idempotent. False if it did not finish within ``timeout_s``."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        if thread.is_alive():
            return False
        self._thread = None
        return True

    # --- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.error is not None:
                if self.raised.wait(self.grace_s) or self._stop.is_set():
                    return  # the main thread has it: its error path reports and tears down
                self.on_stuck(self.error)
                return
            self._poll()

    def _poll(self) -> None:
        with self._lock:
            entries = list(self._entries)
        now = time.monotonic()
        done: list[W] = []
        for handle, since in entries:
            if handle.is_completed():
                done.append(handle)
            elif now - since > self.timeout_s:
                self.error = self.fail(handle, now - since)
                break
        if done:
            finished = {id(h) for h in done}
            with self._lock:
                self._entries = [e for e in self._entries if id(e[0]) not in finished]
            for handle in done:
                handle.retire(now)
