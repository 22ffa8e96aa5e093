"""Serving soak: 1,000 requests from 8 concurrent clients against one real 2-rank ``xfuse serve`` world.

    python benchmarks/soak_serve.py [--requests 1000] [--clients 8] [--out benchmarks/results]

The world: the tiny preset, degree 2, 2 patches, one warm-up step, ``serve.max_batch=4`` and
``serve.max_inflight=4`` (so batches form under load, and up to four calls stream through the pipeline together). The
requests mix three sizes, 2-6 steps, their own seeds, and every tenth asks for two images; every 40th is
20 steps and its client hangs up 0.05-0.95 s after sending (the request is dropped from the queue, or stopped
between steps while it runs). Counted: answered 200 (each PNG checked for its size), failed (any other answer or
error: must be 0), and hang-ups. Every 100 answered requests and after the last, each rank's resident memory
(``VmRSS`` from /proc); memory is flat when every rank's RSS at the last sample is within 5 % of its RSS at request
100. JSON + Markdown (``soak_serve.*``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from tests.support.serve_fns import ServedWorld, decode_png  # noqa: E402 - the same launcher the tests use

SIZES = ((128, 128), (64, 128), (128, 64))
SETTINGS = ("serve.max_batch=4", "serve.max_inflight=4", "serve.max_queue=64", "serve.max_queued_work=1000",
            "comm.timeout_s=30")  # fmt: skip


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def request_body(i: int) -> dict:
    width, height = SIZES[i % len(SIZES)]
    body = {"prompt": f"soak {i}", "size": f"{width}x{height}", "num_inference_steps": 2 + i % 5, "seed": i}
    if i % 10 == 9:
        body["n"] = 2
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    counts = {"ok": 0, "failed": 0, "hung_up": 0, "streamed": 0}  # streamed: answered from a stream of > 1 call
    failures: list[str] = []
    samples: list[dict] = []  # every 100 answered requests: each rank's RSS
    lock = threading.Lock()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ServedWorld(Path(tmp), settings=SETTINGS) as world:
        pids = world.rank_pids()

        def one(i: int) -> None:
            body = request_body(i)
            url = f"{world.url}/v1/images/generations"
            if i % 40 == 39:  # hangs up: dropped while queued, or stopped between steps while it runs
                try:
                    httpx.post(url, json={**body, "num_inference_steps": 20}, timeout=0.05 + (i // 40) % 7 * 0.15)
                except httpx.TimeoutException:
                    with lock:
                        counts["hung_up"] += 1
                    return
            try:
                response = httpx.post(url, json=body, timeout=300)
                ok = response.status_code == 200
                if ok:
                    width, height = map(int, body["size"].split("x"))
                    images = [decode_png(d["b64_json"]) for d in response.json()["data"]]
                    ok = len(images) == body.get("n", 1) and all(im.size == (width, height) for im in images)
                    with lock:
                        counts["streamed"] += response.json()["stream"] > 1
                detail = f"{response.status_code} {response.text[:200]}"
            except httpx.HTTPError as err:
                ok, detail = False, f"{type(err).__name__}: {err}"
            with lock:
                counts["ok" if ok else "failed"] += 1
                if not ok:
                    failures.append(f"request {i}: {detail}")
                if ok and counts["ok"] % 100 == 0:
                    rss = {rank: rss_kib(pid) for rank, pid in pids.items()}
                    samples.append({"answered": counts["ok"], "seconds": time.perf_counter() - started, "rss_kib": rss})
                    print(json.dumps(samples[-1]), flush=True)

        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(one, range(args.requests)))
        rss = {rank: rss_kib(pid) for rank, pid in pids.items()}  # after the last request
        samples.append({"answered": counts["ok"], "seconds": time.perf_counter() - started, "rss_kib": rss})
        cancelled = float(
            next(
                line.split()[1]
                for line in httpx.get(f"{world.url}/metrics").text.splitlines()
                if line.startswith("xfuse_cancelled_requests_total ")
            )
        )
        health = httpx.get(f"{world.url}/health").status_code
    elapsed = time.perf_counter() - started
    first = next(s for s in samples if s["answered"] >= 100)
    growth = {rank: samples[-1]["rss_kib"][rank] / first["rss_kib"][rank] - 1 for rank in first["rss_kib"]}
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "settings": {**vars(args), "world": list(SETTINGS)},
        "counts": counts,
        "stopped_between_steps": cancelled,
        "failures": failures[:20],
        "health_after": health,
        "seconds": elapsed,
        "rss_samples": samples,
        "rss_growth_from_request_100": growth,
        "flat": all(abs(g) <= 0.05 for g in growth.values()),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak_serve.json"), "w") as fh:
        json.dump(report, fh, indent=2)
    rows = [
        f"Machine: {report['machine']}; tiny preset, degree 2, `serve.max_batch=4`, `serve.max_inflight=4`; "
        f"{args.requests} requests from "
        f"{args.clients} concurrent clients in {elapsed:.0f} s (sizes 128x128, 64x128, 128x64; 2-6 steps; n=2 every "
        "tenth; every 40th request is 20 steps and its client hangs up 0.05-0.95 s after sending).",
        "",
        f"Answered 200: {counts['ok']} ({counts['streamed']} of them from a stream of several calls); failed: "
        f"{counts['failed']}; hung up: {counts['hung_up']} (of them stopped "
        f"between steps on every rank: {cancelled:.0f}; the others were dropped from the queue); `/health` after: "
        f"{health}.",
        "",
        "| answered | " + " | ".join(f"rank {r} RSS (MiB)" for r in sorted(first["rss_kib"])) + " |",
        "|---|" + "---|" * len(first["rss_kib"]),
    ]
    for s in samples:
        mib = [f"{s['rss_kib'][r] / 1024:.1f}" for r in sorted(s["rss_kib"])]
        rows.append(f"| {s['answered']} | " + " | ".join(mib) + " |")
    rows += ["", "RSS from request 100 to the last sample: " + ", ".join(
        f"rank {r} {g * 100:+.1f} %" for r, g in sorted(growth.items())) + ("  (flat: within 5 %)" if report["flat"]
        else "  (NOT flat)")]  # fmt: skip
    with open(os.path.join(args.out, "soak_serve.md"), "w") as fh:
        fh.write("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
