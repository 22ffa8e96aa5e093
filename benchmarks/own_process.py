"""A benchmark row made in a process of its own, started from a fork server that has imported torch, diffusers,
transformers and xfuse's families once.

The GPU suite's degree-1 cases and compiled stages each run alone in a process: a case's model (Wan's 14 B is 56 GB
in float32 while it is built) must not meet what the previous case still holds, and a compile's state must not reach
the next stage. A new interpreter per row paid its imports again (3-5 s of a device call's minutes, and of the CPU
test's); a process forked from the server starts with them made. Nothing else is shared: the server never touches
CUDA, compiles nothing and holds no model, so each row's process begins as a new launch's would, past its imports.

The row is the entry's return value (a dict, sent back as the report's JSON holds it); the process's output (fds
1 and 2: warnings, progress bars) goes to a file whose tail an error row quotes, as the suite's reports did when each
row was a ``python -m`` of its own.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import Any

# What every row's process imports first (the server imports these once; none of them initialises CUDA).
PRELOAD = ["torch", "diffusers", "transformers", "accelerate", "xfuse.families.registry"]
ERROR_TAIL_CHARS = 1000


def row_in_own_process(
    entry: Callable[..., dict], args: tuple[Any, ...], timeout_s: float, preload: Sequence[str] = PRELOAD
) -> dict:
    """``entry(*args)`` in a new process forked from the preloaded server; its row, or ``{"error": ...}`` if the
    process raised, died (its exit code and the tail of its output) or did not finish within ``timeout_s``. The
    server is this process's one fork server: ``preload`` is read when it starts (the first row's call)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    with tempfile.NamedTemporaryFile("r", prefix="xfuse-row-", suffix=".log") as output:
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=_row_entry, args=(entry, args, sender, output.name))
        process.start()
        sender.close()  # only the child holds the sending end now: its death reads as EOF here
        try:
            if not receiver.poll(timeout_s):
                return {"error": f"did not finish in {timeout_s} s"}
            return receiver.recv()
        except EOFError:  # ended without a row: killed, or died in C
            process.join(10)
            return {"error": f"rc {process.exitcode}: {output.read()[-ERROR_TAIL_CHARS:]}"}
        finally:
            receiver.close()
            if process.is_alive():
                process.kill()
            process.join()


def _row_entry(entry: Callable[..., dict], args: tuple[Any, ...], sender, output_path: str) -> None:
    """In the row's process: its output to ``output_path``, then the row (or the exception that ended it) back."""
    fd = os.open(output_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        row = entry(*args)
    except Exception as exc:  # noqa: BLE001 - the row records it, and the suite goes on with the next one
        row = {"error": f"{type(exc).__name__}: {exc}"[:ERROR_TAIL_CHARS], "traceback": traceback.format_exc()}
    sender.send(json.loads(json.dumps(row, default=str)))  # plain data, as the report's JSON will hold it
    sender.close()
