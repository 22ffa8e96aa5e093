"""Traces kept on disk (``xfuse.perf.trace_cache``): read back instead of traced again, keyed by what made them,
never read for an uncached call, and never in the way when the folder is broken."""

import functools
import pickle
import threading
import time
import warnings

import pytest
import torch

from xfuse.perf import trace_cache
from xfuse.perf.activations import request_activations
from xfuse.perf.trace_cache import ENV, cache_folder, on_disk


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    return tmp_path / "traces"


def counted(key=lambda *args: args):
    calls = []

    @on_disk(key)
    def traced(*args):
        calls.append(args)
        return {"args": args, "call": len(calls)}

    return traced, calls


def entries(folder):
    return sorted(p for p in folder.rglob("*.pkl"))


def test_a_second_call_reads_the_entry_and_other_arguments_trace_anew(folder):
    traced, calls = counted()
    assert traced(1, "a") == {"args": (1, "a"), "call": 1}
    assert traced(1, "a") == {"args": (1, "a"), "call": 1}  # read back: the function did not run again
    assert traced(2, "a") == {"args": (2, "a"), "call": 2}
    assert calls == [(1, "a"), (2, "a")] and len(entries(folder)) == 2


def test_callers_wanting_the_same_missing_entry_at_once_trace_it_once(folder):
    """Two callers of one entry at once (each opens the entry's lock file, as two processes do): one traces, the
    other waits on the lock and reads what it wrote. A caller of another entry does not wait: "a"'s trace lasts
    until "b" has been traced."""
    calls, b_traced = [], threading.Event()

    @on_disk(lambda name: (name,))
    def traced(name):
        calls.append(name)
        if name == "a":
            return f"a, traced; b traced meanwhile: {b_traced.wait(timeout=10)}"
        b_traced.set()
        return "b, traced"

    results = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: traced("a")})) for i in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # both callers of "a" are in: one tracing, one waiting on the lock
    assert traced("b") == "b, traced"
    for thread in threads:
        thread.join(timeout=20)
    assert results == {0: "a, traced; b traced meanwhile: True", 1: "a, traced; b traced meanwhile: True"}
    assert calls.count("a") == 1 and len(entries(folder)) == 2


def test_a_call_keyed_none_is_never_kept(folder):
    traced, calls = counted(key=lambda *args: None)
    traced(1)
    traced(1)
    assert calls == [(1,), (1,)] and entries(folder) == []


def test_an_unreadable_entry_is_traced_again_and_rewritten(folder):
    traced, calls = counted()
    traced(3)
    (entry,) = entries(folder)
    entry.write_bytes(b"not a pickle")
    assert traced(3) == {"args": (3,), "call": 2}
    assert pickle.loads(entry.read_bytes()) == {"args": (3,), "call": 2}


def test_an_empty_folder_setting_turns_the_cache_off(monkeypatch):
    monkeypatch.setenv(ENV, "")
    assert cache_folder() is None
    traced, calls = counted()
    traced(1)
    traced(1)
    assert len(calls) == 2


def test_a_folder_that_cannot_be_written_is_said_once_and_the_value_returned(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would be")
    monkeypatch.setenv(ENV, str(blocked))
    traced, calls = counted()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert traced(1) == {"args": (1,), "call": 1}
        assert traced(2) == {"args": (2,), "call": 2}
    assert len(said) == 1 and f"cannot write {blocked}/traces/traced" in str(said[0].message)
    assert f"set {ENV} to another folder" in str(said[0].message)


def test_the_key_holds_the_versions_and_the_source(monkeypatch):
    before = trace_cache.code_fingerprint()
    trace_cache.code_fingerprint.cache_clear()
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    try:
        assert trace_cache.code_fingerprint() != before
    finally:
        monkeypatch.undo()
        trace_cache.code_fingerprint.cache_clear()
    assert trace_cache.code_fingerprint() == before


def test_a_request_trace_read_back_equals_the_trace(folder):
    on_disk_only = request_activations.__wrapped__  # past the in-memory cache, as a new process calls it
    traced = on_disk_only("tiny", 64, 64)
    assert len(entries(folder)) == 1
    assert on_disk_only("tiny", 64, 64) == traced == request_activations.__wrapped__.__wrapped__("tiny", 64, 64)


def test_every_traced_function_is_kept_in_memory_and_on_disk():
    from xfuse.perf import activations, memory, video_vae

    for fn in (activations.request_activations, memory._stage_parameter_counts, memory._text_encoder_counts,
               video_vae._shares):  # fmt: skip
        assert isinstance(fn, functools._lru_cache_wrapper), fn
        assert fn.__wrapped__.__code__ is on_disk(None)(len).__code__, fn  # the disk's wrapper under the memory's
