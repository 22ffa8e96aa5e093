"""Where batching served requests pays on this machine: ``serve.max_batch`` 1 against 4, a real 2-rank served world.

    python benchmarks/bench_batching.py [--sizes 128,256,512] [--clients 8] [--rounds 3] [--out benchmarks/results]

For each size: ``xfuse serve`` (the tiny preset, degree 2, 2 patches, one warm-up step, 8 steps) started once with
``serve.max_batch=1`` and once with 4 (``serve.batch_max_pixels`` above every size, so batching is never refused by
size); each round, ``--clients`` concurrent clients post one request each (distinct seeds) and the round's wall time
gives the throughput (images per minute); per-request client latency gives p50 and p95. Median and min–max over the
rounds; the last column is batched over one at a time. The crossover, the largest size where batching still raises
throughput, is what ``serve.batch_max_pixels`` is set from. JSON + Markdown (``batching.{json,md}``).
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


def measure(size: int, max_batch: int, clients: int, rounds: int, steps: int) -> dict:
    settings = (f"serve.max_batch={max_batch}", f"serve.batch_max_pixels={4096 * 4096}", "serve.max_queue=64",
                "serve.max_queued_work=1000", "serve.max_side=1024")  # fmt: skip
    body = {"prompt": "a lighthouse at dusk", "size": f"{size}x{size}", "num_inference_steps": steps}
    with tempfile.TemporaryDirectory() as tmp, ServedWorld(Path(tmp), settings=settings) as world:

        def one(seed: int) -> tuple[float, int]:
            start = time.perf_counter()
            response = httpx.post(f"{world.url}/v1/images/generations", json={**body, "seed": seed}, timeout=600)
            response.raise_for_status()
            return time.perf_counter() - start, response.json()["batch"]

        one(0)  # the first call warms up
        per_minute, latencies, batches = [], [], []
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            for r in range(rounds):
                start = time.perf_counter()
                answers = list(pool.map(one, range(1 + r * clients, 1 + (r + 1) * clients)))
                per_minute.append(60 * clients / (time.perf_counter() - start))
                latencies += [latency for latency, _ in answers]
                batches += [batch for _, batch in answers]
    return {
        "images_per_minute": _spread(per_minute),
        "p50_s": _percentile(latencies, 0.5),
        "p95_s": _percentile(latencies, 0.95),
        "mean_batch": statistics.mean(batches),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,256,512")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = {}
    for size in map(int, args.sizes.split(",")):
        alone = measure(size, 1, args.clients, args.rounds, args.steps)
        batched = measure(size, 4, args.clients, args.rounds, args.steps)
        gain = batched["images_per_minute"]["median"] / alone["images_per_minute"]["median"]
        rows[str(size)] = {"one_at_a_time": alone, "batched_4": batched, "gain": gain}
        print(size, json.dumps(rows[str(size)]), flush=True)
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
        f"Machine: {report['machine']}; tiny preset, degree 2, {args.steps} steps, {args.clients} concurrent clients, "
        f"{args.rounds} rounds.",
        "",
        "| size | one at a time: images/min | p50 / p95 | batched (max 4): images/min | p50 / p95 | mean batch "
        "| gain |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, row in rows.items():
        a, b = row["one_at_a_time"], row["batched_4"]
        lines.append(
            f"| {size}² | {fmt(a['images_per_minute'])} | {a['p50_s']:.2f} / {a['p95_s']:.2f} s "
            f"| {fmt(b['images_per_minute'])} | {b['p50_s']:.2f} / {b['p95_s']:.2f} s | {b['mean_batch']:.1f} "
            f"| {row['gain']:.2f}x |"
        )
    with open(os.path.join(args.out, "batching.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
