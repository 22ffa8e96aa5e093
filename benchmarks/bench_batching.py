"""Where batching served requests pays on this machine: ``serve.max_batch`` 1 against 4, a real 2-rank served world.

    python benchmarks/bench_batching.py [--sizes 128,256,512] [--clients 1,2,4,8] [--rounds 3] [--out ...]

For each size: ``xfuse serve`` (the tiny preset, degree 2, 2 patches, one warm-up step, 8 steps) started once with
``serve.max_batch=1`` and once with 4 (``serve.batch_max_pixels`` above every size, so batching is never refused by
size). For each number of concurrent clients, each round posts 8 requests (distinct seeds): each client posts its
share one after another, as a closed-loop load of that concurrency. The round's wall time gives the throughput
(images per minute); per-request client latency gives p50 and p95. Median and min–max over the rounds; the last
column is batched over one at a time. The crossover, the largest size where batching still raises throughput, is
what ``serve.batch_max_pixels`` is set from. JSON + Markdown (``batching.{json,md}``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
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


def measure(size: int, max_batch: int, client_counts: list[int], rounds: int, steps: int, per_round: int) -> dict:
    settings = (f"serve.max_batch={max_batch}", f"serve.batch_max_pixels={4096 * 4096}", "serve.max_queue=64",
                "serve.max_queued_work=1000", "serve.max_side=1024")  # fmt: skip
    body = {"prompt": "a lighthouse at dusk", "size": f"{size}x{size}", "num_inference_steps": steps}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp, ServedWorld(Path(tmp), settings=settings) as world:

        def one(seed: int) -> tuple[float, int]:
            start = time.perf_counter()
            response = httpx.post(f"{world.url}/v1/images/generations", json={**body, "seed": seed}, timeout=600)
            response.raise_for_status()
            return time.perf_counter() - start, response.json()["batch"]

        one(0)  # the first call warms up
        seed = 1
        for clients in client_counts:

            def client(seeds: range) -> list[tuple[float, int]]:
                return [one(s) for s in seeds]  # one request after another: a closed loop

            per_minute, latencies, batches = [], [], []
            with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                for _ in range(rounds):
                    shares = [range(seed + c, seed + per_round, clients) for c in range(clients)]
                    seed += per_round
                    start = time.perf_counter()
                    answers = [a for share in pool.map(client, shares) for a in share]
                    per_minute.append(60 * per_round / (time.perf_counter() - start))
                    latencies += [latency for latency, _ in answers]
                    batches += [batch for _, batch in answers]
            rows[str(clients)] = {
                "images_per_minute": _spread(per_minute),
                "p50_s": _percentile(latencies, 0.5),
                "p95_s": _percentile(latencies, 0.95),
                "mean_batch": statistics.mean(batches),
            }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,256,512")
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    client_counts = [int(c) for c in args.clients.split(",")]
    rows: dict = {}
    for size in map(int, args.sizes.split(",")):
        alone = measure(size, 1, client_counts, args.rounds, args.steps, args.per_round)
        batched = measure(size, 4, client_counts, args.rounds, args.steps, args.per_round)
        for clients in map(str, client_counts):
            a, b = alone[clients], batched[clients]
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
