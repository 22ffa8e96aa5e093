"""What between-step cancellation costs and how soon it frees the world: a real 2-rank gloo world.

    python benchmarks/bench_cancellation.py [--steps 20] [--size 128] [--pairs 10] [--out benchmarks/results]

The tiny HunyuanDiT preset, degree 2, 2 patches, one warm-up step (``xfuse serve``'s test world), one thread per
rank. *Cost*: the same call with ``enable_cancellation()`` on and off, alternated ``--pairs`` times; every step then
makes one store write on rank 0 and one wait and read on rank 1. *Latency*: a timer thread on rank 0 sets the
``cancel_if`` flag at 40 % of a whole call's time; each rank's time from the flag to its ``RequestCancelled``, in
milliseconds and in steps of the uncancelled call. Median and min–max. JSON + Markdown (``cancellation.*``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tests.support.world import World  # noqa: E402
from xfuse.families.hunyuandit.presets import save_tiny_pipeline  # noqa: E402

PARALLEL = {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 1}


def rank_runs(folder: str, size: int, steps: int, pairs: int) -> dict:
    """On every rank: wall times with cancellation on and off; then ``pairs`` cancelled calls' flag-to-stop times."""
    import torch.distributed as dist

    from xfuse import PipeFusionHunyuanDiTPipeline
    from xfuse.errors import RequestCancelled

    pipe = PipeFusionHunyuanDiTPipeline.from_pretrained(folder, parallel=PARALLEL, comm={"timeout_s": 60})
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a red house by a lake", height=size, width=size, num_inference_steps=steps,
                output_type="latent", use_resolution_binning=False)  # fmt: skip

    def timed() -> float:
        dist.barrier()
        start = time.perf_counter()
        pipe(**call, generator=torch.Generator().manual_seed(0))
        return time.perf_counter() - start

    timed()  # warm-up
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(pairs):
        for label in ("on", "off") if i % 2 == 0 else ("off", "on"):  # the order alternates
            pipe.enable_cancellation(label == "on")
            seconds[label].append(timed())
    pipe.enable_cancellation()
    whole = statistics.median(seconds["on"])
    flagged = threading.Event()
    flag_at: list[float] = []
    stops: list[dict] = []
    for _ in range(pairs):
        flagged.clear()
        dist.barrier()
        if dist.get_rank() == 0:
            timer = threading.Timer(0.4 * whole, lambda: (flag_at.append(time.time()), flagged.set()))
            timer.start()
        try:
            with pipe.cancel_if(flagged.is_set):
                pipe(**call, generator=torch.Generator().manual_seed(0))
            stops.append({"stopped_at": None, "time": time.time()})
        except RequestCancelled as err:
            stops.append({"stopped_at": err.stopped_at, "time": time.time()})
    return {"seconds": seconds, "stops": stops, "flag_at": flag_at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_pipeline(os.path.join(tmp, "HunyuanDiT-tiny"))
        with World(2, threads_per_rank=1, start_timeout=600) as world:
            ranks = world.run_ok(rank_runs, folder, args.size, args.steps, args.pairs, timeout=3600)

    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}

    seconds = ranks[0]["seconds"]
    step_s = statistics.median(seconds["on"]) / args.steps
    flags = ranks[0]["flag_at"]
    latency = {
        rank: spread([(stop["time"] - flag) * 1e3 for stop, flag in zip(r["stops"], flags, strict=True)])
        for rank, r in enumerate(ranks)
    }
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "torch": torch.__version__,
        "settings": {**vars(args), "parallel": PARALLEL},
        "call_seconds": {label: spread(values) for label, values in seconds.items()},
        "cost": statistics.median(seconds["on"]) / statistics.median(seconds["off"]) - 1,
        "step_ms": step_s * 1e3,
        "stopped_at": [s["stopped_at"] for s in ranks[0]["stops"]],
        "flag_to_stop_ms": latency,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cancellation.json"), "w") as fh:
        json.dump(report, fh, indent=2)

    def fmt(stat: dict, scale: float = 1.0) -> str:
        return f"{stat['median'] * scale:.1f} ({stat['min'] * scale:.1f}–{stat['max'] * scale:.1f})"

    lines = [
        f"Machine: {report['machine']}; tiny HunyuanDiT, degree 2, M = 2, one warm-up step, {args.size}² px, "
        f"{args.steps} steps ({report['step_ms']:.1f} ms a step), {args.pairs} runs each.",
        "",
        "| call | ms |",
        "|---|---|",
        f"| cancellation off | {fmt(report['call_seconds']['off'], 1e3)} |",
        f"| cancellation on (asked every step) | {fmt(report['call_seconds']['on'], 1e3)} |",
        "",
        f"Cost of asking every step: {report['cost'] * 100:+.1f} % (median over median).",
        "",
        "| rank | flag to `RequestCancelled`, ms | in steps |",
        "|---|---|---|",
    ]
    for rank, stat in latency.items():
        lines.append(f"| {rank} | {fmt(stat)} | {fmt(stat, 1 / report['step_ms'])} |")
    lines += ["", f"Stopped before steps: {report['stopped_at']} (the flag is set at 40 % of a whole call)."]
    with open(os.path.join(args.out, "cancellation.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
