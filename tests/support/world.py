"""A world of N real torch.distributed ranks on CPU, for multi-rank tests.

``World(n)`` spawns ``n`` processes that each join one gloo process group and then
wait for work; ``World.run(fn, ...)`` runs ``fn`` on every rank at once and returns
one :class:`RankResult` per rank. Starting torch costs seconds per rank, so a test
module should start a world once and reuse it for many calls.

Failure handling is the point of this module: every call is bounded by a
wall-clock limit, a rank that dies is reported at once (not after the timeout),
and ``close()`` (also run at interpreter exit) leaves no process behind.

Rank functions travel by pickle *by reference*: they must be top-level functions
of an importable module (spawned children get the parent's ``sys.path``).
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.util
import os
import pickle
import reprlib
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback as tb_mod
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["RankResult", "RemoteError", "RankDied", "WorldTimeout", "WorldError", "World", "exit_code", "run_world"]

_CLOSE = ("close",)
_CLOSE_GRACE = 5.0  # seconds a rank gets to tear down its group before SIGKILL
# A rank that does not answer in time writes every thread's stack here (faulthandler's C handler, which needs no
# Python thread to run) before the world kills it: a hang is then read, not guessed. Not SIGUSR1, which xfuse's own
# commands take for their stacks on stderr (``xfuse.runtime.host_deadline.register_stack_dump``).
_STACKS_SIGNAL = signal.SIGUSR2
_STACKS_WAIT_S = 2.0


@dataclass
class RankResult:
    """What one rank answered for one call."""

    rank: int
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


class RemoteError(Exception):
    """Stands in for a remote exception that could not be pickled back."""

    def __init__(self, type_name: str, message: str, traceback: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message, self.traceback = type_name, message, traceback

    def __reduce__(self):
        return (RemoteError, (self.type_name, self.message, self.traceback))


class RankDied(RuntimeError):
    """A rank's process ended during a call (killed, crashed, ``os._exit``)."""

    def __init__(self, rank: int, exitcode: int | None):
        self.rank, self.exitcode = rank, exitcode
        if exitcode is not None and exitcode < 0:
            try:
                how = f"was killed by {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-exitcode}"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(f"rank {rank} {how}")

    def __reduce__(self):
        return (RankDied, (self.rank, self.exitcode))


class WorldTimeout(RuntimeError):
    """A call passed its wall-clock limit; every rank was killed.

    ``answered`` maps rank -> RankResult for the ranks that did answer,
    ``pending`` lists the ranks that did not.
    """

    def __init__(self, message: str, answered: dict[int, RankResult] | None = None, pending=()):
        super().__init__(message)
        self.answered = dict(answered or {})
        self.pending = list(pending)


class WorldError(RuntimeError):
    """Raised by ``run_ok`` when at least one rank failed; ``results`` has all ranks."""

    def __init__(self, message: str, results: list[RankResult]):
        super().__init__(message)
        self.results = results


def _describe(r: RankResult) -> str:
    if r.error is None:
        return f"rank {r.rank} -> {reprlib.repr(r.value)}"
    return f"rank {r.rank} raised {type(r.error).__name__}: {r.error}"


def _fn_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# --------------------------------------------------------------------------- worker side


def _error_result(rank: int, exc: BaseException) -> RankResult:
    """Build a result carrying ``exc``; keep the original type only if it survives a pickle round trip."""
    text = "".join(tb_mod.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
        err: BaseException = exc
    except Exception:
        err = RemoteError(f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), text)
    return RankResult(rank, error=err, traceback=text)


def _send_result(conn, res: RankResult) -> None:
    try:
        data = pickle.dumps(res)
    except Exception as exc:  # an unpicklable return value must not kill the rank
        data = pickle.dumps(_error_result(res.rank, TypeError(f"rank result is not picklable: {exc!r}")))
    conn.send_bytes(data)


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """Exit when the test process is gone, so a SIGKILLed test runner leaves no orphan ranks. A rank is the fork
    server's child, not the test process's: the fork server ends with the test process, and the rank is then
    handed to another parent."""
    server = os.getppid()
    while not stop.wait(1.0):
        if os.getppid() != server or not _alive(parent_pid):
            os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker_main(rank, size, backend, store_path, threads, env, conn, parent_pid) -> None:
    """Entry point of a rank process: join the group, then serve calls until told to close."""
    # Environment before importing torch: OpenMP/MKL read their thread counts at load.
    os.environ.update(env)
    # Ctrl-C reaches the whole foreground process group; let the parent decide how to stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_stop = threading.Event()
    parent_watcher = threading.Thread(target=_watch_parent, args=(parent_pid, parent_stop), daemon=True)
    parent_watcher.start()
    stacks = open(_stacks_path(os.path.dirname(store_path), rank), "w")  # noqa: SIM115 - open while the rank lives
    faulthandler.register(_STACKS_SIGNAL, file=stacks, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        # A FileStore in a private temp dir: no free-port search, so no port races between worlds.
        store = dist.FileStore(store_path, size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    except BaseException as exc:
        _send_result(conn, _error_result(rank, exc))
        os._exit(1)
    _send_result(conn, RankResult(rank, value=os.getpid()))

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # parent went away
            os._exit(1)
        try:
            msg = pickle.loads(data)  # may fail here if fn's module cannot be imported in the child
            if msg == _CLOSE:
                break
            _, fn, args, kwargs = msg
            res = RankResult(rank, value=fn(*args, **kwargs))
        except BaseException as exc:  # SystemExit / KeyboardInterrupt are reported too
            res = _error_result(rank, exc)
        _send_result(conn, res)

    code = 0
    try:
        # Normal interpreter teardown with torch loaded takes 1-2 s per rank; run the exit
        # hooks (xfuse.runtime.world.shutdown, coverage, multiprocessing finalizers) ourselves and
        # skip the rest. xfuse's shutdown stops its monitor thread before the group goes.
        atexit._run_exitfuncs()
        mp.util._exit_function()
        if dist.is_initialized():  # this world created the group: it destroys it
            dist.destroy_process_group()
        conn.close()
        parent_stop.set()
        parent_watcher.join()
    except BaseException:
        tb_mod.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stacks_path(folder: str, rank: int) -> str:
    """Where rank ``rank`` of the world whose folder is ``folder`` writes its stacks on ``_STACKS_SIGNAL``."""
    return os.path.join(folder, f"stacks.{rank}")


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


# --------------------------------------------------------------------------- parent side


def _shutdown(owner_pid: int, procs: list, conns: list, tmpdir: str) -> None:
    """Close all ranks: polite message, short grace, then SIGKILL; always reap (no zombies)."""
    if os.getpid() != owner_pid:  # a forked copy of the test process must not touch our ranks
        return
    for p, c in zip(procs, conns, strict=True):
        if p.exitcode is None:
            try:
                c.send_bytes(pickle.dumps(_CLOSE))
            except OSError:
                pass
    deadline = time.monotonic() + _CLOSE_GRACE
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    for c in conns:
        c.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


# What every rank imports before its first call: torch, diffusers and the families' classes (4-5 s of CPU a process
# on this machine). The fork server imports them once per test process, then forks each rank from that clean,
# single-threaded image: a world starts in about a second instead of every rank importing them again.
_RANK_PRELOAD = ["tests.support.rank_preload"]


def _rank_context() -> multiprocessing.context.BaseContext:
    """The fork server's context, preloaded; never a fork of the test process itself (it may hold threads, a
    process group or torch's OpenMP pool)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)
    return ctx


class World:
    """``size`` rank processes in one process group; see the module docstring.

    Not thread-safe except ``kill``, which may be called from another thread while
    ``run`` is waiting (to test a rank dying mid-call).
    """

    def __init__(
        self,
        size: int,
        *,
        backend: str = "gloo",
        threads_per_rank: int = 1,
        env: dict[str, str] | None = None,
        start_timeout: float = 120.0,
    ):
        if size < 1:
            raise ValueError(f"world size must be >= 1, got {size}")
        self.size = size
        self._dead: str | None = None  # why the world can no longer run calls
        self._submitted = "nothing"  # the rank function of the last submit
        self._tmpdir = tempfile.mkdtemp(prefix="xfuse-world-")
        self._procs: list[mp.Process] = []
        self._conns: list[mp.connection.Connection] = []
        # Registered before anything starts, so a failure half way still cleans up.
        self._finalizer = weakref.finalize(self, _shutdown, os.getpid(), self._procs, self._conns, self._tmpdir)
        ctx = _rank_context()
        store_path = os.path.join(self._tmpdir, "store")
        for rank in range(size):
            rank_env = {
                "HF_HUB_OFFLINE": "1",
                "OMP_NUM_THREADS": str(threads_per_rank),
                "MKL_NUM_THREADS": str(threads_per_rank),
                "RANK": str(rank),
                "WORLD_SIZE": str(size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(size),
            }
            # All ranks are on this machine; loopback avoids depending on hostname resolution.
            if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
                rank_env["GLOO_SOCKET_IFNAME"] = "lo"
            rank_env.update(env or {})
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_worker_main,
                args=(rank, size, backend, store_path, threads_per_rank, rank_env, child_conn, os.getpid()),
                name=f"xfuse-world-rank{rank}",
                daemon=False,  # daemonic processes may not start children of their own
            )
            p.start()
            child_conn.close()  # only the child holds its end, so its death gives us EOF
            self._procs.append(p)
            self._conns.append(parent_conn)
        self.pids: list[int] = [p.pid for p in self._procs]

        try:
            # Fail fast: once one rank failed to join, the others wait for it in the store forever.
            results = self._collect(time.monotonic() + start_timeout, "start", stop_on_error=True)
        except BaseException:
            self.close()
            raise
        failed = [r for r in results if r is not None and r.error is not None]
        if failed:
            self._kill_all("failed to start")
            self.close()
            raise RuntimeError(
                f"world of {size} failed to start:\n" + "\n".join(f"{_describe(r)}\n{r.traceback}" for r in failed)
            )

    # -- state

    @property
    def alive(self) -> bool:
        """True while the world can run calls: not closed, not dead, every rank running."""
        return self._dead is None and all(p.is_alive() for p in self._procs)

    def _check_usable(self) -> None:
        if self._dead is None:
            for rank, p in enumerate(self._procs):
                if not p.is_alive():
                    self._dead = str(RankDied(rank, p.exitcode)) + " before this call"
        if self._dead is not None:
            raise RuntimeError(f"world is dead ({self._dead}); start a new World")

    # -- calls

    def run(self, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> list[RankResult]:
        """Run ``fn(*args, **kwargs)`` on every rank concurrently; one result per rank, in rank order.

        Raises WorldTimeout (after killing every rank) if not all ranks answer within
        ``timeout`` seconds. A rank whose process ends is reported as ``RankDied``.
        """
        self.submit(fn, *args, **kwargs)
        return self.collect(timeout)

    def submit(self, fn: Callable, *args, **kwargs) -> None:
        """Start ``fn(*args, **kwargs)`` on every rank and return at once (a rank function that runs until the test
        stops it: a served world); ``collect`` reads the answers."""
        self._check_usable()
        try:
            # Pickle once, before sending anything: an unpicklable fn must not leave half the ranks running.
            data = pickle.dumps(("run", fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"cannot send {_fn_name(fn)} to the ranks; use a top-level function of an importable module "
                f"and picklable arguments ({exc})"
            ) from exc
        for c in self._conns:
            try:
                c.send_bytes(data)
            except OSError:
                pass  # the rank is dead; _collect reports it through its sentinel
        self._submitted = _fn_name(fn)

    def collect(self, timeout: float = 120.0) -> list[RankResult]:
        """Every rank's answer to the last ``submit``, in rank order, as ``run`` returns them."""
        return self._collect(time.monotonic() + timeout, self._submitted, timeout)

    def run_ok(self, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> list[Any]:
        """Like ``run`` but return the values; raise WorldError listing every failed rank's traceback."""
        results = self.run(fn, *args, timeout=timeout, **kwargs)
        failed = [r for r in results if r.error is not None]
        if failed:
            parts = [f"{_describe(r)}\n{r.traceback or ''}".rstrip() for r in failed]
            raise WorldError(
                f"{_fn_name(fn)} failed on {len(failed)} of {self.size} ranks:\n\n" + "\n\n".join(parts), results
            ) from failed[0].error
        return [r.value for r in results]

    def _collect(
        self, deadline: float, what: str, timeout: float | None = None, stop_on_error: bool = False
    ) -> list[RankResult | None]:
        """Wait for one answer per rank, or its death, until ``deadline``.

        With ``stop_on_error`` return as soon as one rank failed (missing ranks are None).
        """
        got: dict[int, RankResult] = {}
        # Waiting on each process sentinel too means a dead rank is noticed at once.
        owner = {c: r for r, c in enumerate(self._conns)}
        owner.update({p.sentinel: r for r, p in enumerate(self._procs)})
        while len(got) < self.size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waiting = [o for o, r in owner.items() if r not in got]
            for obj in mp.connection.wait(waiting, timeout=remaining):
                rank = owner[obj]
                if rank not in got:
                    got[rank] = self._read(rank)
            if stop_on_error and any(r.error is not None for r in got.values()):
                return [got.get(r) for r in range(self.size)]
        pending = [r for r in range(self.size) if r not in got]
        if pending:
            stacks = self._stacks_of(pending)
            self._kill_all(f"{what} timed out")
            answered = [got[r] for r in sorted(got)]
            limit = f" after {timeout:g} s" if timeout is not None else ""
            raise WorldTimeout(
                f"{what} timed out{limit}: ranks {pending} did not answer (all ranks killed); "
                f"answered: {[r for r in sorted(got)]}"
                + "".join(f"\n  {_describe(r)}" for r in answered)
                + "".join(f"\n\nrank {r.rank}: {r.traceback}" for r in answered if r.traceback)
                + "".join(f"\n\nrank {rank}'s stacks when it was killed:\n{text}" for rank, text in stacks.items()),
                answered=got,
                pending=pending,
            )
        died = [r for r in got.values() if isinstance(r.error, RankDied)]
        if died:  # the group is broken now; close() will reap the survivors
            self._dead = "; ".join(str(r.error) for r in died)
        return [got[r] for r in range(self.size)]

    def _stacks_of(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's stack of each of ``ranks`` still running (``_STACKS_SIGNAL``), as it wrote them."""
        paths = {}
        for rank in ranks:
            if self._procs[rank].exitcode is None:
                paths[rank] = _stacks_path(self._tmpdir, rank)
                os.kill(self.pids[rank], _STACKS_SIGNAL)
        deadline = time.monotonic() + _STACKS_WAIT_S
        while time.monotonic() < deadline and not all(_size(p) for p in paths.values()):
            time.sleep(0.05)
        time.sleep(0.1)  # the rest of a dump already begun
        return {rank: open(path).read() if _size(path) else "(none written)\n" for rank, path in paths.items()}

    def _read(self, rank: int) -> RankResult:
        """Read the rank's answer; if there is none the process has ended."""
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            if conn.poll():  # an answer written just before dying still counts
                data = conn.recv_bytes()
                try:
                    return pickle.loads(data)
                except Exception as exc:
                    return RankResult(rank, error=RemoteError(type(exc).__name__, f"cannot unpickle result: {exc}"))
        except (EOFError, OSError):
            pass
        proc.join(5.0)  # the sentinel fired, so this returns at once; it reaps the exit code
        return RankResult(rank, error=RankDied(rank, proc.exitcode))

    # -- teardown

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one rank's process (fault injection). Does not wait for it."""
        os.kill(self.pids[rank], sig)

    def _kill_all(self, reason: str) -> None:
        self._dead = reason
        for p in self._procs:
            if p.exitcode is None:
                p.kill()
        for p in self._procs:
            p.join()

    def close(self) -> None:
        """Tell every rank to leave its group and exit; SIGKILL stragglers. Idempotent."""
        if self._dead is None:
            self._dead = "closed"
        self._finalizer()  # runs _shutdown at most once, here or at interpreter exit

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "alive" if self._dead is None else f"dead: {self._dead}"
        return f"World(size={self.size}, pids={self.pids}, {state})"


def exit_code(results: list[RankResult], context: str = "") -> int:
    """The exit code of a call whose rank function ends its process (``os._exit``, as a launched command's ranks end):
    the first non-zero one of its ranks, or 0. A rank that answered instead of ending is a ``WorldError`` (with
    ``context``: what the ranks wrote)."""
    answered = [r for r in results if not isinstance(r.error, RankDied)]
    if answered:
        raise WorldError(
            "ranks answered instead of ending: " + "; ".join(_describe(r) for r in answered) + context, results
        )
    return next((r.error.exitcode for r in results if r.error.exitcode), 0)  # type: ignore[union-attr]


def run_world(size: int, fn: Callable, *args, timeout: float = 120.0, **kwargs) -> list[RankResult]:
    """Start a world of ``size`` ranks, run ``fn`` once on all of them, close it."""
    with World(size) as world:
        return world.run(fn, *args, timeout=timeout, **kwargs)
