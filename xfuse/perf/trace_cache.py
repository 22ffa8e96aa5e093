"""Traces kept on disk: what ``xfuse plan`` traces on a weightless model (a request's activation peaks, a rank's
share of the parameters, a video VAE's bands) is made once per machine, not once per process.

A trace costs seconds (FLUX.1-dev's request: the whole pipeline run on the meta device) and depends on nothing but
its arguments and the code that made it, so an entry's key is its arguments together with the versions of torch,
diffusers, transformers and Python and a hash of xfuse's own source: any change to xfuse, or an upgrade, makes new
keys (old entries are never read again). Only arguments that name their content are cached: a preset (its config is
in xfuse's source) or a config given as text; a model folder on disk is traced every time.

The folder is ``$XFUSE_CACHE_DIR/traces`` (default ``$XDG_CACHE_HOME/xfuse`` or ``~/.cache/xfuse``); an empty
``XFUSE_CACHE_DIR`` turns the cache off. An entry that cannot be read is traced again and rewritten; a folder that
cannot be written is said once on stderr, and tracing goes on without it. Processes that want the same missing entry
at once (the ranks of a node planning ``--auto``, parallel test workers) trace it once: one holds the entry's lock
file while it traces, the others wait for it (up to ``LOCK_WAIT_S``, then trace it too) and read what it wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import pickle
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

ENV = "XFUSE_CACHE_DIR"
LOCK_WAIT_S = 600.0  # the longest a process waits for another tracing the entry it wants (a trace takes seconds)

F = TypeVar("F", bound=Callable[..., Any])


def cache_folder() -> Path | None:
    """Where traces are kept now (``None``: the cache is off)."""
    root = os.environ.get(ENV)
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "xfuse")
    return Path(root, "traces") if root else None


@functools.cache
def code_fingerprint() -> str:
    """The versions a trace depends on and a hash of xfuse's own source (its ``.py`` and ``.json`` files)."""
    import diffusers
    import torch
    import transformers

    digest = hashlib.sha256()
    versions = (sys.version_info[:3], torch.__version__, diffusers.__version__, transformers.__version__)
    digest.update(repr(versions).encode())
    package = Path(__file__).resolve().parent.parent
    for path in sorted(p for suffix in ("*.py", "*.json") for p in package.rglob(suffix)):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _say_unwritable(folder: str, why: str) -> None:
    warnings.warn(f"xfuse: traces are not kept on disk: cannot write {folder} ({why}); set {ENV} to another "
                  "folder, or to '' to stop trying", stacklevel=3)  # fmt: skip


def on_disk(key: Callable[..., tuple | None]) -> Callable[[F], F]:
    """Keep ``fn``'s values on disk under ``key(*args, **kwargs)`` (a tuple of plain values whose ``repr`` names the
    content; ``None``: this call is not cached). Values are pickled."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def cached(*args, **kwargs):
            folder, named = cache_folder(), key(*args, **kwargs)
            if folder is None or named is None:
                return fn(*args, **kwargs)
            text = repr((fn.__module__, fn.__qualname__, code_fingerprint(), named))
            path = folder / fn.__name__.strip("_") / f"{hashlib.sha256(text.encode()).hexdigest()}.pkl"
            found, value = _read(path)
            if found:
                return value
            with _entry_lock(path):
                found, value = _read(path)  # written by another process while this one waited
                if not found:
                    value = fn(*args, **kwargs)
                    _write(path, value)
            return value

        return cached  # type: ignore[return-value]

    return wrap


def _read(path: Path) -> tuple[bool, Any]:
    """``(True, the entry's value)``, or ``(False, None)``: not there yet, or unreadable (traced again)."""
    try:
        with open(path, "rb") as entry:
            return True, pickle.load(entry)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, TypeError):
        return False, None


@contextlib.contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """Held while this process traces ``path``'s entry: an exclusive ``flock`` on the lock file beside it, waited for
    up to ``LOCK_WAIT_S``. A folder that cannot hold the lock file, or a lock held longer, only costs a second trace
    of the same entry."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # and with it the lock


def _write(path: Path, value) -> None:
    """Write ``value`` whole or not at all: a process reading at the same time sees the old entry or the new."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=path.parent, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as out:
                pickle.dump(value, out, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(part, path)
        except BaseException:
            Path(part).unlink(missing_ok=True)
            raise
    except OSError as exc:
        _say_unwritable(str(path.parent), exc.strerror or type(exc).__name__)
