"""PipeFusion on CPU: wall time of the denoising loop and bytes per step per rank (issue 3's benchmark).

    python benchmarks/bench_pipefusion.py [--steps 20] [--warmup 1] [--repeats 1] [--json out.json]

* Time: the `small` preset (16 blocks, hidden 256, 512 px, batch 2 with CFG), one torch thread per rank, at degree 1
  and degree 2 (folded and linear, M = 2), `steps` steps with `warmup` whole-image warm-up steps. With 20 steps and 1
  warm-up step the ideal degree-2 speedup is 20 / (3/4 + 19/2) = 1.95x (``ideal_speedup``: the warm-up step's two
  CFG batch parts overlap on the two ranks).
* Bytes: the `bytes40` preset (40 blocks like the released checkpoint, hidden 32) at 1024 px, from the comm
  counters of a real run, per step and rank, folded, balanced and linear at N = 2, 4, 8; scaled x44 to hidden 1408.
Each degree runs in its own world of real gloo processes (this machine: 2 cores, so degree 2 is the largest degree
whose ranks each get a core for the timing), timed in turns (``interleaved_loops``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xfuse.parallel.schedule import batch_parts  # noqa: E402  (after the path insert, as run directly)

WIDTH_SCALE = 1408 / 32  # hidden states and skips scale with the width; latents do not


def spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values), runs=values)


def ideal_speedup(steps: int, degree: int, model_batch: int = 2) -> float:
    """Degree-N speedup without fill, drain or any cost but the blocks (warm-up 1): the warm-up step's P batch parts
    through N equal stages take (P + N - 1) / (P N) of a step, every pipelined step 1 / N of one."""
    parts = batch_parts(model_batch, degree)
    return steps / ((parts + degree - 1) / (parts * degree) + (steps - 1) / degree)


def wait_phases(wait_s_by_step: list[float]) -> tuple[float, float, float, float]:
    """A rank's waits (``trace.engine_time``'s ``wait_s_by_step``, warm-up 1) at the whole-image warm-up step, the
    first pipelined step (the pipeline's fill), the steps between and the last step (its drain)."""
    by_step = wait_s_by_step
    return sum(by_step[:1]), sum(by_step[1:2]), sum(by_step[2:-1]), sum(by_step[2:][-1:])


def speedups(rows: dict, base) -> dict:
    """``interleaved_loops``' rows as timings: each configuration's spread of times, its speedup (``base``'s median
    over its own) and each round's (``base``'s time in that round over its own: how far single pairs stray)."""
    base_runs = rows[base]["times"]
    return {
        name: dict(
            **spread(row["times"]),
            speedup=statistics.median(base_runs) / statistics.median(row["times"]),
            round_speedups=[one / t for one, t in zip(base_runs, row["times"], strict=True)],
        )
        for name, row in rows.items()
    }


def pin_to_core(rank: int, degree: int) -> None:
    """Pin every thread of this rank's process to core ``rank`` when the machine has a core per rank (as a GPU per
    rank): gloo's I/O threads were started with the process group, before any benchmark setup, and would otherwise
    run on another rank's core; threads started later inherit the mask."""
    if degree > (os.cpu_count() or 1) or not hasattr(os, "sched_setaffinity"):
        return
    for thread in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        os.sched_setaffinity(int(thread), {rank})


_LOOP: dict = {}  # in a rank process: the model, engine and grid that setup_loop_rank built, kept between calls


def setup_loop_rank(preset, degree, placement, num_patches, warmup, size, layers=None) -> None:
    """On every rank: build the model (deterministic; ``layers`` overrides the preset's block count), its stage and
    engine, and keep them for ``time_loop_rank``; pin the rank to its own core (as a GPU per rank); freeze the
    start-up heap and keep freed memory as the CLI does (``xfuse.runtime.heap``)."""
    import torch
    import torch.distributed as dist

    from xfuse.comm.p2p import P2PChannels
    from xfuse.families.hunyuandit.presets import build_tiny_pipeline
    from xfuse.families.hunyuandit.stage import HunyuanDiTStage
    from xfuse.families.registry import HUNYUANDIT
    from xfuse.parallel.engine import PipeFusionEngine
    from xfuse.parallel.patch_grid import patch_grid
    from xfuse.parallel.stage_plan import stage_plan
    from xfuse.runtime.heap import freeze_startup_heap, keep_freed_heap

    rank = dist.get_rank()
    pin_to_core(rank, degree)
    pipe = build_tiny_pipeline(preset, seed=0, **({} if layers is None else {"num_layers": layers}))
    num_layers = pipe.transformer.config.num_layers
    plan = stage_plan(num_layers, degree, placement, skips=HUNYUANDIT.skip_pairs(num_layers))
    stage = HunyuanDiTStage(pipe.transformer, plan, rank)
    channels = P2PChannels(rank=rank, timeout_s=600, max_inflight=2, device=torch.device("cpu")) if degree > 1 else None
    engine = PipeFusionEngine(
        stage, plan, channels, pipe_rank=rank, group_ranks=list(range(degree)), warmup_steps=warmup
    )
    _LOOP.clear()
    grid = patch_grid(size // 8, size // 8, num_patches, 2)
    _LOOP.update(pipe=pipe, stage=stage, channels=channels, engine=engine, size=size, grid=grid)
    freeze_startup_heap()  # as xfuse generate / serve ranks do after loading
    keep_freed_heap()


def time_loop_rank(steps: int, trace: bool = False) -> dict:
    """On every rank of a world set up by ``setup_loop_rank``: one denoising loop between two barriers (the
    process's first call included when it is the first). Returns its wall time, the comm counters and the peak
    resident memory; with ``trace``, the loop is traced and the ``engine_time`` split (compute / waits / the
    engine's own time per task) comes back instead of a time."""
    import resource

    import torch.distributed as dist

    from xfuse.families.hunyuandit.reference import prepare_inputs, request_from_inputs
    from xfuse.parallel.trace import Tracer, engine_time

    pipe, stage, channels, size = _LOOP["pipe"], _LOOP["stage"], _LOOP["channels"], _LOOP["size"]
    inputs = prepare_inputs(pipe, height=size, width=size, num_inference_steps=steps)
    request = request_from_inputs(stage, inputs, copy.deepcopy(pipe.scheduler))
    tracer = Tracer(dist.get_rank()) if trace else None
    if channels is not None:
        channels.counters.reset()
    dist.barrier()
    start = time.perf_counter()
    _LOOP["engine"].denoise(request, _LOOP["grid"], tracer)
    dist.barrier()
    seconds = time.perf_counter() - start
    return dict(
        seconds=None if trace else seconds,
        engine_time=engine_time(tracer.events) if trace else None,
        counters=None if channels is None else channels.counters.as_dict(),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def bench_rank(preset, degree, placement, num_patches, warmup, steps, size, repeats):
    """On every rank: set up, run the loop ``repeats`` times (the first call included), return times, the last
    loop's comm counters and the peak resident memory."""
    setup_loop_rank(preset, degree, placement, num_patches, warmup, size)
    runs = [time_loop_rank(steps) for _ in range(repeats)]
    return dict(
        times=[r["seconds"] for r in runs], counters=runs[-1]["counters"], peak_rss_mib=runs[-1]["peak_rss_mib"]
    )


def run_world(degree, *args, timeout=3600, **kwargs):
    from tests.support.world import World

    with World(degree, threads_per_rank=1, start_timeout=600) as world:
        return world.run_ok(bench_rank, *args, timeout=timeout, **kwargs)


def interleaved_loops(configs: dict, repeats: int, steps: int, *, trace: bool = False, timeout=3600) -> dict:
    """Time several loop configurations in turns: one world per configuration, all set up first, then
    ``repeats`` rounds that run each configuration once, in order. A speedup is a ratio of two configurations'
    times, so each round pairs them in time and the machine's drift between runs (large on a small shared
    machine) falls on both alike instead of on whichever ran later; every configuration's first call is in round 1.

    Args:
        configs: name -> ``(degree, setup_loop_rank arguments after degree)``, e.g.
            ``{"1": (1, ("small", "folded", 1, 1, 512))}``.
        trace: after the rounds, one traced loop in each multi-rank world.

    Returns:
        name -> ``{"times": [...], "peak_rss_mib": [per rank], "counters": [per rank], "engine_time": [per rank]
        or None}``.
    """
    import contextlib

    from tests.support.world import World

    rows = {}
    with contextlib.ExitStack() as stack:
        worlds = {}
        for name, (degree, setup) in configs.items():
            worlds[name] = stack.enter_context(World(degree, threads_per_rank=1, start_timeout=600))
            preset, placement, num_patches, warmup, size, *layers = setup
            worlds[name].run_ok(
                setup_loop_rank, preset, degree, placement, num_patches, warmup, size, *layers, timeout=timeout
            )
            rows[name] = dict(times=[], engine_time=None)
        for _ in range(repeats):
            for name, world in worlds.items():
                results = world.run_ok(time_loop_rank, steps, timeout=timeout)
                rows[name]["times"].append(results[0]["seconds"])
                rows[name]["peak_rss_mib"] = [r["peak_rss_mib"] for r in results]
                rows[name]["counters"] = [r["counters"] for r in results]
        if trace:
            for name, world in worlds.items():
                if configs[name][0] > 1:
                    results = world.run_ok(time_loop_rank, steps, True, timeout=timeout)
                    rows[name]["engine_time"] = [r["engine_time"] for r in results]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    report = dict(
        machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        steps=args.steps,
        warmup=args.warmup,
        time={},
        bytes={},
    )
    if not args.skip_time:
        configs = {
            f"{degree}-{placement}": (degree, ("small", placement, degree, args.warmup, 512))
            for degree, placement in ((1, "folded"), (2, "folded"), (2, "linear"))
        }
        for key, row in speedups(interleaved_loops(configs, args.repeats, args.steps), "1-folded").items():
            report["time"][key] = dict(wall_s=row["median"], speedup=row["speedup"], runs=row["runs"])
            print(f"degree {key}: {row['median']:7.2f} s  speedup {row['speedup']:.2f}x", flush=True)
    for degree in (2, 4, 8):
        for placement in ("folded", "balanced", "linear"):
            results = run_world(degree, "bytes40", degree, placement, degree, 1, 2, 1024, 1)
            per_rank = [{k: v / 2 for k, v in r["counters"]["sent_bytes"].items()} for r in results]  # 2 steps
            total = sum(sum(r.values()) for r in per_rank)
            real = [sum(v * (1 if k == "latent" else WIDTH_SCALE) for k, v in r.items()) for r in per_rank]
            report["bytes"][f"{degree}-{placement}"] = dict(
                per_rank=per_rank, total_per_step=total, per_rank_hidden1408=real
            )
            print(
                f"N={degree} {placement:>6}: {sum(real) / 2**20:8.1f} MiB/step at hidden 1408 "
                f"(measured {total / 2**20:.2f} MiB at hidden 32)",
                flush=True,
            )
    print("\n| degree | placement | denoising loop | speedup |\n|---|---|---|---|")
    for key, row in report["time"].items():
        degree, placement = key.split("-")
        print(f"| {degree} | {placement if degree != '1' else '-'} | {row['wall_s']:.1f} s | {row['speedup']:.2f}x |")
    print(
        "\n| N | folded MiB/step | balanced MiB/step | linear MiB/step | folded/linear | per-rank folded | "
        "per-rank balanced | per-rank linear |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for degree in (2, 4, 8):
        folded, balanced, linear = (
            report["bytes"][f"{degree}-{p}"]["per_rank_hidden1408"] for p in ("folded", "balanced", "linear")
        )

        def fmt(rows):
            return " / ".join(f"{b / 2**20:.0f}" for b in rows)

        print(
            f"| {degree} | {sum(folded) / 2**20:.0f} | {sum(balanced) / 2**20:.0f} | {sum(linear) / 2**20:.0f} | "
            f"{sum(folded) / sum(linear):.3f} | {fmt(folded)} | {fmt(balanced)} | {fmt(linear)} |"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
