"""Compiling visibly and boundedly: what this rank is compiling, for how long, and the end of it past
``compile.timeout_s``.

``CompileWatch.request(label)`` frames a request whose shape this process has not compiled yet. Inside it, dynamo's
own compile callbacks (``torch._dynamo.callback``: a start and an end around every frame it compiles) add up the
seconds this rank spends compiling; between compiles the rank runs its compiled graphs and communicates as usual.
``activity()`` is the sentence the failure monitor publishes for the other ranks (``rank 1: compiling shape 2 of 3
(1024x768) for 41.0 s``), so a rank waiting on it says whom it waits for and why. A thread checks the bound: once the
compile time passes ``timeout_s`` it hands a ``CompileTimeout`` naming the rank, the shape and the seconds to
``on_timeout`` (the failure monitor's ``fail_from_thread``: recorded for every rank, reported, process ended), from
the thread because the main thread is inside the compiler and may not come back.

Why a compile that ran out is not abandoned for eager on one rank: the other ranks are part-way through the same
request with compiled stages; the request cannot be finished by one rank switching over, and a world that goes on
must agree on every rank. The bound ends the world naming the rank; the operator restarts it with a longer
``compile.timeout_s``, a warm ``compile.cache_dir`` or ``compile.mode: off``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from xfuse.errors import CompileTimeout

__all__ = ["CompileWatch"]


class CompileWatch:
    """Times one rank's compiles inside a compiling request and ends the process past the bound (module docstring).

    Args:
        rank: this global rank (named in the activity and the error).
        timeout_s: ``compile.timeout_s``: the compile seconds one request shape may take on this rank.
        on_timeout: ``on_timeout(error)``, called on the watch thread; must not return normally.
        poll_s: how often the thread checks the bound.
        doing: what the activity and the error say the rank is doing (``compiling and capturing`` where the stage's
            passes are captured as CUDA graphs).
    """

    def __init__(self, rank: int, timeout_s: float, on_timeout: Callable[[BaseException], None], poll_s: float = 0.1,
                 doing: str = "compiling"):  # fmt: skip
        self.rank, self.timeout_s, self.on_timeout, self.poll_s = rank, timeout_s, on_timeout, poll_s
        self.doing = doing
        self._lock = threading.Lock()
        self._label: str | None = None  # the compiling request's shape, as the lines name it
        self._spent_s = 0.0  # compile seconds of this request's finished compiles
        self._since: float | None = None  # when the compile in progress started
        self._stop = threading.Event()

    # --- dynamo's callbacks (main thread, inside torch.compile) -------------------------------------------
    def _compile_started(self, args) -> None:
        with self._lock:
            if self._label is not None:  # (another pipeline's request, or none: not this watch's to count)
                self._since = time.monotonic()

    def _compile_ended(self, args) -> None:
        with self._lock:
            if self._since is not None:
                self._spent_s += time.monotonic() - self._since
            self._since = None

    def _register(self) -> None:
        """Dynamo's callbacks, registered once per reset (``torch._dynamo.reset`` clears them)."""
        from torch._dynamo.callback import callback_handler

        if self._compile_started not in callback_handler.start_callbacks:
            # first: a compile's clock starts before any other start callback runs (they are part of the compile)
            callback_handler.start_callbacks.insert(0, self._compile_started)
            callback_handler.register_end_callback(self._compile_ended)

    # --- what the other ranks and the bound read ----------------------------------------------------------
    def compiling_s(self) -> float:
        """Seconds this rank has spent compiling the current request's shape (the compile in progress included)."""
        with self._lock:
            running = 0.0 if self._since is None else time.monotonic() - self._since
            return self._spent_s + running

    def activity(self) -> str | None:
        """``compiling shape 2 of 3 (1024x768) for 41.0 s`` inside a compiling request; else ``None``."""
        label = self._label
        return None if label is None else f"{self.doing} {label} for {self.compiling_s():.1f} s"

    @contextlib.contextmanager
    def request(self, label: str):
        """Frame a request that compiles ``label`` (e.g. ``shape 1 of 2 (1024x1024)``); the bound runs inside."""
        self._register()
        with self._lock:
            self._label, self._spent_s, self._since = label, 0.0, None
        self._stop.clear()
        thread = threading.Thread(target=self._watch, name=f"xfuse-compile-watch-{self.rank}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()  # it only sleeps and reads a clock: it ends within poll_s
            with self._lock:
                self._label = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            spent = self.compiling_s()
            if spent > self.timeout_s:
                self.on_timeout(
                    CompileTimeout(
                        f"rank {self.rank}: {self.doing} {self._label} took more than compile.timeout_s = "
                        f"{self.timeout_s:g} s ({spent:.1f} s so far); the world stops. Restart with a longer "
                        "compile.timeout_s, a warm compile.cache_dir, or compile.mode: off"
                    )
                )
                return
