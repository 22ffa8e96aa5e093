"""Where batching and streaming served requests pay on this machine: one request at a time, against
``serve.max_inflight: 4`` (calls streamed through the pipeline) and ``serve.max_batch: 4`` (one call of several), a
real 2-rank served world each.

    python benchmarks/bench_batching.py [--sizes 128,256,512] [--clients 1,2,4,8] [--rounds 3] [--out ...]

For each size: ``xfuse serve`` (the tiny preset, degree 2, 2 patches, one warm-up step, 8 steps) started three
times side by side (``serve.batch_max_pixels`` above every size, so batching is never refused by size). For each
number of concurrent clients, each round posts ``--per-round`` requests (distinct seeds) to each world in turn (the
order rotating by round, so the machine's drift falls on all alike): each client posts its share one after another,
a closed-loop load of that concurrency. The round's wall time gives the throughput (images per minute); per-request
client latency gives p50 and p95. Median and min–max over the rounds; the gains are over one at a time. The
crossover, the largest size where batching still raises throughput, is what ``serve.batch_max_pixels`` is set from.
JSON + Markdown (``batching.{json,md}``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from tests.support.serve_fns import ServedWorld  # noqa: E402 - the same launcher the tests use


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


SETTINGS = (
    "serve.batch_max_pixels=16777216",
    "serve.max_queue=64",
    "serve.max_queued_work=1000",
    "serve.max_side=1024",
)
WORLDS = {  # label -> (serve.max_batch, serve.max_inflight)
    "one_at_a_time": (1, 1),
    "streamed_4": (1, 4),
    "batched_4": (4, 1),
}


def measure(size: int, client_counts: list[int], rounds: int, steps: int, per_round: int) -> dict:
    """The worlds (``WORLDS``) started side by side; each round runs on each in turn, the order rotating, so drift
    of the machine falls on all alike (the idle worlds only answer heartbeats)."""
    body = {"prompt": "a lighthouse at dusk", "size": f"{size}x{size}", "num_inference_steps": steps}
    rows: dict = {label: {} for label in WORLDS}
    with contextlib.ExitStack() as stack:
        worlds = {}
        for label, (max_batch, max_inflight) in WORLDS.items():
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            settings = (f"serve.max_batch={max_batch}", f"serve.max_inflight={max_inflight}", *SETTINGS)
            worlds[label] = stack.enter_context(ServedWorld(tmp, settings=settings))

        def one(url: str, seed: int) -> tuple[float, int, int]:
            start = time.perf_counter()
            response = httpx.post(f"{url}/v1/images/generations", json={**body, "seed": seed}, timeout=600)
            response.raise_for_status()
            return time.perf_counter() - start, response.json()["batch"], response.json()["stream"]

        for world in worlds.values():
            one(world.url, 0)  # the first call warms up
        seed = 1
        for clients in client_counts:
            runs = {label: {"per_minute": [], "latencies": [], "batches": [], "streams": []} for label in WORLDS}
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                for r in range(rounds):
                    shares = [range(seed + c, seed + per_round, clients) for c in range(clients)]
                    seed += per_round
                    order = list(WORLDS)[r % len(WORLDS) :] + list(WORLDS)[: r % len(WORLDS)]
                    for label in order if r % 2 == 0 else order[::-1]:
                        url = worlds[label].url

                        def client(seeds: range, url: str = url) -> list[tuple[float, int, int]]:
                            return [one(url, s) for s in seeds]  # one request after another: a closed loop

                        start = time.perf_counter()
                        answers = [a for share in pool.map(client, shares) for a in share]
                        runs[label]["per_minute"].append(60 * per_round / (time.perf_counter() - start))
                        runs[label]["latencies"] += [latency for latency, _, _ in answers]
                        runs[label]["batches"] += [batch for _, batch, _ in answers]
                        runs[label]["streams"] += [stream for _, _, stream in answers]
            for label, run in runs.items():
                rows[label][str(clients)] = {
                    "images_per_minute": _spread(run["per_minute"]),
                    "p50_s": _percentile(run["latencies"], 0.5),
                    "p95_s": _percentile(run["latencies"], 0.95),
                    "mean_batch": statistics.mean(run["batches"]),
                    "mean_stream": statistics.mean(run["streams"]),
                }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,256,512")
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    client_counts = [int(c) for c in args.clients.split(",")]
    rows: dict = {}
    for size in map(int, args.sizes.split(",")):
        measured = measure(size, client_counts, args.rounds, args.steps, args.per_round)
        for clients in map(str, client_counts):
            row = {label: measured[label][clients] for label in WORLDS}
            base = row["one_at_a_time"]["images_per_minute"]["median"]
            row["gains"] = {label: row[label]["images_per_minute"]["median"] / base for label in WORLDS}
            rows.setdefault(str(size), {})[clients] = row
            print(size, clients, json.dumps(row["gains"]), flush=True)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "settings": vars(args),
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "batching.json"), "w") as fh:
        json.dump(report, fh, indent=2)

    def fmt(stat: dict) -> str:
        return f"{stat['median']:.1f} ({stat['min']:.1f}–{stat['max']:.1f})"

    lines = [
        f"Machine: {report['machine']}; tiny preset, degree 2, {args.steps} steps; each round {args.per_round} "
        f"requests from the given number of concurrent clients (each posting its share one after another), "
        f"{args.rounds} rounds. Streamed: `serve.max_inflight: 4`; batched: `serve.max_batch: 4`.",
        "",
        "| size | clients | one at a time: images/min | p50 / p95 | streamed: images/min | p50 / p95 | mean stream "
        "| gain | batched: images/min | p50 / p95 | mean batch | gain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, by_clients in rows.items():
        for clients, row in by_clients.items():
            a, s, b = row["one_at_a_time"], row["streamed_4"], row["batched_4"]
            gains = row["gains"]
            lines.append(
                f"| {size}² | {clients} | {fmt(a['images_per_minute'])} | {a['p50_s']:.2f} / {a['p95_s']:.2f} s "
                f"| {fmt(s['images_per_minute'])} | {s['p50_s']:.2f} / {s['p95_s']:.2f} s | {s['mean_stream']:.1f} "
                f"| {gains['streamed_4']:.2f}x "
                f"| {fmt(b['images_per_minute'])} | {b['p50_s']:.2f} / {b['p95_s']:.2f} s | {b['mean_batch']:.1f} "
                f"| {gains['batched_4']:.2f}x |"
            )
    with open(os.path.join(args.out, "batching.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
