"""Every CPU benchmark of docs/performance.md in one command; JSON and Markdown out.

    python benchmarks/run_all.py [--repeats 3] [--steps 20] [--out benchmarks/results]
    python benchmarks/run_all.py --only denoising_loop     # re-measure one section, keep the others

Each timed figure is the median of ``--repeats`` runs with min and max. One torch thread per rank, real gloo
processes, the ``small`` preset (16 blocks, hidden 256) at 512 px with CFG batch 2:

1. degree-1 xfuse vs diffusers' ``HunyuanDiTPipeline`` (whole ``__call__``, same model and settings);
2. denoising loop at degree 2 (folded, linear; M = 2, warm-up 1, the first call included) vs degree 1 (ideal
   20 / (3/4 + 19/2) = 1.95x, ``ideal_speedup``), on ``small`` and on ``small`` with half its blocks (8), the
   degrees timed in turns (``interleaved_loops``: drift falls on both sides of a ratio), with degree 1 also run as
   degree 2's patches (M = 2, one process: what patch passes cost by themselves); and the engine's own time per
   task (everything in the loop but the model's compute and the waits on messages) from one traced run per rank;
3. every family's whole pipeline call to latents at degree 2 against degree 1, in turns, with each rank's traced
   split (``benchmarks/bench_families.py``: ``small``, ``pixart-small``, ``sd3-small``, ``flux-small``);
4. bytes sent per denoising step per rank, folded, balanced and linear, N = 2, 4, 8 (``bytes40``: 40 blocks, hidden 32,
   1024 px; scaled to hidden 1408), from the comm counters;
5. transformer parameter and K/V-buffer bytes per rank for the full-size ``dit-g2`` (from the plan) and the
   peak resident memory of each rank in (2);
6. distance of pipelined output from the serial output (DDIM, M = 2 and 4, warm-up 1).
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

from benchmarks.bench_families import markdown as bench_families_markdown  # noqa: E402
from benchmarks.bench_pipefusion import (  # noqa: E402
    WIDTH_SCALE,
    ideal_speedup,
    interleaved_loops,
    run_world,
    speedups,
    spread,
    wait_phases,
)

SIZE = 512
PATCHES = "1-patches"  # denoising_loop's key of degree 1 run as degree 2's patches (M = 2)


def pipeline_call_rank(repeats: int, steps: int) -> dict:
    """diffusers' pipeline, then xfuse at degree 1 on the same model: whole __call__ wall times."""
    import resource

    import torch

    from xfuse import PipeFusionHunyuanDiTPipeline
    from xfuse.families.hunyuandit.presets import build_tiny_pipeline

    call = dict(
        prompt="a red house by a lake",
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        use_resolution_binning=False,
        output_type="np",
    )
    times = {"diffusers": [], "xfuse": []}
    diffusers_pipe = build_tiny_pipeline("small", seed=0)
    diffusers_pipe.set_progress_bar_config(disable=True)
    for _ in range(repeats):
        start = time.perf_counter()
        diffusers_pipe(**call, generator=torch.Generator().manual_seed(0))
        times["diffusers"].append(time.perf_counter() - start)
    xfuse_pipe = PipeFusionHunyuanDiTPipeline.from_pipe(
        build_tiny_pipeline("small", seed=0), parallel={"pipefusion_degree": 1}
    )
    xfuse_pipe.set_progress_bar_config(disable=True)
    for _ in range(repeats):
        start = time.perf_counter()
        xfuse_pipe(**call, generator=torch.Generator().manual_seed(0))
        times["xfuse"].append(time.perf_counter() - start)
    times["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return times


def distance_rank(steps: int) -> dict:
    """Pipelined vs serial on one rank (the result depends on M and W only, not on the degree)."""
    import torch

    from xfuse.families.hunyuandit.presets import build_tiny_pipeline
    from xfuse.families.hunyuandit.reference import prepare_inputs, request_from_inputs, swap_scheduler
    from xfuse.families.hunyuandit.stage import HunyuanDiTStage
    from xfuse.families.registry import HUNYUANDIT
    from xfuse.parallel.engine import PipeFusionEngine
    from xfuse.parallel.patch_grid import patch_grid
    from xfuse.parallel.stage_plan import stage_plan

    pipe = swap_scheduler(build_tiny_pipeline("small", seed=0), "DDIMScheduler")
    plan = stage_plan(
        pipe.transformer.config.num_layers, 1, "folded", skips=HUNYUANDIT.skip_pairs(pipe.transformer.config.num_layers)
    )
    outputs = {}
    for name, patches, warmup in (("serial", 1, steps), ("M=2", 2, 1), ("M=4", 4, 1)):
        stage = HunyuanDiTStage(copy.deepcopy(pipe.transformer), plan, 0)
        inputs = prepare_inputs(pipe, height=SIZE, width=SIZE, num_inference_steps=steps)
        request = request_from_inputs(stage, inputs, copy.deepcopy(pipe.scheduler))
        latents = PipeFusionEngine(stage, plan, None, pipe_rank=0, group_ranks=[0], warmup_steps=warmup).denoise(
            request, patch_grid(SIZE // 8, SIZE // 8, patches, 2)
        )
        with torch.no_grad():
            image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        outputs[name] = (latents, image.clamp(-1, 1))
    serial_latents, serial_image = outputs.pop("serial")
    result = {}
    for name, (latents, image) in outputs.items():
        mse = float(((image - serial_image) / 2).pow(2).mean())  # images in [-1, 1] -> [0, 1] scale
        result[name] = dict(
            latent_rel_l2=float((latents - serial_latents).norm() / serial_latents.norm()),
            image_psnr_db=float(10 * torch.log10(torch.tensor(1.0 / mse))),
        )
    return result


def degree1_vs_diffusers(args) -> dict:
    from tests.support.world import World

    with World(1, threads_per_rank=1, start_timeout=600) as world:
        calls = world.run_ok(pipeline_call_rank, args.repeats, args.steps, timeout=7200)[0]
    result = dict(
        diffusers=spread(calls["diffusers"]),
        xfuse=spread(calls["xfuse"]),
        ratio=statistics.median(calls["xfuse"]) / statistics.median(calls["diffusers"]),
    )
    print(f"degree-1 xfuse / diffusers: {result['ratio']:.3f}", flush=True)
    return result


def denoising_loop(args) -> dict:
    loops = {}
    for model, layers in (("small", None), ("small, 8 blocks", 8)):
        configs = {  # key -> (degree, setup: preset, placement, M = degree, warm-up 1, size, blocks)
            f"{degree}-{placement}" if degree > 1 else "1": (degree, ("small", placement, degree, 1, SIZE, layers))
            for degree, placement in ((1, "folded"), (2, "folded"), (2, "linear"))
            if not (layers is not None and placement == "linear")  # the half model's figure: default placement
        }
        # Degree 2's passes in one process (M = 2): what patches cost by themselves, apart from the second rank.
        configs[PATCHES] = (1, ("small", "folded", 2, 1, SIZE, layers))
        measured = interleaved_loops(configs, args.repeats, args.steps, trace=True, timeout=7200)
        same_passes = speedups(measured, PATCHES)
        rows = {}
        for key, row in speedups(measured, "1").items():
            rows[key] = dict(
                **row, peak_rss_mib=measured[key]["peak_rss_mib"], engine_time=measured[key]["engine_time"] or [None]
            )
            if key.startswith("2-"):
                rows[key]["over_patches"] = {k: same_passes[key][k] for k in ("speedup", "round_speedups")}
            print(f"loop {model} {key}: {row['median']:.2f} s, {row['speedup']:.2f}x", flush=True)
        loops[model] = rows
    return loops


def bytes_per_step(args) -> dict:
    volume = {}
    for degree in (2, 4, 8):
        for placement in ("folded", "balanced", "linear"):
            results = run_world(degree, "bytes40", degree, placement, degree, 1, 2, 1024, 1)
            per_rank = [{k: v / 2 for k, v in r["counters"]["sent_bytes"].items()} for r in results]  # 2 steps
            volume[f"{degree}-{placement}"] = [
                sum(v * (1 if k == "latent" else WIDTH_SCALE) for k, v in r.items()) for r in per_rank
            ]
    return volume


def dit_g2_memory(args) -> dict:
    from xfuse.config.io import load_config
    from xfuse.plan_report import plan_report

    memory = {}
    for degree in (1, 2, 4, 8):
        r = plan_report(
            load_config(
                "configs/hunyuandit/pp2.yaml",
                [
                    "model=dit-g2",
                    "parallel.placement=balanced",
                    f"parallel.pipefusion_degree={degree}",
                    f"parallel.num_patches={degree}",
                ],
            )
        )
        memory[degree] = dict(param_bytes=r.param_bytes, kv_bytes=r.kv_bytes)
    return memory


def pipelined_distance(args) -> dict:
    from tests.support.world import World

    with World(1, threads_per_rank=1, start_timeout=600) as world:
        return world.run_ok(distance_rank, args.steps, timeout=7200)[0]


def families_degree2(args) -> dict:
    from benchmarks.bench_families import CALLS, measure_all

    return measure_all(list(CALLS), args.steps, SIZE, args.repeats)


SECTIONS = {  # report key -> what measures it, in the order run
    "degree1_vs_diffusers": degree1_vs_diffusers,
    "denoising_loop": denoising_loop,
    "families_degree2": families_degree2,
    "bytes_per_step_hidden1408": bytes_per_step,
    "dit_g2_memory_per_rank": dit_g2_memory,
    "pipelined_distance": pipelined_distance,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--only", nargs="+", choices=list(SECTIONS), help="measure only these sections; keep the others' figures "
        "from the existing cpu.json (the date each section was measured is recorded)",
    )  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, CPU only, torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )
    path = os.path.join(args.out, "cpu.json")
    report = dict(machine=machine, repeats=args.repeats, steps=args.steps)
    if args.only:
        with open(path) as fh:
            report = json.load(fh) | report
    for key, measure in SECTIONS.items():
        if not args.only or key in args.only:
            report[key] = measure(args)
            report.setdefault("measured", {})[key] = time.strftime("%Y-%m-%d")

    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
    with open(os.path.join(args.out, "cpu.md"), "w") as fh:
        fh.write(markdown(report))
    print(markdown(report))


def fmt(row: dict) -> str:
    return f"{row['median']:.2f} s ({row['min']:.2f}–{row['max']:.2f})"


def markdown(r: dict) -> str:
    d1 = r["degree1_vs_diffusers"]
    out = [
        f"Machine: {r['machine']}; {r['repeats']} runs each (median, min–max); {r['steps']} steps.",
        "",
        "| pipeline `__call__`, small, 512 px | wall time |",
        "|---|---|",
        f"| diffusers `HunyuanDiTPipeline` | {fmt(d1['diffusers'])} |",
        f"| xfuse, degree 1 | {fmt(d1['xfuse'])} |",
        f"| ratio xfuse / diffusers | {d1['ratio']:.3f} |",
        "",
        f"| denoising loop | wall time | speedup (ideal {ideal_speedup(r['steps'], 2):.2f}x) (round pairs min–max) "
        "| peak RSS per rank |",
        "|---|---|---|---|",
    ]
    for model, rows in r["denoising_loop"].items():
        for key, row in rows.items():
            rss = " / ".join(f"{m:.0f} MiB" for m in row["peak_rss_mib"])
            where = {"1": "degree 1", PATCHES: "degree 1, M = 2"}.get(key, f"degree {key.replace('-', ', ')}")
            pairs = row.get("round_speedups") or [row["speedup"]]
            speedup = f"{row['speedup']:.2f}x ({min(pairs):.2f}–{max(pairs):.2f})"
            if "over_patches" in row:  # the second rank's own gain: over degree 1 on the same patches
                over = row["over_patches"]
                speedup += f"; {over['speedup']:.2f}x over M = 2 ({min(over['round_speedups']):.2f}–"
                speedup += f"{max(over['round_speedups']):.2f})"
            out.append(f"| {model}, {where} | {fmt(row)} | {speedup} | {rss} |")
    out += [
        "",
        "| engine's own time per task (traced degree-2 run) | rank | tasks | per task | of a task's compute | "
        "compute | waits: warm-up step / first pipelined (fill) / steps between / last (drain) |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, rows in r["denoising_loop"].items():
        for key, row in rows.items():
            for rank, split in enumerate(row["engine_time"]):
                if split is None:
                    continue
                waits = wait_phases(split["wait_s_by_step"])
                out.append(
                    f"| {model}, degree {key.replace('-', ', ')} | {rank} | {split['tasks']} | "
                    f"{split['engine_us_per_task'] / 1e3:.2f} ms | {100 * split['engine_fraction_of_task']:.2f} % | "
                    f"{split['compute_s']:.2f} s | {' / '.join(f'{w:.2f}' for w in waits)} s |"
                )
    out += [
        "",
        "| N | folded MiB/step | balanced MiB/step | linear MiB/step | folded / linear | balanced / linear |",
        "|---|---|---|---|---|---|",
    ]
    for n in (2, 4, 8):
        folded, balanced, linear = (
            sum(r["bytes_per_step_hidden1408"][f"{n}-{p}"]) for p in ("folded", "balanced", "linear")
        )
        out.append(
            f"| {n} | {folded / 2**20:.0f} | {balanced / 2**20:.0f} | {linear / 2**20:.0f} | {folded / linear:.3f} | "
            f"{balanced / linear:.3f} |"
        )
    if "families_degree2" in r:  # every family's whole call to latents (benchmarks/bench_families.py)
        out += ["", bench_families_markdown(r["families_degree2"]).rstrip("\n")]
    out += ["", "| pipelined vs serial (DDIM) | latent relative L2 | image PSNR |", "|---|---|---|"]
    for name, row in r["pipelined_distance"].items():
        out.append(f"| {name}, warm-up 1 | {row['latent_rel_l2']:.4f} | {row['image_psnr_db']:.1f} dB |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
