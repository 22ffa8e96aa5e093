"""What ``xfuse serve`` adds to a generation: a real 2-rank served world, requests one after another over HTTP.

    python benchmarks/bench_serve.py [--requests 30] [--size 256] [--steps 8] [--out benchmarks/results]

For each request: the client's whole latency (HTTP, JSON, queue, control plane, every rank's pipeline call, PNG and
base64), the generation time the server reports (post to the workers -> every rank answered), and their difference
(what serving costs on top of the pipeline call). Then 8 concurrent clients (throughput and the spread of queue
waits), and the time from SIGKILL of an idle worker to ``/health`` naming it. Median and min–max; JSON + Markdown.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from tests.support.serve_fns import ServedWorld, poll_health  # noqa: E402 - the same launcher the tests use


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _fmt(stat: dict, unit: str = "ms", scale: float = 1e3) -> str:
    return f"{stat['median'] * scale:.1f} {unit} ({stat['min'] * scale:.1f}–{stat['max'] * scale:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    body = {"prompt": "a lighthouse at dusk", "size": f"{args.size}x{args.size}", "num_inference_steps": args.steps}
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only", "settings": vars(args)}
    with tempfile.TemporaryDirectory() as tmp, ServedWorld(Path(tmp)) as world:
        with httpx.Client(base_url=world.url, timeout=300) as http:
            http.post("/v1/images/generations", json={**body, "seed": 0}).raise_for_status()  # first call warms up
            total, generation = [], []
            for i in range(args.requests):
                start = time.perf_counter()
                response = http.post("/v1/images/generations", json={**body, "seed": i})
                total.append(time.perf_counter() - start)
                response.raise_for_status()
                generation.append(response.json()["timings"]["generation_s"])
        overhead = [t - g for t, g in zip(total, generation, strict=True)]
        results["sequential"] = {
            "client_latency_s": _summary(total),
            "generation_s": _summary(generation),
            "serving_overhead_s": _summary(overhead),
        }

        def one(i: int) -> dict:
            return httpx.post(f"{world.url}/v1/images/generations", json={**body, "seed": i}, timeout=300).json()

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(8)))
        wall = time.perf_counter() - start
        results["concurrent_8"] = {
            "wall_s": wall,
            "images_per_s": 8 / wall,
            "queue_wait_s": _summary([a["timings"]["queue_s"] for a in answers]),
        }
        pid = world.rank_pids()[1]
        os.kill(pid, signal.SIGKILL)
        named, _ = poll_health(world.url, lambda r: r is None or "rank 1" in (r.json().get("reason") or ""), 10, 0.01)
        results["sigkill_idle_worker_to_health_naming_it_s"] = named
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serve.json"), "w") as fh:
        json.dump(results, fh, indent=2)
    seq, conc = results["sequential"], results["concurrent_8"]
    named = results["sigkill_idle_worker_to_health_naming_it_s"]
    throughput = f"{conc['wall_s']:.2f} s, {conc['images_per_s']:.2f} images/s"
    lines = [
        f"Machine: {results['machine']}; tiny preset, 2 ranks (gloo), {args.size} px, {args.steps} steps; "
        f"{args.requests} sequential requests (median, min–max).",
        "",
        "| served request | time |",
        "|---|---|",
        f"| client latency (HTTP, queue, control plane, pipeline, PNG) | {_fmt(seq['client_latency_s'])} |",
        f"| generation (post to workers -> every rank answered) | {_fmt(seq['generation_s'])} |",
        f"| serving overhead (latency - generation) | {_fmt(seq['serving_overhead_s'])} |",
        f"| 8 concurrent clients: wall time, throughput | {throughput} |",
        f"| 8 concurrent clients: queue wait | {_fmt(conc['queue_wait_s'])} |",
        f"| SIGKILL of an idle worker -> `/health` names it | {named:.2f} s |",
    ]
    with open(os.path.join(args.out, "serve.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
