"""Step caching across layouts: what First-Block Cache gains under Ulysses and under PipeFusion, where PipeFusion's
skipped steps' time goes, and what the performance model replays for the same skipped steps.

    python benchmarks/bench_cache_layouts.py            # degrees 2 and 4; writes benchmarks/results/cache_layouts.*
    python benchmarks/bench_cache_layouts.py --degrees 2 --repeats 3
    python benchmarks/bench_cache_layouts.py --stream --degrees 2   # cache_layouts_stream.json (below)

The model of issue 79: FLUX.1 with 4 double + 8 single blocks of 8 heads x 64 (``flux-small``'s blocks, twice its
heads), 512 px, 12 steps, one thread per rank, ``first_block`` at threshold 0.5. Per degree, Ulysses over every rank
and PipeFusion over every rank (warm-up 1) at M = N and M = 2N patches, each uncached and cached, timed in turns
(the order rotating per repeat) on one world. Each row: the whole call's seconds (median, min–max), the steps
skipped, the gain from caching, the ideal gain (steps / computed steps), the PSNR of the decoded image to the uncached
serial one (degree 1), and from the engine's trace of the last call: seconds of compute in computed and in skipped
steps, and seconds waiting on messages (the busiest rank). ``model`` is the performance model's replay of the same
layout, skipped steps and task order (``xfuse.perf.model``, the CPU rank's figures): the gain it predicts.
``--stream``: PipeFusion at M = N, three requests one at a time and as one stream (``run_stream``), uncached and
cached: seconds per request, and whether a stream's other requests recover the refill a skipped step leaves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests.support

from benchmarks.quality import psnr  # noqa: E402
from tests.support.world import World  # noqa: E402
from xfuse.parallel.trace import COMM, COMPUTE  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PRESET, HEADS, SIZE, STEPS = "flux-small", 8, 512, 12
CACHE = {"method": "first_block", "threshold": 0.5}
CALL = dict(prompt="a red house by a lake", height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=3.5)


def layouts(degree: int) -> dict[str, dict]:
    pipelined = {"pipefusion_degree": degree, "warmup_steps": 1}
    return {
        f"ulysses {degree}": {"pipefusion_degree": 1, "ulysses_degree": degree},
        f"pipefusion {degree}, M = {degree}": {**pipelined, "num_patches": degree},
        f"pipefusion {degree}, M = {2 * degree}": {**pipelined, "num_patches": 2 * degree},
    }


def transformer_config() -> dict:
    """The measured model's ``FluxTransformer2DModel`` arguments: ``flux-small``'s with ``HEADS`` heads."""
    from xfuse.families.flux import presets

    return dict(presets.preset_transformer_config(PRESET), num_attention_heads=HEADS)


def build_base():
    """The diffusers ``FluxPipeline`` of the measured model (``transformer_config``)."""
    from diffusers import FluxTransformer2DModel

    from xfuse.families.common.presets import seeded
    from xfuse.families.registry import model_spec

    base = model_spec(PRESET).build_preset_pipeline(PRESET)
    with seeded(0, "transformer"):
        base.transformer = FluxTransformer2DModel(**transformer_config()).eval()
    return base


def trace_seconds(events: list[dict], skipped: set[int]) -> dict:
    """One call's compute in computed and in ``skipped`` steps, and its waits, in seconds (one rank's trace)."""
    compute = [e for e in events if e["tid"] == COMPUTE and e["args"].get("step") is not None]
    return {
        "computed_s": sum(e["dur"] for e in compute if e["args"]["step"] not in skipped) / 1e6,
        "skipped_s": sum(e["dur"] for e in compute if e["args"]["step"] in skipped) / 1e6,
        "wait_s": sum(e["dur"] for e in events if e["tid"] == COMM) / 1e6,
    }


def rank_runs(degree: int, repeats: int) -> dict:
    """On every rank of a ``degree`` world: each layout's calls, uncached and cached, timed in turns."""
    from xfuse.families.registry import model_spec

    pipes = {}
    for name, parallel in (layouts(degree) if degree > 1 else {"serial": {"pipefusion_degree": 1}}).items():
        for cached in (False, True):
            sections = {"cache": CACHE} if cached else {}
            # from_pipe takes the transformer it shards: a build of the same weights per pipeline
            pipe = model_spec(PRESET).pipeline_class().from_pipe(build_base(), parallel=parallel, **sections)
            pipe.set_progress_bar_config(disable=True)
            pipe(**CALL, output_type="latent", generator=torch.Generator().manual_seed(0))  # warm
            pipes[(name, cached)] = pipe
    keys = list(pipes)
    rows: dict = {key: {"seconds": []} for key in keys}
    for repeat in range(repeats):
        for key in keys[repeat % len(keys) :] + keys[: repeat % len(keys)]:
            pipe = pipes[key]
            pipe.enable_trace()  # a new timeline: this call's events only
            start = time.perf_counter()
            out = pipe(**CALL, output_type="np", generator=torch.Generator().manual_seed(0))
            rows[key]["seconds"].append(time.perf_counter() - start)
            decisions = list(pipe.engine.cache_decisions) if key[1] else []
            skipped = [step for step, computed in enumerate(decisions) if not computed]
            image = None if out is None else (np.asarray(out.images[0]) * 255).round().astype(np.uint8)
            rows[key].update(skipped=skipped, trace=trace_seconds(pipe.trace_events(), set(skipped)), image=image)
    return rows


STREAM_CALLS = 3  # ``--stream``: requests of one stream (seeds 0, 1, 2)


def rank_stream(degree: int, repeats: int) -> dict:
    """On every rank of a ``degree`` world, PipeFusion at M = N: ``STREAM_CALLS`` requests one at a time and as one
    stream (``run_stream``: another request's tasks fill a rank's idle time, a skipped step's refill too), uncached and
    cached, timed in turns; rank 0's seconds per request and each request's skipped steps."""
    from xfuse.families.registry import model_spec

    parallel = {"pipefusion_degree": degree, "num_patches": degree, "warmup_steps": 1}
    calls = [dict(CALL, output_type="latent", generator=torch.Generator().manual_seed(s)) for s in range(STREAM_CALLS)]
    pipes = {}
    for cached in (False, True):
        sections = {"cache": CACHE} if cached else {}
        pipe = model_spec(PRESET).pipeline_class().from_pipe(build_base(), parallel=parallel, **sections)
        pipe.set_progress_bar_config(disable=True)
        pipe(**calls[0])  # warm
        pipes[cached] = pipe
    runs = {(how, cached): [] for how in ("one at a time", "streamed") for cached in (False, True)}
    skipped: dict = {}
    for repeat in range(repeats):
        keys = list(runs)
        for how, cached in keys[repeat % len(keys) :] + keys[: repeat % len(keys)]:
            pipe = pipes[cached]
            fresh = [dict(c, generator=torch.Generator().manual_seed(seed)) for seed, c in enumerate(calls)]
            start = time.perf_counter()
            if how == "streamed":
                pipe.run_stream(fresh)
                decisions = pipe.engine.stream_cache_decisions
            else:
                decisions = []
                for call in fresh:
                    pipe(**call)
                    decisions.append(list(pipe.engine.cache_decisions))
            runs[(how, cached)].append((time.perf_counter() - start) / len(calls))
            skipped[(how, cached)] = [sum(not c for c in d) for d in decisions] if cached else [0] * len(calls)
    return {"seconds": runs, "skipped": skipped}


def stream_table(degree: int, result: dict) -> dict:
    table = {}
    for (how, cached), seconds in result["seconds"].items():
        base = statistics.median(result["seconds"][(how, False)])
        median = statistics.median(seconds)
        table[f"pipefusion {degree}, M = {degree}, {how}, {'first_block 0.5' if cached else 'uncached'}"] = {
            "seconds_per_request_median": round(median, 3),
            "seconds_min": round(min(seconds), 3),
            "seconds_max": round(max(seconds), 3),
            "skipped_per_request": result["skipped"][(how, cached)],
            "gain_from_caching": round(base / median, 3),
        }
    return table


def predicted_gain(degree: int, parallel: dict, skipped: list[int]) -> float:
    """The performance model's gain from caching for this layout and these skipped steps on CPU ranks."""
    from xfuse.config import ParallelConfig
    from xfuse.families.registry import model_spec
    from xfuse.perf.calibration import FITTED
    from xfuse.perf.model import Workload, machine, predict

    spec, config = model_spec(PRESET), transformer_config()
    par, where = ParallelConfig(**parallel), machine("cpu", "gloo", degree)
    loops = [
        predict(
            Workload(spec, config, SIZE, SIZE, STEPS, 1, cached=True, skipped_steps=frozenset(s)), par, where, FITTED
        ).loop  # fmt: skip
        for s in ((), skipped)
    ]
    return loops[0] / loops[1]


# The performance model on 8 GPUs: FLUX.1-dev at 1,024 px, 28 steps, warm-up 1, skipping every third step from step 3
# (isolated runs) or two in every four (runs of two), as First-Block Cache's decisions tend to fall.
GPU_STEPS = 28
GPU_SKIPS = {"every third step": tuple(range(3, GPU_STEPS, 3)),
             "two in every four": tuple(s for s in range(3, GPU_STEPS) if s % 4 in (1, 2))}  # fmt: skip
GPU_LAYOUTS = {
    "ulysses 8": {"ulysses_degree": 8},
    "pipefusion 8, M = 8": {"pipefusion_degree": 8, "num_patches": 8, "warmup_steps": 1},
    "pipefusion 8, M = 16": {"pipefusion_degree": 8, "num_patches": 16, "warmup_steps": 1},
    "pipefusion 8, M = 32": {"pipefusion_degree": 8, "num_patches": 32, "warmup_steps": 1},
    "pipefusion 2 x ulysses 4, M = 2": {
        "pipefusion_degree": 2,
        "ulysses_degree": 4,
        "num_patches": 2,
        "warmup_steps": 1,
    },
}


def gpu_model() -> dict:
    """The performance model's gains from caching on 8 H100s (NVLink) for each layout and skip pattern."""
    from dataclasses import replace

    from xfuse.config import config_from_dict
    from xfuse.perf.calibration import FITTED
    from xfuse.perf.model import machine, predict
    from xfuse.perf.planner import workload

    where = machine("h100", "nvlink", 8)
    table: dict = {}
    for name, parallel in GPU_LAYOUTS.items():
        generation = {"height": 1024, "width": 1024, "num_inference_steps": GPU_STEPS}
        config = config_from_dict({"model": "flux-dev", "parallel": parallel, "generation": generation})
        work = replace(workload(config), cached=True)
        uncached = predict(work, config.parallel, where, FITTED).loop
        table[name] = {"uncached_s": round(uncached, 3)}
        for pattern, skipped in GPU_SKIPS.items():
            cached = predict(replace(work, skipped_steps=frozenset(skipped)), config.parallel, where, FITTED).loop
            table[name][pattern] = {"seconds": round(cached, 3), "gain": round(uncached / cached, 3),
                                    "ideal": round(GPU_STEPS / (GPU_STEPS - len(skipped)), 3)}  # fmt: skip
    return table


def summarize(degree: int, rows: list[dict], serial: np.ndarray) -> dict:
    """Rank 0's times and images with every rank's trace: one table row per (layout, cached)."""
    table = {}
    for name, parallel in layouts(degree).items():
        base = statistics.median(rows[0][(name, False)]["seconds"])
        for cached in (False, True):
            row = rows[0][(name, cached)]
            median = statistics.median(row["seconds"])
            busiest = max((r[(name, cached)]["trace"] for r in rows), key=lambda t: t["computed_s"] + t["skipped_s"])
            skipped = row["skipped"]
            table[f"{name}, {'first_block 0.5' if cached else 'uncached'}"] = {
                "seconds_median": round(median, 3),
                "seconds_min": round(min(row["seconds"]), 3),
                "seconds_max": round(max(row["seconds"]), 3),
                "skipped": skipped,
                "gain": round(base / median, 3),
                "ideal": round(STEPS / (STEPS - len(skipped)), 3),
                "model_gain": round(predicted_gain(degree, parallel, skipped), 3) if cached else 1.0,
                "psnr_db": round(min(psnr(row["image"], serial), 99.0), 2),
                "busiest_rank": {k: round(v, 3) for k, v in busiest.items()},
                "max_wait_s": round(max(r[(name, cached)]["trace"]["wait_s"] for r in rows), 3),
            }
    return table


def markdown(report: dict) -> str:
    lines = [
        "| layout | run | s per call, median (min–max) | steps skipped | gain | ideal | model's gain | PSNR to serial "
        "(dB) | busiest rank: computed / skipped steps' compute, waits (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for table in report["results"].values():
        for label, r in table.items():
            name, run = label.rsplit(", ", 1)
            b = r["busiest_rank"]
            lines.append(
                f"| {name} | {run} | {r['seconds_median']:.2f} ({r['seconds_min']:.2f}–{r['seconds_max']:.2f}) | "
                f"{len(r['skipped'])} of {STEPS} | {r['gain']:.2f}x | {r['ideal']:.2f}x | {r['model_gain']:.2f}x | "
                f"{r['psnr_db']:.2f} | {b['computed_s']:.2f} / {b['skipped_s']:.2f}, {b['wait_s']:.2f} |"
            )
    patterns = list(GPU_SKIPS)
    lines += [
        "",
        f"The performance model on 8 H100s (NVLink), FLUX.1-dev at 1,024 px, {GPU_STEPS} steps: the gain from caching "
        "(ideal: steps / computed steps)",
        "",
        "| layout | uncached (s) | " + " | ".join(f"skipping {p}" for p in patterns) + " |",
        "|---|---|" + "---|" * len(patterns),
    ]
    for name, row in report["gpu_model"].items():
        cells = [f"{row[p]['seconds']:.2f} s, {row[p]['gain']:.2f}x of {row[p]['ideal']:.2f}x" for p in patterns]
        lines.append(f"| {name} | {row['uncached_s']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--degrees", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--model-only", action="store_true", help="rewrite the 8-GPU model table of the last report")
    parser.add_argument("--stream", action="store_true", help="requests one at a time and as one stream")
    args = parser.parse_args()
    if args.stream:
        streams = {}
        for degree in args.degrees:
            with World(degree, threads_per_rank=1, start_timeout=600) as world:
                streams[degree] = stream_table(degree, world.run_ok(rank_stream, degree, args.repeats, timeout=7200)[0])
            print(json.dumps(streams[degree], indent=1), flush=True)
        report = {"model": f"{PRESET} with {HEADS} heads, {SIZE} px, {STEPS} steps, cache {CACHE}",
                  "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": streams}  # fmt: skip
        with open(os.path.join(args.out, "cache_layouts_stream.json"), "w") as f:
            json.dump(report, f, indent=2)
        return
    if args.model_only:
        with open(os.path.join(args.out, "cache_layouts.json")) as f:
            report = dict(json.load(f), gpu_model=gpu_model())
        write(report, args.out)
        return
    start = time.time()
    with World(1, threads_per_rank=1, start_timeout=600) as world:
        serial = world.run_ok(rank_runs, 1, 1, timeout=3600)[0][("serial", False)]["image"]
    results = {}
    for degree in args.degrees:
        with World(degree, threads_per_rank=1, start_timeout=600) as world:
            rows = world.run_ok(rank_runs, degree, args.repeats, timeout=7200)
        results[degree] = summarize(degree, rows, serial)
        print(json.dumps(results[degree], indent=1), flush=True)
    report = {
        "model": f"{PRESET} with {HEADS} heads, {SIZE} px, {STEPS} steps, cache {CACHE}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "seconds": round(time.time() - start),
        "results": results,
        "gpu_model": gpu_model(),
    }
    write(report, args.out)


def write(report: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cache_layouts.json"), "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(os.path.join(out, "cache_layouts.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
