"""Shared test set-up: runs before any test module imports diffusers or transformers.

xfuse's tests are offline by design: tiny models are built from configs or saved to temporary folders, never fetched.
``HF_HUB_OFFLINE=1`` makes a hub id fail at once instead of retrying for ~23 s; spawned ranks and subprocesses
inherit it from this process's environment. Traces of ``xfuse plan`` (``xfuse.perf.trace_cache``) are kept in the
checkout's ``.cache/xfuse``, shared by the test processes of a run and by the next run, never in the user's own cache.

The summary ends with each tier's count and test time (setup, call and teardown; with parallel workers these add up
to more than the run's wall time), which ``docs/testing.md`` budgets.
"""

import os
from collections import defaultdict
from pathlib import Path

import pytest

from xfuse.runtime.heap import collector_paused, freeze_startup_heap

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("XFUSE_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "xfuse"))
# A parallel worker (pytest-xdist) gets its share of the cores for torch's threads, read when torch loads: two
# workers of two threads each on two cores spin against each other (OpenMP waits busily) and double every test's
# CPU time. Test worlds run their ranks on one thread each already, and torchrun's ranks too.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Collection (every test module imported, with torch, diffusers and transformers) with the collector paused, as
    xfuse's own start-up (``xfuse.runtime.heap.collector_paused``): 7.3 -> 4.7 CPU-s a test process."""
    with collector_paused():
        yield


def pytest_collection_finish(session):
    """What the test process imported and collected lives as long as it: the collector never scans it again (as
    ``tests.support.rank_preload`` does for the ranks); without it each full collection here walks torch, diffusers,
    transformers and every test module's objects."""
    freeze_startup_heap()


def pytest_terminal_summary(terminalreporter):
    tests: dict[str, set[str]] = defaultdict(set)
    seconds: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            parts = getattr(report, "nodeid", "").split("/")
            if len(parts) < 3 or parts[0] != "tests" or not hasattr(report, "duration"):
                continue
            tests[parts[1]].add(report.nodeid)
            seconds[parts[1]] += report.duration
    if tests:
        terminalreporter.write_sep("=", "time per tier")
        for tier in sorted(tests):
            terminalreporter.write_line(f"{tier:10} {len(tests[tier]):5} tests {seconds[tier]:8.1f} s of test time")
