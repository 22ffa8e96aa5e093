"""The lines every rank writes to stderr when something fails: a millisecond clock, and one write per line.

Stdlib only (the CLI imports it before torch)."""

from __future__ import annotations

import os
import sys
import time


def clock() -> str:
    """Wall-clock time with milliseconds, for failure reports: 09:59:42.313."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"


def write_stderr(text: str) -> None:
    """Write ``text`` and its newline to stderr in one system call.

    The ranks of a node usually share one stderr (torchrun without ``--redirects``), and ranks that fail together
    write at the same moment. ``print`` writes the text and its newline in two calls, so one rank's report could
    run into the next rank's header on the same line. Under pytest's ``capsys`` (no file descriptor) it is one
    ``write`` of the stream instead.
    """
    data = (text + "\n").encode(errors="backslashreplace")
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        return
    sys.stderr.flush()  # what earlier prints left in the stream goes first
    while data:  # a blocking write of this size is whole; the loop only guards a short write
        data = data[os.write(fd, data) :]
