"""Degree-2 PipeFusion against degree 1 for every family: the whole pipeline call to latents, with each rank's split.

    python benchmarks/bench_families.py [--steps 20] [--size 512] [--repeats 3] [--families small sd3-small]
                                        [--json out.json] [--distance | --per-pass-ablation | --patch-cost]

One preset per family, each 16 blocks of width 256 (FLUX: 4 double + 8 single blocks): HunyuanDiT ``small`` and
PixArt-Σ ``pixart-small`` with classifier-free guidance (transformer batch 2), SD3 ``sd3-small`` with CFG, FLUX
``flux-small`` with its embedded guidance (batch 1), FLUX.2 ``flux2-small`` (2 double + 10 single blocks)
likewise, Qwen-Image ``qwen-image-small`` (12 blocks) with true CFG on the negative prompt " " (batch 2), Z-Image
``z-image-small`` (2 noise refiner + 10 main blocks) with CFG (batch 2). Each
call is the xfuse pipeline class's ``__call__`` with ``output_type="latent"`` (text encoding, preparation and the
denoising loop; no VAE), at degree 1 and at degree 2
(M = 2, warm-up 1, the family's default placement), one torch thread per rank pinned to its own core, in worlds of
real gloo processes set up first and then timed in turns (a round runs degree 1 then degree 2: the machine's drift
falls on both sides of a ratio); every world's first call is in round 1. After the rounds, one traced call per world
gives each rank's split: text encoding (rank 0) or the wait for its broadcast, the loop's compute, its waits at the
warm-up step / the first pipelined step (fill) / the steps between / the last step (drain), and the engine's own time.
The ideal speedup is ``bench_pipefusion.ideal_speedup`` (the warm-up step's batch parts; nothing but the blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_pipefusion import ideal_speedup, pin_to_core, speedups, wait_phases  # noqa: E402  (after the path insert, as run directly)

PROMPT = "a red house by a lake"
# preset -> (the call's family-specific keywords, transformer batch). T5 inputs are cut to 16 tokens for the MMDiTs:
# patch 0 then carries 77 + 16 text tokens (SD3) or 16 (FLUX) beside its image rows.
CALLS: dict[str, tuple[dict, int]] = {
    "small": ({"guidance_scale": 5.0, "use_resolution_binning": False}, 2),
    "pixart-small": ({"guidance_scale": 4.5, "use_resolution_binning": False}, 2),
    "sd3-small": ({"guidance_scale": 7.0, "max_sequence_length": 16}, 2),
    "flux-small": ({"guidance_scale": 3.5, "max_sequence_length": 16}, 1),
    "flux2-small": ({"guidance_scale": 4.0, "max_sequence_length": 16}, 1),
    # true CFG (its default true_cfg_scale 4.0, on with a negative prompt): [negative, positive], the shorter padded
    "qwen-image-small": ({"negative_prompt": " "}, 2),
    # CFG at the pipeline's default scale 5 (ZImagePipeline guides above 0) on the empty negative prompt
    "z-image-small": ({"guidance_scale": 5.0}, 2),
    # LTX-Video through the generic family: CFG at its default scale 3, a 25-frame clip (4 latent frames of 16 x 16
    # tokens at 512 px), the T5 text cut to 16 tokens
    "ltx-small": ({"guidance_scale": 3.0, "num_frames": 25, "max_sequence_length": 16}, 2),
}

_PIPE: dict = {}  # in a rank process: the pipeline setup_rank built, kept between calls
# what ``--patch-cost`` times in each rank, and the ``_PIPE`` total each adds to: the blocks of every pass
# (``Stage.run_segment``) and, within them, the attention and linear kernels
TIMERS = {"blocks": "segment_s", "attention kernels": "sdpa_s", "linear kernels": "linear_s"}


def setup_rank(
    preset: str, degree: int, parallel: dict, per_pass_as_before: bool = False, time_blocks: bool = False
) -> None:
    """On every rank: build the preset (deterministic weights) and wrap it in the family's xfuse pipeline; pin the
    rank to its own core (as a GPU per rank); freeze the start-up heap and keep freed memory as the CLI does.
    ``per_pass_as_before`` (the ablation): every pass computes its adaptive-norm products and joins the text's K/V to
    the image's itself, as before 2026-11-26 (the memo's modules set back to ``nn.Linear`` / ``nn.SiLU``, no
    ``prepare_step``, no text slots). ``time_blocks``: each call also returns this rank's time in
    ``Stage.run_segment`` and, within it, in torch's ``scaled_dot_product_attention`` and ``linear``
    (``--patch-cost``)."""
    import torch
    import torch.distributed as dist

    from xfuse.families.registry import load_pipeline, model_spec
    from xfuse.runtime.heap import freeze_startup_heap, keep_freed_heap

    torch.set_num_threads(1)
    pin_to_core(dist.get_rank(), degree)
    pipe = model_spec(preset).pipeline_class().from_pipe(load_pipeline(preset), parallel=parallel)
    pipe.set_progress_bar_config(disable=True)
    if per_pass_as_before:
        from xfuse.families.common.modulation import MemoLinear, MemoSiLU
        from xfuse.parallel.stale_kv import StaleKVCache

        for module in pipe.stage.modules():
            if isinstance(module, (MemoLinear, MemoSiLU)):
                module.__class__ = torch.nn.Linear if isinstance(module, MemoLinear) else torch.nn.SiLU
        type(pipe.stage).prepare_step = lambda self, cond: None  # (a process of its own: nothing else sees it)
        StaleKVCache.joint = lambda self, *args: None  # type: ignore[method-assign]
    _PIPE.update(pipe=pipe, preset=preset)  # (call_rank zeroes the block and kernel times of each call)
    if time_blocks:
        pipe.stage.run_segment = _timed_blocks(pipe.stage.run_segment)  # (this process's stage only)
        # every attention and linear kernel the blocks call (F.scaled_dot_product_attention and F.linear are looked
        # up per call, by xfuse's processors and by nn.Linear.forward); this is the benchmark's own rank process, so
        # nothing else sees the wrappers
        torch.nn.functional.scaled_dot_product_attention = _timed_kernel(
            torch.nn.functional.scaled_dot_product_attention, "sdpa_s"
        )
        torch.nn.functional.linear = _timed_kernel(torch.nn.functional.linear, "linear_s")
    freeze_startup_heap()
    keep_freed_heap()


def _timed_blocks(run_segment):
    """``Stage.run_segment`` adding its wall time to ``_PIPE["segment_s"]`` (the blocks of a pass: what patching and
    splitting change), the kernels called meanwhile counted as the blocks' (``_timed_kernel``)."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        _PIPE["in_blocks"] = True
        try:
            return run_segment(*args, **kwargs)
        finally:
            _PIPE["in_blocks"] = False
            _PIPE["segment_s"] += time.perf_counter() - start

    return timed


def _timed_kernel(kernel, total: str):
    """``kernel`` adding its wall time to ``_PIPE[total]`` when the blocks call it, not the text encoders, the
    embedding or the output layer."""

    def timed(*args, **kwargs):
        if not _PIPE.get("in_blocks"):
            return kernel(*args, **kwargs)
        start = time.perf_counter()
        try:
            return kernel(*args, **kwargs)
        finally:
            _PIPE[total] += time.perf_counter() - start

    return timed


def call_rank(steps: int, size: int, trace: bool = False) -> dict:
    """On every rank: one pipeline call between two barriers. Returns its wall time, or with ``trace`` this rank's
    split of a traced call (``call_time`` and ``engine_time`` of ``xfuse.parallel.trace``)."""
    import torch
    import torch.distributed as dist

    from xfuse.parallel.costs import speedup_ceiling
    from xfuse.parallel.schedule import batch_parts
    from xfuse.parallel.trace import COMPUTE, LOOP, call_time, engine_time

    pipe, preset = _PIPE["pipe"], _PIPE["preset"]
    pipe.enable_trace(trace)
    _PIPE.update(dict.fromkeys(TIMERS.values(), 0.0))
    dist.barrier()
    start = time.perf_counter()
    pipe(
        prompt=PROMPT,
        height=size,
        width=size,
        num_inference_steps=steps,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **CALLS[preset][0],
    )
    dist.barrier()
    seconds = time.perf_counter() - start
    if not trace:
        return dict(seconds=seconds, **{total: _PIPE[total] for total in TIMERS.values()})
    events = pipe.trace_events()
    pipe.enable_trace(False)
    (loop,) = [e for e in events if e["tid"] == LOOP]
    patch_rows, patch_tokens = loop["args"]["patch_rows"], tuple(loop["args"]["patch_tokens"])
    passes: dict[int, list[float]] = {}  # pipelined steps: patch -> its compute spans (seconds) on this rank
    for e in events:
        if e["tid"] == COMPUTE and e["args"].get("patch") is not None:
            passes.setdefault(e["args"]["patch"], []).append(e["dur"] / 1e6)
    ceiling = speedup_ceiling(
        pipe.plan,
        patch_tokens,
        num_steps=steps,
        warmup_steps=pipe.parallel.warmup_steps,
        batch_parts=batch_parts(CALLS[preset][1], pipe.plan.degree),
    )
    return dict(
        seconds=seconds,
        call=call_time(events),
        loop=engine_time(events),
        patch_rows=patch_rows,
        patch_tokens=patch_tokens,
        patch_compute_s=[sum(passes[p]) / len(passes[p]) for p in sorted(passes)],
        ceiling=ceiling,
    )


def distance_rank(preset: str, steps: int, size: int) -> dict:
    """One process: the preset's pipelined latents (M = 2, warm-up 1) cut by rows and cut by cost, each against
    the serial latents (every step whole); the engine on one rank computes what any degree computes."""
    import copy

    import torch

    from tests.support.mmdit_fns import engine_latents, grid_of, prepare_inputs, tiny
    from xfuse.config import ParallelConfig
    from xfuse.families.registry import model_spec

    torch.set_num_threads(1)
    pipe, spec = tiny(preset), model_spec(preset)
    plan = spec.plan(spec.num_blocks(pipe.transformer.config), ParallelConfig(pipefusion_degree=1))
    stage = spec.stage_class()(copy.deepcopy(pipe.transformer), plan, 0)
    inputs = prepare_inputs(pipe, height=size, width=size, steps=steps, cfg=CALLS[preset][0]["guidance_scale"])
    # (SD3's CFG as the benchmark calls it; this helper would give FLUX true CFG, so FLUX is not measured here)
    text_tokens = inputs["prompt_embeds"].shape[1]

    def latents(num_patches, warmup, lead_tokens):
        grid = grid_of(spec, pipe, size, size, num_patches, lead_tokens)
        out = engine_latents(stage, plan, inputs, copy.deepcopy(pipe.scheduler), grid, warmup)
        return out, [band.num_tokens for band in grid]

    serial, _ = latents(1, steps, 0)
    result = {}
    for name, lead in (("rows", 0), ("cost", text_tokens)):
        out, tokens = latents(2, 1, lead)
        result[name] = dict(tokens=tokens, latent_rel_l2=float((out - serial).norm() / serial.norm()))
    return result


def parallel_config(degree: int, num_patches: int | None = None) -> dict:
    """Degree 1: whole-image passes unless ``num_patches`` (the same patch passes as degree 2, on one rank); degree 2:
    M = 2, warm-up 1."""
    if degree == 1 and num_patches is None:
        return {"pipefusion_degree": 1}
    return {"pipefusion_degree": degree, "num_patches": num_patches or 2, "warmup_steps": 1}


def in_turns(preset: str, setups: dict, steps: int, size: int, repeats: int, traced: bool = False):
    """One world per entry of ``setups`` (name -> (degree, ``setup_rank``'s arguments after the preset and degree)),
    set up first, then ``repeats`` rounds of one call each in turns (the machine's drift falls on every side of a
    ratio; every world's first call is in round 1). Returns (name -> each round's ``call_rank`` result per rank,
    name -> one traced call's per rank, empty unless ``traced``)."""
    import contextlib

    from tests.support.world import World

    runs: dict = {name: [] for name in setups}
    splits: dict = {}
    with contextlib.ExitStack() as stack:
        worlds = {}
        for name, (degree, args) in setups.items():
            worlds[name] = stack.enter_context(World(degree, threads_per_rank=1, start_timeout=600))
            worlds[name].run_ok(setup_rank, preset, degree, *args, timeout=600)
        for _ in range(repeats):
            for name, world in worlds.items():
                runs[name].append(world.run_ok(call_rank, steps, size, timeout=3600))
        for name, world in worlds.items() if traced else ():
            splits[name] = world.run_ok(call_rank, steps, size, True, timeout=3600)
    return runs, splits


def seconds(runs: dict) -> dict:
    """``in_turns``' runs as ``speedups``' rows: rank 0's call times per configuration."""
    return {name: {"times": [ranks[0]["seconds"] for ranks in rounds]} for name, rounds in runs.items()}


def measure(preset: str, steps: int, size: int, repeats: int) -> dict:
    """Degree 1 and degree 2 of one preset in turns, then one traced call per world."""
    runs, splits = in_turns(preset, {d: (d, (parallel_config(d),)) for d in (1, 2)}, steps, size, repeats, traced=True)
    rows = speedups(seconds(runs), 1)
    ideal = ideal_speedup(steps, 2, CALLS[preset][1])
    return dict(
        degree1=rows[1],
        degree2=rows[2],
        speedup=rows[2]["speedup"],
        round_speedups=rows[2]["round_speedups"],
        ideal=ideal,
        of_ideal=rows[2]["speedup"] / ideal,
        ceiling=splits[2][0]["ceiling"],  # the schedule's, with this request's patch cuts
        patch_rows=splits[2][0]["patch_rows"],
        patch_tokens=splits[2][0]["patch_tokens"],
        split=splits,
    )


def per_pass_ablation(presets, steps: int, size: int, repeats: int) -> dict:
    """Degree 1, degree 2 with the per-pass work as before 2026-11-26 (``setup_rank``'s ``per_pass_as_before``) and
    degree 2 as shipped, in turns (a round runs the three): what once-a-step modulation, its prefetch and the text
    slots gain, measured in one session."""
    configs = {"degree 1": (1, False), "degree 2, per pass as before": (2, True), "degree 2": (2, False)}
    setups = {name: (degree, (parallel_config(degree), before)) for name, (degree, before) in configs.items()}
    report: dict = dict(steps=steps, size=size, repeats=repeats, presets={})
    for preset in presets:
        runs, _ = in_turns(preset, setups, steps, size, repeats)
        rows = speedups(seconds(runs), "degree 1")
        report["presets"][preset] = rows
        for name in list(configs)[1:]:
            row = rows[name]
            print(f"{preset}, {name}: {row['median']:.2f} s, {row['speedup']:.2f}x (rounds "
                  f"{min(row['round_speedups']):.2f}–{max(row['round_speedups']):.2f})", flush=True)  # fmt: skip
    return report


def patch_cost(presets, steps: int, size: int, repeats: int) -> dict:
    """Where degree 2 loses against its ideal, in turns (a round runs the three): degree 1 whole-image, degree 1 in
    the degree-2 patches (M = 2, warm-up 1, one rank), and degree 2. Each world's call time and the time in its
    blocks (``Stage.run_segment``: every pass's blocks, not embedding, output layer, scheduler, engine or waits) and
    in the attention and linear kernels within them (``scaled_dot_product_attention``, ``linear``), per rank.
    Patched over whole at degree 1 is what patch passes cost this model on this machine, split into the attention
    kernels and the rest of the blocks; degree 2's blocks per rank over half of degree 1's patched blocks is what
    splitting the blocks costs; the call time beyond its blocks is the waits, embedding, output layer, scheduler and
    engine. An extra pass's time is split into its attention kernels, its linear kernels and the rest: at a tiny
    ``--size`` (64 px: 16 tokens) the rest is the pass's host work (Python, module calls, dispatch) and small
    kernels, and the linears stream their weights for a few tokens, which at 512 px is per-token work, not
    per-pass."""
    configs = {"degree 1": (1, None), "degree 1, patched": (1, 2), "degree 2": (2, None)}
    # (setup_rank's per_pass_as_before=False, time_blocks=True)
    setups = {name: (degree, (parallel_config(degree, m), False, True)) for name, (degree, m) in configs.items()}
    report: dict = dict(steps=steps, size=size, repeats=repeats, presets={})
    for preset in presets:
        runs, _ = in_turns(preset, setups, steps, size, repeats)
        rows = speedups(seconds(runs), "degree 1")
        for name, rr in runs.items():  # each rank's median time in its blocks and in the kernels
            for total in TIMERS.values():
                rows[name][total] = [statistics.median(r[rank][total] for r in rr) for rank in range(len(rr[0]))]
        whole, patched, split = (rows[name]["segment_s"] for name in configs)
        (whole_sdpa, *_), (patched_sdpa, *_) = (rows[name]["sdpa_s"] for name in list(configs)[:2])
        rows["patched_over_whole"] = patched[0] / whole[0]
        rows["attention_patched_over_whole"] = patched_sdpa / whole_sdpa
        rows["rest_patched_over_whole"] = (patched[0] - patched_sdpa) / (whole[0] - whole_sdpa)
        extra_pass = {  # M = 2, warm-up 1: steps - 1 more passes
            name: 1e3 * (rows["degree 1, patched"][total][0] - rows["degree 1"][total][0]) / (steps - 1)
            for name, total in TIMERS.items()
        }
        extra_pass["the rest"] = extra_pass["blocks"] - extra_pass["attention kernels"] - extra_pass["linear kernels"]
        rows["extra_pass_ms"], rows["extra_pass_split_ms"] = extra_pass["blocks"], extra_pass
        rows["split_over_half_patched"] = max(split) / (patched[0] / 2)
        rows["ideal"] = ideal_speedup(steps, 2, CALLS[preset][1])
        report["presets"][preset] = rows
        two = rows["degree 2"]
        print(
            f"{preset}: degree 2 {two['speedup']:.2f}x (rounds {min(two['round_speedups']):.2f}–"
            f"{max(two['round_speedups']):.2f}, {two['speedup'] / rows['ideal']:.3f} of ideal); blocks: patched / "
            f"whole at degree 1 {rows['patched_over_whole']:.3f} (attention kernels "
            f"{rows['attention_patched_over_whole']:.3f}, the rest {rows['rest_patched_over_whole']:.3f}; "
            f"{rows['extra_pass_ms']:.1f} ms an extra pass: "
            f"{', '.join(f'{k} {v:.1f}' for k, v in list(extra_pass.items())[1:])} ms), "
            f"degree 2's slower rank / half of degree 1 patched "
            f"{rows['split_over_half_patched']:.3f}; blocks per rank (s): whole {whole[0]:.2f}, patched "
            f"{patched[0]:.2f}, degree 2 {' / '.join(f'{x:.2f}' for x in split)}",
            flush=True,
        )
    return report


def measure_all(presets, steps: int, size: int, repeats: int, json_path: str | None = None) -> dict:
    """``measure`` for each preset in turn; with ``json_path``, the report so far is written after each."""
    import torch

    report = dict(
        machine=f"{platform.machine()}, {os.cpu_count()} cores, CPU only, torch {torch.__version__}",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        steps=steps,
        size=size,
        repeats=repeats,
        presets={},
    )
    for preset in presets:
        row = measure(preset, steps, size, repeats)
        report["presets"][preset] = row
        print(f"{preset}: {row['speedup']:.2f}x of ideal {row['ideal']:.2f}x ({row['of_ideal']:.3f})", flush=True)
        if json_path:  # after every family: a long run cut short keeps what it measured
            with open(json_path, "w") as fh:
                json.dump(report, fh, indent=2)
    return report


def markdown(report: dict) -> str:
    out = [
        f"Machine: {report['machine']}; {report['date']}; {report['steps']} steps, {report['size']} px, M = 2, "
        f"warm-up 1, {report['repeats']} rounds (median, min–max).",
        "",
        "| family (preset) | degree 1 | degree 2 | speedup (rounds min–max) | ideal | of ideal | patch tokens "
        "(text included) | schedule's ceiling |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for preset, row in report["presets"].items():
        d1, d2 = row["degree1"], row["degree2"]
        cuts = " / ".join(str(tokens) for tokens in row["patch_tokens"])
        out.append(
            f"| {preset} | {d1['median']:.2f} s ({d1['min']:.2f}–{d1['max']:.2f}) | {d2['median']:.2f} s "
            f"({d2['min']:.2f}–{d2['max']:.2f}) | {row['speedup']:.2f}x ({min(row['round_speedups']):.2f}–"
            f"{max(row['round_speedups']):.2f}) | {row['ideal']:.2f}x | **{row['of_ideal']:.3f}** | {cuts} | "
            f"{row['ceiling']:.2f}x |"
        )
    out += [
        "",
        "| traced call | rank | call | text: encode / wait | loop | compute | waits: warm-up / fill / between / "
        "drain | engine per task | pipelined pass per patch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for preset, row in report["presets"].items():
        for degree, per_rank in row["split"].items():
            for rank, split in enumerate(per_rank):
                call, loop = split["call"], split["loop"]
                waits = wait_phases(loop["wait_s_by_step"])
                text = call.get("encode", 0.0) if rank == 0 else call.get("wait for text", 0.0)
                out.append(
                    f"| {preset}, degree {degree} | {rank} | {call['call']:.2f} s | {text:.2f} s "
                    f"({'encode' if rank == 0 else 'wait'}) | {loop['loop_s']:.2f} s | {loop['compute_s']:.2f} s | "
                    f"{' / '.join(f'{w:.2f}' for w in waits)} s | {loop['engine_us_per_task'] / 1e3:.2f} ms | "
                    f"{' / '.join(f'{1e3 * c:.0f} ms' for c in split['patch_compute_s']) or '-'} |"
                )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--families", nargs="+", choices=list(CALLS), default=list(CALLS))
    parser.add_argument("--distance", action="store_true", help="instead: sd3-small's pipelined latents (M = 2, "
                        "warm-up 1) cut by rows and by cost, each against serial")  # fmt: skip
    ablation = "instead: degree 2 with the per-pass work as before 2026-11-26 and as shipped, against degree 1"
    parser.add_argument("--per-pass-ablation", action="store_true", help=ablation)
    patched = (
        "instead: degree 1 whole, degree 1 in degree 2's patches and degree 2, with each rank's time in its blocks "
        "and in their attention and linear kernels"
    )
    parser.add_argument("--patch-cost", action="store_true", help=patched)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.per_pass_ablation or args.patch_cost:
        study = per_pass_ablation if args.per_pass_ablation else patch_cost
        report = study(args.families, args.steps, args.size, args.repeats)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=2)
        return
    if args.distance:
        from tests.support.world import World

        with World(1, threads_per_rank=1, start_timeout=600) as world:
            print(json.dumps(world.run_ok(distance_rank, "sd3-small", args.steps, args.size, timeout=3600)[0]))
        return
    print(markdown(measure_all(args.families, args.steps, args.size, args.repeats, args.json)))


if __name__ == "__main__":
    main()
