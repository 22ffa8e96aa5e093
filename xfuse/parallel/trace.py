"""A timeline of the engine's work, in the Chrome trace event format (open in https://ui.perfetto.dev or
chrome://tracing): one process per rank, one track for compute (a span per stage segment and patch) and one for
communication waits, so pipeline bubbles and stalls are visible.

Timestamps are wall-clock microseconds (``time.time``), so ranks on one machine line up exactly; across machines
they are as good as the hosts' clock synchronisation.
"""

from __future__ import annotations

import contextlib
import json
import time

# Track ids within a rank: model work, waits on messages, the whole loop, and the pipeline call around the loop
# (text encoding on rank 0 and the others' wait for its broadcast, the preparation, the decode).
COMPUTE, COMM, LOOP, CALL = 0, 1, 2, 3


class Tracer:
    """Collects complete ("X") events of one rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[dict] = []

    @contextlib.contextmanager
    def span(self, name: str, track: int, **args):
        start = time.time()
        try:
            yield
        finally:
            self.events.append(
                {
                    "name": name,
                    "ph": "X",
                    "ts": start * 1e6,
                    "dur": (time.time() - start) * 1e6,
                    "pid": self.rank,
                    "tid": track,
                    "args": args,
                }
            )

    def metadata(self) -> list[dict]:
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
        ]
        tracks = (COMPUTE, "compute"), (COMM, "communication waits"), (LOOP, "denoising loop"), (CALL, "pipeline call")
        for tid, label in tracks:
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": label}})
        return meta


def engine_time(events: list[dict]) -> dict:
    """Where one rank's denoising loops went, from its trace events: ``compute`` (the model: embedding, blocks,
    output layer, guidance, scheduler step), ``wait`` (blocked on messages; also per denoising step, which tells
    the pipeline's fill and drain from stalls in between) and ``engine`` (everything else inside the loop:
    scheduling, message building, posting, bookkeeping; the tracer's own cost included).

    Returns seconds summed over the traced loops, the number of tasks (compute spans, less the per-step work a rank
    prepares ahead: ``Stage.prepare_step``), and the engine's time per task in microseconds and as a fraction of the
    mean task's compute time.
    """
    loop = sum(e["dur"] for e in events if e.get("tid") == LOOP) / 1e6
    compute_spans = [e for e in events if e.get("tid") == COMPUTE]
    compute = sum(e["dur"] for e in compute_spans) / 1e6
    wait = sum(e["dur"] for e in events if e.get("tid") == COMM) / 1e6
    tasks = sum(1 for e in compute_spans if not e.get("args", {}).get("prepare"))
    engine = loop - compute - wait
    steps = [e["args"]["step"] for e in events if e.get("args", {}).get("step") is not None]
    wait_by_step = [0.0] * (max(steps, default=-1) + 1)  # every step the loop ran, also those without a wait
    for e in events:
        if e.get("tid") == COMM and e.get("args", {}).get("step") is not None:
            wait_by_step[e["args"]["step"]] += e["dur"] / 1e6
    return dict(
        loop_s=loop,
        compute_s=compute,
        wait_s=wait,
        wait_s_by_step=wait_by_step,
        engine_s=engine,
        tasks=tasks,
        engine_us_per_task=1e6 * engine / max(tasks, 1),
        engine_fraction_of_task=engine / compute if compute else 0.0,
    )


def call_time(events: list[dict]) -> dict[str, float]:
    """Seconds of each span on the pipeline-call track (``CALL``) of one rank, summed by name over the traced calls
    (e.g. ``{"call": …, "encode": …, "wait for text": …, "decode": …}``)."""
    spans: dict[str, float] = {}
    for e in events:
        if e.get("tid") == CALL:
            spans[e["name"]] = spans.get(e["name"], 0.0) + e["dur"] / 1e6
    return spans


def null_span(*args, **kwargs):
    """Stands in for ``Tracer.span`` when nothing is traced."""
    return contextlib.nullcontext()


def write_trace(path: str, per_rank: list[list[dict]]) -> int:
    """Merge every rank's events into one trace file; return the number of events written."""
    events = [event for rank_events in per_rank for event in rank_events]
    start = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for event in events:  # relative to the first event: readable numbers in the viewer
        if "ts" in event:
            event["ts"] = round(event["ts"] - start, 1)
            event["dur"] = round(event["dur"], 1)
    with open(path, "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
    return len(events)
