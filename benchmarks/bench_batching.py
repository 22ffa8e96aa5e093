"""Where batching served requests pays on this machine: ``serve.max_batch`` 1 against 4, a real 2-rank served world.

    python benchmarks/bench_batching.py [--sizes 128,256,512] [--clients 1,2,4,8] [--rounds 3] [--out ...]

For each size: ``xfuse serve`` (the tiny preset, degree 2, 2 patches, one warm-up step, 8 steps) started with
``serve.max_batch=1`` and with 4, side by side (``serve.batch_max_pixels`` above every size, so batching is never
refused by size). For each number of concurrent clients, each round posts ``--per-round`` requests (distinct seeds)
to one world and then the other (the order alternating by round, so the machine's drift falls on both): each client
posts its share one after another, a closed-loop load of that concurrency. The round's wall time gives the
throughput (images per minute); per-request client latency gives p50 and p95. Median and min–max over the rounds;
the last column is batched over one at a time. The crossover, the largest size where batching still raises
throughput, is what ``serve.batch_max_pixels`` is set from. JSON + Markdown (``batching.{json,md}``).
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
MAX_BATCH = {"one_at_a_time": 1, "batched_4": 4}


def measure(size: int, client_counts: list[int], rounds: int, steps: int, per_round: int) -> dict:
    """Both worlds (``serve.max_batch`` 1 and 4) started side by side; each round runs on one and then the other,
    the order alternating, so drift of the machine falls on both alike (the idle world only answers heartbeats)."""
    body = {"prompt": "a lighthouse at dusk", "size": f"{size}x{size}", "num_inference_steps": steps}
    rows: dict = {label: {} for label in MAX_BATCH}
    with contextlib.ExitStack() as stack:
        worlds = {}
        for label, max_batch in MAX_BATCH.items():
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            worlds[label] = stack.enter_context(ServedWorld(tmp, settings=(f"serve.max_batch={max_batch}", *SETTINGS)))

        def one(url: str, seed: int) -> tuple[float, int]:
            start = time.perf_counter()
            response = httpx.post(f"{url}/v1/images/generations", json={**body, "seed": seed}, timeout=600)
            response.raise_for_status()
            return time.perf_counter() - start, response.json()["batch"]

        for world in worlds.values():
            one(world.url, 0)  # the first call warms up
        seed = 1
        for clients in client_counts:
            runs = {label: {"per_minute": [], "latencies": [], "batches": []} for label in MAX_BATCH}
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                for r in range(rounds):
                    shares = [range(seed + c, seed + per_round, clients) for c in range(clients)]
                    seed += per_round
                    for label in list(MAX_BATCH)[:: 1 if r % 2 == 0 else -1]:
                        url = worlds[label].url

                        def client(seeds: range, url: str = url) -> list[tuple[float, int]]:
                            return [one(url, s) for s in seeds]  # one request after another: a closed loop

                        start = time.perf_counter()
                        answers = [a for share in pool.map(client, shares) for a in share]
                        runs[label]["per_minute"].append(60 * per_round / (time.perf_counter() - start))
                        runs[label]["latencies"] += [latency for latency, _ in answers]
                        runs[label]["batches"] += [batch for _, batch in answers]
            for label, run in runs.items():
                rows[label][str(clients)] = {
                    "images_per_minute": _spread(run["per_minute"]),
                    "p50_s": _percentile(run["latencies"], 0.5),
                    "p95_s": _percentile(run["latencies"], 0.95),
                    "mean_batch": statistics.mean(run["batches"]),
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
            a, b = measured["one_at_a_time"][clients], measured["batched_4"][clients]
            gain = b["images_per_minute"]["median"] / a["images_per_minute"]["median"]
            rows.setdefault(str(size), {})[clients] = {"one_at_a_time": a, "batched_4": b, "gain": gain}
            print(size, clients, json.dumps(rows[str(size)][clients]), flush=True)
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
        f"{args.rounds} rounds.",
        "",
        "| size | clients | one at a time: images/min | p50 / p95 | batched (max 4): images/min | p50 / p95 "
        "| mean batch | gain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size, by_clients in rows.items():
        for clients, row in by_clients.items():
            a, b = row["one_at_a_time"], row["batched_4"]
            lines.append(
                f"| {size}² | {clients} | {fmt(a['images_per_minute'])} | {a['p50_s']:.2f} / {a['p95_s']:.2f} s "
                f"| {fmt(b['images_per_minute'])} | {b['p50_s']:.2f} / {b['p95_s']:.2f} s | {b['mean_batch']:.1f} "
                f"| {row['gain']:.2f}x |"
            )
    with open(os.path.join(args.out, "batching.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
