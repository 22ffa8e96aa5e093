"""What streaming several calls through the pipeline gains over running them one at a time: real gloo worlds.

    python benchmarks/bench_stream.py [--degrees 2 4] [--sizes 256 512] [--calls 4] [--steps 20] [--rounds 7]

The tiny HunyuanDiT preset, M = degree patches, one warm-up step of ``--steps`` (the issue's shape: the warm-up
step and each call's fill and drain leave ranks idle one at a time), one thread per rank (a 4-rank world on this
2-core machine is oversubscribed: measured, not representative of four devices). Each round runs ``--calls`` calls
(different seeds) one after another and as one stream (``run_stream``), the order alternating between rounds;
wall time on rank 0 from a barrier to the last call's latents. Every streamed call's latents are checked equal to
the same call's alone. Median and min–max; the gain is the one-at-a-time median over the stream's. The schedule's
own prediction (``xfuse.parallel.request_stream.overlap_gain``, blocks of work only) beside it. JSON + Markdown
(``stream.*``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tests.support.world import World  # noqa: E402
from xfuse.families.hunyuandit.presets import save_tiny_pipeline  # noqa: E402


def rank_rounds(folder: str, degree: int, size: int, calls: int, steps: int, rounds: int) -> dict:
    """On every rank: ``rounds`` × (the calls one at a time, and as one stream); rank 0's wall times."""
    import torch.distributed as dist

    from xfuse import PipeFusionHunyuanDiTPipeline
    from xfuse.parallel.request_stream import overlap_gain
    from xfuse.parallel.schedule import StreamShape, batch_parts

    parallel = {"pipefusion_degree": degree, "num_patches": degree, "warmup_steps": 1}
    pipe = PipeFusionHunyuanDiTPipeline.from_pretrained(folder, parallel=parallel, comm={"timeout_s": 120})
    pipe.set_progress_bar_config(disable=True)

    def call(seed: int) -> dict:
        return dict(prompt="a red house by a lake", height=size, width=size, num_inference_steps=steps,
                    output_type="latent", use_resolution_binning=False,
                    generator=torch.Generator().manual_seed(seed))  # fmt: skip

    def one_at_a_time() -> list:
        return [pipe(**call(seed)) for seed in range(calls)]

    def stream() -> list:
        return pipe.run_stream([call(seed) for seed in range(calls)])

    cpu: dict[str, list[float]] = {"one at a time": [], "stream": []}  # this rank's CPU seconds per round

    def timed(run, label: str | None = None) -> tuple[float, list]:
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        out = run()
        if label is not None:
            cpu[label].append(time.process_time() - start_cpu)
        return time.perf_counter() - start, out

    alone, streamed = timed(one_at_a_time)[1], timed(stream)[1]  # warm-up, and the check
    same = all(a is None or torch.equal(a.images, s.images) for a, s in zip(alone, streamed, strict=True))
    seconds: dict[str, list[float]] = {"one at a time": [], "stream": []}
    for i in range(rounds):
        order = [("one at a time", one_at_a_time), ("stream", stream)]
        for label, run in order if i % 2 == 0 else order[::-1]:
            seconds[label].append(timed(run, label)[0])
    # the schedule's own gain on this plan (blocks of work only; the CFG batch of 2 in two parts while whole)
    shape = StreamShape(steps, 1, batch_parts(2, degree), (1,) * degree)
    return {"seconds": seconds, "cpu": cpu, "same": same, "predicted": overlap_gain(pipe.plan, [shape] * calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_pipeline(os.path.join(tmp, "HunyuanDiT-tiny"))
        for degree in args.degrees:
            with World(degree, threads_per_rank=1, start_timeout=600) as world:
                for size in args.sizes:
                    ranks = world.run_ok(rank_rounds, folder, degree, size, args.calls, args.steps, args.rounds,
                                         timeout=3600)  # fmt: skip
                    seconds = ranks[0]["seconds"]
                    gain = statistics.median(seconds["one at a time"]) / statistics.median(seconds["stream"])
                    # every rank's CPU seconds of a round, summed: the work the world did, whoever waited
                    cpu = {label: statistics.median(sum(r["cpu"][label][i] for r in ranks) for i in range(args.rounds))
                           for label in seconds}  # fmt: skip
                    rows.append({"degree": degree, "size": size, "same": ranks[0]["same"], "seconds": seconds,
                                 "gain": gain, "predicted": ranks[0]["predicted"], "cpu_s": cpu})  # fmt: skip
                    print(rows[-1]["degree"], size, f"{gain:.3f}x", flush=True)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, CPU only",
        "torch": torch.__version__,
        "settings": vars(args),
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stream.json"), "w") as fh:
        json.dump(report, fh, indent=2)

    def fmt(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"

    lines = [
        f"Machine: {report['machine']}; tiny HunyuanDiT, M = degree, one warm-up step of {args.steps}, "
        f"{args.calls} calls a round, {args.rounds} rounds (order alternating); seconds for all the calls.",
        "",
        "| degree | size | one at a time, s | stream, s | gain | schedule's bound | CPU s, all ranks: one at a time "
        "/ stream | latents equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cpu = row["cpu_s"]
        lines.append(
            f"| {row['degree']} | {row['size']}² | {fmt(row['seconds']['one at a time'])} | "
            f"{fmt(row['seconds']['stream'])} | {row['gain']:.3f}x | {row['predicted']:.3f}x | "
            f"{cpu['one at a time']:.2f} / {cpu['stream']:.2f} | {row['same']} |"
        )
    with open(os.path.join(args.out, "stream.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
