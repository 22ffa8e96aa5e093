"""A teardown call that may never return, given a bound: NCCL's abort and destroy wait for the device
(``ncclCommAbort`` synchronises the communicator's stream, NVIDIA/nccl#829), so on a device stopped by a kernel that
never ends they block forever, and a rank that already reported its failure would hang instead of exiting."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["call_bounded"]


def call_bounded(fn: Callable[[], object], timeout_s: float, name: str) -> bool:
    """Run ``fn()`` on a daemon thread named ``name`` and wait for it at most ``timeout_s``: True if it returned (an
    exception it raised is re-raised here), False if it is still running (it is left behind: a daemon thread does not
    keep the process alive, and the caller ends the process without it)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            raised.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False
    if raised:
        raise raised[0]
    return True
