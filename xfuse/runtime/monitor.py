"""Never hang, always say why: failure propagation across ranks (the start-up agreement is ``handshake``'s).

``FailureMonitor``: the first rank to fail writes its error into the process group's key-value store as a
``FailureRecord`` (``compare_set``: the first writer wins). Every later failure on any rank names that first
failure. A daemon thread polls the store: a rank stuck in communication after another rank failed reports and exits
instead of sitting out its timeout; under torchrun, a rank terminated by the launcher (SIGTERM) says why before
exiting. On failure each rank writes its ring buffer of recent communication ops to stderr (and to
``$XFUSE_LOG_DIR/rank<R>.ops.log`` when set). Every poll it publishes its heartbeat and its ``RankState`` (what
its channels wait for), which a rank whose wait timed out follows from rank to rank to the one that is not
waiting. Records travel as JSON and are read as data; their sentences are only for the reports.

The watcher thread must be stopped and joined (``FailureMonitor.stop``) before the interpreter finalizes: a Python
thread that returns from a C++ call (a store call releases the GIL) after finalization has begun is ended by
``pthread_exit``, whose forced unwind through pybind11's noexcept ``gil_scoped_release`` destructor calls
``std::terminate`` -- "terminate called without an active exception", SIGABRT, at the end of a run that had
succeeded. ``xfuse.runtime.world.shutdown`` owns that stop (and the teardown order around it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from xfuse.comm.errors import CommTimeout, PeerLost
from xfuse.comm.stats import WaitState
from xfuse.errors import WorldFailure
from xfuse.stderr import clock, write_stderr

FAILURE_KEY = "xfuse/first_failure"  # a FailureRecord
STATE_KEY = "xfuse/state"  # + "/<rank>": that rank's RankState
TERMINATED_KEY = "xfuse/terminated"  # + "/<rank>": the launcher terminated that rank (SIGTERM), it did not fail
ALIVE_KEY = "xfuse/alive"  # + "/<rank>": the time of that rank's last heartbeat, or LEFT
# A rank that stops its monitor in order overwrites its heartbeat with this; it never deletes the key: a reader's
# check() then get() would wait in get() for a key deleted between the two (TCPStore.get blocks on missing keys).
LEFT = "left"
# A healthy store answers in milliseconds; one that has not answered in this long has lost its host (or we ours).
STORE_CALL_TIMEOUT_S = 3.0
# A rank waiting this long on a peer that is compiling says so (and again at each doubling of the wait): the world is
# not stalled, and stderr names the rank it waits for and what that rank compiles.
WAIT_LINE_AFTER_S = 5.0


@dataclass(frozen=True)
class FailureRecord:
    """The world's first failure as the store keeps it: which rank, what error, and whether it only lost a peer.

    ``lost_peer``: the peer a ``PeerLost`` error lost. Such a failure is a consequence (of a rank that died, or
    that the launcher terminated), not a root cause, so ranks that see it wait briefly for the real one.
    """

    rank: int | None  # None: not a rank's error (the rendezvous store itself stopped answering)
    error_type: str
    message: str
    lost_peer: int | None = None

    @classmethod
    def of_error(cls, rank: int, error: BaseException) -> FailureRecord:
        lost_peer = error.peer if isinstance(error, PeerLost) else None
        return cls(rank, type(error).__name__, str(error), lost_peer)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> FailureRecord:
        return cls(**json.loads(raw))

    def __str__(self) -> str:
        """The sentence reports print: ``rank 3: CommTimeout: rank 3: recv of hidden ... timed out ...``."""
        return self.message if self.rank is None else f"rank {self.rank}: {self.error_type}: {self.message}"


@dataclass(frozen=True)
class RankState:
    """What a rank is doing, as it publishes it every poll: the operations its channels wait for, or how long it
    has not communicated (computing, or stalled)."""

    waits: tuple[WaitState, ...]
    idle_s: float  # since this rank last waited on anything
    activity: str = ""  # what it does besides communicating, where that explains a wait (``compiling shape 1 ...``)

    @property
    def waits_for(self) -> int | None:
        """The rank this one waits for (its first wait's peer), where a who-waits-for-whom walk goes next."""
        return self.waits[0].peer if self.waits else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> RankState:
        data = json.loads(raw)
        return cls(tuple(WaitState(**w) for w in data["waits"]), data["idle_s"], data["activity"])

    def sentence(self) -> str:
        if self.waits:
            return "; ".join(w.sentence() for w in self.waits)
        if self.activity:
            return self.activity
        return f"not communicating for {self.idle_s:.1f} s (computing, or stalled)"


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
        # What this rank's channels wait for (None when not waiting): ``P2PChannels.wait_state`` of each channel.
        self.state_sources: list[Callable[[], WaitState | None]] = []
        # What this rank does besides communicating (``CompileWatch.activity``: "compiling shape 1 of 2 ..."), or None.
        self.activity_source: Callable[[], str | None] | None = None
        self._next_wait_line_s = WAIT_LINE_AFTER_S  # a wait on a compiling peer this long is said on stderr
        self._last_wait = time.monotonic()
        self.grace_s, self.poll_s = grace_s, poll_s
        self.active = 0  # >0 while this rank is inside a guarded (communicating) section
        self.failure: FailureRecord | None = None  # the world's first failure, once known here
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
    def record(self, error: BaseException) -> FailureRecord:
        """Make ``error`` the world's first failure unless one exists; return the first failure."""
        mine = FailureRecord.of_error(self.rank, error)
        if self.store is None:
            self.failure = self.failure or mine
            return self.failure
        try:
            first = self.store.compare_set(FAILURE_KEY, "", mine.to_json())
            self.failure = FailureRecord.from_json(first)
        except Exception:  # noqa: BLE001 - the store died with its host: this error is the best we know
            self.failure = self.failure or mine
        return self.failure

    def first(self, store=None) -> FailureRecord | None:
        """The world's first failure, if any rank recorded one (read from ``store``, default the main client)."""
        store = self.store if store is None else store
        if self.failure is None and store is not None:
            try:
                if store.check([FAILURE_KEY]):
                    self.failure = FailureRecord.from_json(store.get(FAILURE_KEY))
            except Exception as err:  # noqa: BLE001 - losing the store means its host (rank 0 / agent) is gone
                unreachable = f"the rendezvous store is unreachable ({type(err).__name__}: {err})"
                self.failure = FailureRecord(None, type(err).__name__, unreachable)
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
            if isinstance(err, CommTimeout) and err.peer is not None:  # say where the chain of waits ends
                chain = self.diagnose(err.peer)
                if chain:
                    err.args = (f"{err}\n  {chain}",)
            if isinstance(err, PeerLost) and err.peer is not None:
                self.await_root_cause(err.peer)
            first = self.record(err)
            own = first.rank == self.rank
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
        own = first.rank == self.rank
        self.report(
            f"rank {self.rank} failed: {type(err).__name__}: {err}"
            + ("" if own else f"\n  first failure in the world: {first}")
            + f"\n{getattr(err, 'op_log', '')}".rstrip()
        )
        os._exit(1)  # from this thread: the main thread waits in the device and cannot unwind

    # --- the watcher --------------------------------------------------------------------------------------
    def publish_state(self) -> RankState:
        """Tell the other ranks what this rank is doing (read by ``diagnose`` when a wait times out, and by a rank
        that waits on a compiling one); returns what it published."""
        waits = tuple(wait for source in self.state_sources if (wait := source()) is not None)
        now = time.monotonic()
        if waits:
            self._last_wait = now
        activity = (self.activity_source() if self.activity_source is not None else None) or ""
        state = RankState(waits, idle_s=round(now - self._last_wait, 3), activity=activity)
        try:
            self._watch_store.set(f"{STATE_KEY}/{self.rank}", state.to_json())
            self._watch_store.set(f"{ALIVE_KEY}/{self.rank}", f"{time.time():.3f}")
        except Exception:  # noqa: BLE001 - the store is gone: the failure path reports that
            pass
        return state

    def say_long_wait(self, state: RankState) -> None:
        """On stderr, once a wait passes ``WAIT_LINE_AFTER_S`` (and at each doubling), if the ranks it waits for
        end at one with an activity: ``rank 0: waiting 5.1 s: recv of hidden from rank 1 ...; rank 1 is compiling
        shape 1 of 2 (64x64) for 5.3 s``. A wait on a rank that computes or stalls says nothing here: the comm
        timeout and ``diagnose`` own that."""
        if not state.waits:
            self._next_wait_line_s = WAIT_LINE_AFTER_S
            return
        wait = max(state.waits, key=lambda w: w.waited_s)
        if wait.waited_s < self._next_wait_line_s:
            return
        self._next_wait_line_s = 2 * max(wait.waited_s, self._next_wait_line_s)
        peer, seen = wait.peer, {self.rank}
        try:
            while peer is not None and peer not in seen:  # who-waits-for-whom, to the rank that does something else
                seen.add(peer)
                key = f"{STATE_KEY}/{peer}"
                if not self._watch_store.check([key]):
                    return
                theirs = RankState.from_json(self._watch_store.get(key))
                if theirs.activity:
                    said = f"rank {self.rank}: {wait.sentence()}; rank {peer} is {theirs.activity}"
                    write_stderr(f"[xfuse {clock()}] {said}")
                    return
                peer = theirs.waits_for
        except Exception:  # noqa: BLE001 - the store is gone: the failure path reports that
            return

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
            if first is not None and first.lost_peer is None:
                return
            time.sleep(0.05)

    def diagnose(self, peer: int) -> str:
        """Follow who-waits-for-whom from ``peer``: the rank that is not waiting is where the chain is stuck."""
        if self.store is None:
            return ""
        lines, seen = [], {self.rank}
        while peer is not None and peer not in seen:  # a cycle of waits ends the walk too
            seen.add(peer)
            key, next_peer = f"{STATE_KEY}/{peer}", None
            try:
                if self.store.check([key]):
                    state = RankState.from_json(self.store.get(key))
                    said, next_peer = state.sentence(), state.waits_for
                else:
                    said = "no state published"
                silence = self._silence(peer, time.time())
            except Exception as err:  # noqa: BLE001
                if self.store_lost:  # the report says the store is gone; a chain of unknowns says nothing more
                    break
                said, silence = f"unknown ({type(err).__name__})", None
            if silence is not None:  # what it said last is stale: the chain ends at a rank that went quiet
                lines.append(f"rank {peer}: no heartbeat for {silence:.1f} s (killed, or its node lost?); was {said}")
                break
            lines.append(f"rank {peer}: {said}")
            peer = next_peer
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
            self.say_long_wait(self.publish_state())
            first = None if self._stop.is_set() else self.first(self._watch_store)
            if first is None or first.rank == self.rank or not self.active:
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
            lost = self.first()
            if lost is not None and lost.lost_peer is not None:  # it lost a peer: if terminated, find the dead rank
                self.await_root_cause(lost.lost_peer)
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
