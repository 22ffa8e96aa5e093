"""Never hang, always say why: failure propagation across ranks (the start-up agreement is ``handshake``'s).

``FailureMonitor``: the first rank to fail writes its error into the process group's key-value store
(``compare_set``: the first writer wins). Every later failure on any rank names that first failure. A daemon thread
polls the store: a rank stuck in communication after another rank failed reports and exits instead of sitting out
its timeout; under torchrun, a rank terminated by the launcher (SIGTERM) says why before exiting. On failure each
rank writes its ring buffer of recent communication ops to stderr (and to ``$XFUSE_LOG_DIR/rank<R>.ops.log`` when
set).

The watcher thread must be stopped and joined (``FailureMonitor.stop``) before the interpreter finalizes: a Python
thread that returns from a C++ call (a store call releases the GIL) after finalization has begun is ended by
``pthread_exit``, whose forced unwind through pybind11's noexcept ``gil_scoped_release`` destructor calls
``std::terminate`` -- "terminate called without an active exception", SIGABRT, at the end of a run that had
succeeded. ``xfuse.runtime.world.shutdown`` owns that stop (and the teardown order around it).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

import torch.distributed as dist

from xfuse.errors import WorldFailure
from xfuse.runtime.stderr import clock, write_stderr

FAILURE_KEY = "xfuse/first_failure"
TERMINATED_KEY = "xfuse/terminated"  # + "/<rank>": the launcher terminated that rank (SIGTERM), it did not fail
ALIVE_KEY = "xfuse/alive"  # + "/<rank>": the time of that rank's last heartbeat, or LEFT
# A rank that stops its monitor in order overwrites its heartbeat with this; it never deletes the key: a reader's
# check() then get() would wait in get() for a key deleted between the two (TCPStore.get blocks on missing keys).
LEFT = "left"
# A healthy store answers in milliseconds; one that has not answered in this long has lost its host (or we ours).
STORE_CALL_TIMEOUT_S = 3.0


class StoreUnreachable(RuntimeError):
    """The rendezvous store did not answer a failure-path call in time (its host is gone, or this node lost it)."""


class BoundedStore:
    """The store calls of a failure path, each bounded by ``timeout_s``.

    A store whose host vanished (a node that lost its network) can leave a call blocked in the TCP connection far
    longer than any store timeout; on the failure path that would strand the rank. Each call runs on a daemon thread
    that is given up on after ``timeout_s``: from then on this store is ``lost`` and every call fails at once.
    """

    def __init__(self, store, timeout_s: float):
        self._store, self.timeout_s, self.lost = store, timeout_s, False

    def _call(self, name: str, *args):
        if self.lost:
            raise StoreUnreachable("the rendezvous store stopped answering earlier")
        outcome: dict = {}

        def run():
            try:
                outcome["value"] = getattr(self._store, name)(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                outcome["error"] = err

        thread = threading.Thread(target=run, name=f"xfuse-store-{name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():  # left behind, blocked in C++: a daemon thread, it ends with the process
            self.lost = True
            raise StoreUnreachable(f"the rendezvous store did not answer {name}() within {self.timeout_s:.1f} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def check(self, keys):
        return self._call("check", keys)

    def get(self, key):
        return self._call("get", key)

    def set(self, key, value):
        return self._call("set", key, value)

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, expected, desired)


class FailureMonitor:
    """Propagates the first failure of the world to every rank (see the module docstring).

    Args:
        rank: this global rank.
        store: the process group's key-value store (``None``: a single process, nothing to propagate, no thread).
        op_logs: callables returning this rank's recent communication ops as text, for failure reports.
        grace_s: how long a rank stuck in communication waits for its own error after another rank failed.
        poll_s: how often the watcher thread publishes this rank's state and heartbeat and looks for a failure.
        world_size: the ranks whose heartbeats a failure report checks (``None``: none).

    The watcher thread runs until ``stop()``; its owner (``xfuse.runtime.world.shutdown``) stops it before the process
    groups are destroyed and before the interpreter exits.
    """

    def __init__(
        self, rank: int, store, op_logs=(), grace_s: float = 2.0, poll_s: float = 0.25, world_size: int | None = None
    ):
        self.rank, self.op_logs, self.world_size = rank, list(op_logs), world_size
        # The main thread's client: used on failure paths only, where a vanished store host must not strand us.
        self.store = None if store is None else BoundedStore(store, timeout_s=STORE_CALL_TIMEOUT_S)
        self.state_sources: list = []  # callables: what this rank's channels wait for (None when not waiting)
        self._last_wait = time.monotonic()
        self.grace_s, self.poll_s = grace_s, poll_s
        self.active = 0  # >0 while this rank is inside a guarded (communicating) section
        self.failure: str | None = None  # the world's first failure, once known here
        self._reported = False
        # Re-entrant: the SIGTERM handler runs on the main thread, possibly in the middle of the main thread's own
        # report (gathering heartbeats from the store), and then leaves with os._exit; it must write the report.
        self._report_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            # The watcher talks to the store through its own client (torch: one clone per thread), so a slow call
            # of the watcher never holds up the main thread's record() behind the same connection.
            self._watch_store = _thread_client(store)
            # daemon: a monitor nobody stopped must not keep a finished process alive; stop() is what joins it.
            self._thread = threading.Thread(target=self._watch, name=f"xfuse-monitor-{rank}", daemon=True)
            self._thread.start()

    @property
    def store_lost(self) -> bool:
        """True once a failure-path call to the rendezvous store went unanswered (see `BoundedStore`)."""
        return self.store is not None and self.store.lost

    @property
    def running(self) -> bool:
        """True while the watcher thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the watcher thread and join it; idempotent. Returns True once no watcher thread runs.

        The thread finishes the store call it is in (milliseconds on a healthy store) and then sees the stop.
        False means it is still inside a store call after ``timeout_s`` (the store's host is alive but does not
        answer): that is reported on stderr, and the caller must not let the interpreter finalize under it
        (the CLI then leaves with ``os._exit``).
        """
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        if self.store_lost:  # the watcher is blocked in a call to the same vanished host: do not wait long for it
            timeout_s = min(timeout_s, 1.0)
        thread.join(timeout_s)
        if thread.is_alive():
            write_stderr(
                f"[xfuse {clock()}] rank {self.rank}: the failure monitor is still inside a rendezvous-store call "
                f"after {timeout_s:.1f} s (the store's host does not answer)"
            )
            return False
        self._thread = None
        return True

    # --- the store ----------------------------------------------------------------------------------------
    def record(self, error: BaseException) -> str:
        """Make ``error`` the world's first failure unless one exists; return the first failure."""
        mine = f"rank {self.rank}: {type(error).__name__}: {error}"
        if self.store is None:
            self.failure = self.failure or mine
            return self.failure
        try:
            first = self.store.compare_set(FAILURE_KEY, "", mine)
            self.failure = first.decode() if isinstance(first, bytes) else str(first)
        except Exception:  # noqa: BLE001 - the store died with its host: this error is the best we know
            self.failure = self.failure or mine
        return self.failure

    def first(self, store=None) -> str | None:
        """The world's first failure, if any rank recorded one (read from ``store``, default the main client)."""
        store = self.store if store is None else store
        if self.failure is None and store is not None:
            try:
                if store.check([FAILURE_KEY]):
                    value = store.get(FAILURE_KEY)
                    self.failure = (value.decode() if isinstance(value, bytes) else str(value)) or None
            except Exception as err:  # noqa: BLE001 - losing the store means its host (rank 0 / agent) is gone
                self.failure = f"the rendezvous store is unreachable ({type(err).__name__}: {err})"
        return self.failure

    # --- reporting ----------------------------------------------------------------------------------------
    @property
    def reported(self) -> bool:
        """True once this rank wrote its failure report (`report` writes one per process)."""
        return self._reported

    def report(self, headline: str) -> None:
        """Write ``headline`` and the recent communication ops to stderr (and $XFUSE_LOG_DIR), once.

        Marked written only once written: a report interrupted by the SIGTERM handler (which then leaves with
        ``os._exit``) is written by the handler instead of being lost."""
        with self._report_lock:
            if self._reported:
                return
            silent = self.silent_ranks()
            if silent:
                headline += "\n  " + silent
            if self.store_lost:
                headline += (
                    f"\n  the rendezvous store does not answer ({self.store.timeout_s:.0f} s): its host (node 0's "
                    "torchrun agent) is gone, or this node lost the network"
                )
            ops = "\n".join(log() for log in self.op_logs)
            write_stderr(f"[xfuse {clock()}] {headline}\n{ops}".rstrip())
            self._reported = True
            log_dir = os.environ.get("XFUSE_LOG_DIR")
            if log_dir:
                os.makedirs(log_dir, exist_ok=True)
                with open(os.path.join(log_dir, f"rank{self.rank}.ops.log"), "w") as fh:
                    fh.write(f"{headline}\n{ops}\n")

    @contextlib.contextmanager
    def guard(self):
        """Around work that communicates: on failure, record it, report, and raise naming the first failure."""
        if self.failure is not None:
            raise WorldFailure(f"rank {self.rank}: the world failed earlier ({self.failure}); restart every rank")
        self.active += 1
        try:
            yield
        except BaseException as err:
            peer = getattr(err, "peer", None)
            if peer is not None and type(err).__name__ == "CommTimeout":  # say where the chain of waits ends
                chain = self.diagnose(peer)
                if chain:
                    err.args = (f"{err}\n  {chain}",)
            if peer is not None and type(err).__name__ == "PeerLost":
                self.await_root_cause(peer)
            first = self.record(err)
            own = first.startswith(f"rank {self.rank}:")
            message = f"rank {self.rank} failed: {type(err).__name__}: {err}" + (
                "" if own else f"\n  first failure in the world: {first}"
            )
            self.report(message)
            if own and not isinstance(err, WorldFailure):
                raise
            raise WorldFailure(message) from err
        finally:
            self.active -= 1

    def fail_from_thread(self, err: BaseException) -> None:
        """A failure found off the main thread while the main thread is stuck in the device (the comm watchdog's
        ``on_stuck``): record it for the other ranks, report it as ``guard`` would, and end the process."""
        peer = getattr(err, "peer", None)
        chain = self.diagnose(peer) if peer is not None else ""
        if chain:
            err.args = (f"{err}\n  {chain}",)
        first = self.record(err)
        own = first.startswith(f"rank {self.rank}:")
        self.report(
            f"rank {self.rank} failed: {type(err).__name__}: {err}"
            + ("" if own else f"\n  first failure in the world: {first}")
            + f"\n{getattr(err, 'op_log', '')}".rstrip()
        )
        os._exit(1)  # from this thread: the main thread waits in the device and cannot unwind

    # --- the watcher --------------------------------------------------------------------------------------
    def publish_state(self) -> None:
        """Tell the other ranks what this rank is doing (read by ``diagnose`` when a wait times out)."""
        states = [state for source in self.state_sources if (state := source()) is not None]
        if states:
            self._last_wait = time.monotonic()
            text = "; ".join(states)
        else:
            text = f"not communicating for {time.monotonic() - self._last_wait:.1f} s (computing, or stalled)"
        try:
            self._watch_store.set(f"xfuse/state/{self.rank}", text)
            self._watch_store.set(f"{ALIVE_KEY}/{self.rank}", f"{time.time():.3f}")
        except Exception:  # noqa: BLE001 - the store is gone: the failure path reports that
            pass

    def _silence(self, peer: int, now: float) -> float | None:
        """How long ``peer``'s heartbeat has been stale beyond ``max(1 s, 4 poll_s)`` (None: fresh, never
        published, left in order, or the launcher terminated it). Raises when the store does not answer."""
        key = f"{ALIVE_KEY}/{peer}"
        if not self.store.check([key]) or self.store.check([f"{TERMINATED_KEY}/{peer}"]):
            return None
        beat = self.store.get(key).decode()  # the key, once published, is never deleted (see LEFT): no wait here
        if beat == LEFT:
            return None
        age = now - float(beat)
        return age if age > max(1.0, 4 * self.poll_s) else None

    def silent_ranks(self) -> str:
        """Ranks whose heartbeat stopped without the launcher terminating them: a rank killed (or crashed in C++)
        dies without a report, a node that lost its network goes quiet, and neighbours may lose another peer first."""
        if self.store is None or self.world_size is None:
            return ""
        now, silent = time.time(), []
        try:
            for peer in range(self.world_size):
                age = None if peer == self.rank else self._silence(peer, now)
                if age is not None:
                    silent.append(f"rank {peer} ({age:.1f} s)")
        except Exception:  # noqa: BLE001 - the store is gone: say nothing rather than guess
            return ""
        return f"no heartbeat, no report (killed, or its node lost?): {', '.join(silent)}" if silent else ""

    def terminated(self, peer: int) -> bool:
        """Whether the launcher terminated ``peer`` (it marked itself so in its SIGTERM handler)."""
        try:
            return self.store is not None and bool(self.store.check([f"{TERMINATED_KEY}/{peer}"]))
        except Exception:  # noqa: BLE001 - the store is gone
            return False

    def await_root_cause(self, peer: int | None) -> None:
        """A lost ``peer`` is not always why the world failed: torchrun terminates survivors as soon as one rank
        dies, so a neighbour may lose a terminated survivor before the dead rank; and a receive from a live,
        unterminated ``peer`` can fail with a connection reset within milliseconds of another rank's death (seen in
        CI: gloo fails pending operations of the group when one of its connections breaks). Unless a rank
        recorded a root cause (a failure other than a lost peer), wait (up to ``grace_s``) for a heartbeat to go
        stale, so the report can name the dead rank."""
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self.silent_ranks():
            first = self.first()
            if first is not None and "peer lost" not in first:
                return
            time.sleep(0.05)

    def diagnose(self, peer: int) -> str:
        """Follow who-waits-for-whom from ``peer``: the rank that is not waiting is where the chain is stuck."""
        if self.store is None:
            return ""
        lines, seen = [], {self.rank}
        while peer is not None and peer not in seen:  # a cycle of waits ends the walk too
            seen.add(peer)
            try:
                state = (
                    self.store.get(f"xfuse/state/{peer}").decode()
                    if self.store.check([f"xfuse/state/{peer}"])
                    else "no state published"
                )
                silence = self._silence(peer, time.time())
            except Exception as err:  # noqa: BLE001
                if self.store_lost:  # the report says the store is gone; a chain of unknowns says nothing more
                    break
                state, silence = f"unknown ({type(err).__name__})", None
            if silence is not None:  # what it said last is stale: the chain ends at a rank that went quiet
                lines.append(f"rank {peer}: no heartbeat for {silence:.1f} s (killed, or its node lost?); was {state}")
                break
            lines.append(f"rank {peer}: {state}")
            found = re.search(r" rank (\d+) at step", state) if state.startswith("waiting") else None
            peer = int(found.group(1)) if found else None
        return "\n  ".join(["who waits for whom:", *lines]) if lines else ""

    def _watch(self) -> None:
        try:
            self._watch_loop()
        finally:  # a stopped monitor is a rank that left in order: its stale heartbeat must not read as a death
            try:
                self._watch_store.set(f"{ALIVE_KEY}/{self.rank}", LEFT)
            except Exception:  # noqa: BLE001 - the store is gone
                pass

    def _watch_loop(self) -> None:
        stuck_since = None
        self.publish_state()  # at once: a rank that dies right after start-up must still have a heartbeat to go stale
        while not self._stop.wait(self.poll_s):
            self.publish_state()
            first = None if self._stop.is_set() else self.first(self._watch_store)
            if first is None or first.startswith(f"rank {self.rank}:") or not self.active:
                stuck_since = None
                continue
            stuck_since = stuck_since or time.monotonic()
            if time.monotonic() - stuck_since >= self.grace_s:  # our own error path did not fire: stop here
                self.report(
                    f"rank {self.rank} stopped: waiting in communication after another rank failed"
                    f"\n  first failure in the world: {first}"
                )
                os._exit(1)  # from this thread: the main thread is blocked in communication and cannot unwind

    def install_sigterm_handler(self) -> None:
        """Under torchrun: when the launcher terminates this rank after another failed, say why first."""
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum, frame):
            # torchrun terminates the survivors as soon as it sees a rank die; the dead rank's neighbours record
            # the failure only once they next wait on it, and a killed rank records nothing. Give them ``grace_s``
            # to record it, or the dead rank's heartbeat time to go stale, before saying "unknown". The marker
            # tells the others that this rank's disappearance is the launcher's doing, not a failure.
            try:
                self.store.set(f"{TERMINATED_KEY}/{self.rank}", clock())
            except Exception:  # noqa: BLE001 - no store: the report says what this rank knows
                pass
            deadline = time.monotonic() + self.grace_s
            while self.first() is None and not self.silent_ranks() and time.monotonic() < deadline:
                time.sleep(0.05)
            lost = re.search(r"(?:from|to) rank (\d+) failed: peer lost", self.first() or "")
            if lost:  # the first failure lost a peer: if the launcher terminated that one, find the dead rank
                self.await_root_cause(int(lost.group(1)))
            first = self.first() or "unknown (no rank recorded a failure)"
            self.report(f"rank {self.rank} terminated by the launcher (SIGTERM)\n  first failure in the world: {first}")
            # The main thread may be inside a collective: no orderly teardown of channels and groups from here.
            # Stop the watcher, then leave without finalizing the interpreter (os._exit), so no thread can be
            # caught returning from C++ into a finalizing interpreter (see xfuse.runtime.world.shutdown).
            self.stop(timeout_s=2.0)
            os._exit(1)

        signal.signal(signal.SIGTERM, on_sigterm)


def _thread_client(store):
    """A client of ``store`` for the watcher thread's own use: ``clone()`` where the store supports it."""
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):  # stores without clone(): share the main client
        return store


def default_store():
    """The default process group's store (None without a process group)."""
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()
