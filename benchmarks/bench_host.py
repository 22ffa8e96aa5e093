"""The host's cost of a denoising step at negligible compute, per family: diffusers' own call against xfuse's at
degree 1, eager (issue 74's third measure, taken before any captured pass exists).

    python benchmarks/bench_host.py [--repeats 5] [--families tiny sd3-tiny ...] [--out benchmarks/results]

Writes ``host.json`` and ``host.md`` into ``--out``.

Each family's smallest preset at 4 x 4 tokens (64 px; Wan 2 latent frames), one torch thread: a block's arithmetic is
a few microseconds there, so a step's time is what the host spends issuing it (Python, torch's dispatcher,
allocations). A step's cost is the slope between a call of ``LONG`` and one of ``SHORT`` steps (text encoding, the
preparation and the scheduler's set-up cancel), each the median of ``--repeats`` calls, diffusers' and xfuse's in
turns so the machine's drift falls on both; per block, the step divided by the transformer's blocks and by the
transformer calls diffusers makes a step (2 with true CFG). Beside the times, the aten ops a step issues (a
``TorchDispatchMode`` counting every op that reaches the dispatcher, in one more call of each length): what xfuse
issues that diffusers does not, by op, is where its extra host time goes.

xfuse's call is ``from_pipe(pipe, parallel={"pipefusion_degree": 1})`` of a second build of the preset (the same
seed, the same weights): the PipeFusion engine
with one stage and one patch (``xfuse.parallel.engine``), the call driver and the family's stage. The text is
``TEXT_TOKENS`` long where the pipeline takes ``max_sequence_length`` (HunyuanDiT's 77 + 256 are fixed), so that
attention over the text is no compute to speak of either.

The one-graph column: a third build with ``compile.mode: regional+graphs`` (``xfuse.parallel.pass_graphs``: every
stage pass after a request's first of its kind one graph compiled by Inductor; on a CPU nothing is captured), its
step's slope and, for it and xfuse's eager stage, the time inside the
stage pass alone per block (median over a ``LONG``-step call's passes). On a CPU a compiled graph still issues its
kernels from Python, one call each; on a GPU a captured pass (CUDA graphs) is one launch: this column is the part of
the host's cost that compiling alone removes.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_pipefusion import spread  # noqa: E402  (after the path insert, as run directly)

PROMPT = "a red house by a lake"
SHORT, LONG = 2, 22  # steps of the two calls whose difference is LONG - SHORT steps
TOKEN_ROWS = 4  # token rows and columns of the image (a frame of a video)
PATCHES = 4  # the pipelined call's patches (one rank: the engine's passes, the scheduler stepped per patch)
TEXT_TOKENS = 16  # the prompt's tokens where the pipeline takes ``max_sequence_length``
RECOMPILE_LIMIT = 64  # dynamo's, for the one-graph side: a pass that compiles again in every call still measures
# Ops whose result the host reads: ``.item()``/``bool()``/``int()`` of a tensor, a data-dependent shape, a comparison.
HOST_SYNCS = ("_local_scalar_dense", "nonzero", "equal", "is_nonzero")


def family_call(spec) -> dict:
    """The call of ``spec``'s smallest preset at ``TOKEN_ROWS`` x ``TOKEN_ROWS`` tokens, with the guidance that makes
    its transformer batch [uncond, cond] where the family has it (true CFG with a negative prompt where diffusers'
    pipeline takes ``true_cfg_scale``), to latents."""
    import diffusers

    from xfuse.families.registry import transformer_config

    side = TOKEN_ROWS * spec.latent_scale * spec.token_patch(transformer_config(spec.presets[0]))
    call = dict(prompt=PROMPT, height=side, width=side, output_type="latent")
    accepted = inspect.signature(getattr(diffusers, spec.diffusers_pipeline).__call__).parameters
    if spec.video:
        call["num_frames"] = 1 + spec.vae_temporal_factor  # 2 latent frames
    for flag in ("use_resolution_binning", "clean_caption"):  # binning would make it 1,024 px; cleaning needs ftfy
        if flag in accepted:
            call[flag] = False
    if "max_sequence_length" in accepted:
        call["max_sequence_length"] = TEXT_TOKENS
    if "true_cfg_scale" in accepted:
        call.update(true_cfg_scale=2.0, negative_prompt="blurry")
    elif not spec.distilled_guidance:
        call["guidance_scale"] = 4.5
    return call


def counting_ops(counts: collections.Counter):
    """A ``TorchDispatchMode`` that adds every aten op reaching the dispatcher while it is on to ``counts``, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountingOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    return CountingOps()


def run(runner, call: dict, steps: int):
    """``runner``'s ``call`` of ``steps`` steps, its noise seeded alike on every side and run."""
    import torch

    return runner(**call, num_inference_steps=steps, generator=torch.Generator().manual_seed(0))


def _latents(output):
    """The latents of a pipeline's output (``images`` for an image pipeline, ``frames`` for a video one)."""
    return output.frames if hasattr(output, "frames") else output.images


def ops_per_step(runner, call: dict) -> dict[str, float]:
    """The aten ops, by name, one step of ``runner``'s ``call`` issues: those of a ``LONG``-step call less those of a
    ``SHORT``-step one, over the steps between."""
    counted = {steps: collections.Counter() for steps in (SHORT, LONG)}
    for steps, counts in counted.items():
        with counting_ops(counts):
            run(runner, call, steps)
    names = counted[LONG] | counted[SHORT]
    return {name: (counted[LONG][name] - counted[SHORT][name]) / (LONG - SHORT) for name in names}


def around_passes(pipe, call: dict, around) -> None:
    """One ``LONG``-step call of ``pipe`` with every stage pass (``run_segment`` of the stage its engine drives: the
    family's, or on the one-graph side the ``CapturedStage`` that runs it as graphs) run as ``around(run_segment,
    *args, **kwargs)``."""
    stage = pipe.engine.stage
    run_segment = stage.run_segment
    stage.run_segment = lambda *args, **kwargs: around(run_segment, *args, **kwargs)
    try:
        run(pipe, call, LONG)
    finally:
        stage.run_segment = run_segment


def passes_ops(pipe, call: dict) -> dict[str, int]:
    """The aten ops, by name, of every stage pass of one ``LONG``-step call of ``pipe``."""
    counts: collections.Counter = collections.Counter()

    def counted(run_segment, *args, **kwargs):
        with counting_ops(counts):
            return run_segment(*args, **kwargs)

    around_passes(pipe, call, counted)
    return dict(counts)


def pass_seconds(pipe, call: dict) -> list[float]:
    """The seconds inside each stage pass of one ``LONG``-step call of ``pipe``."""
    seconds: list[float] = []

    def timed(run_segment, *args, **kwargs):
        start = time.perf_counter()
        out = run_segment(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return out

    around_passes(pipe, call, timed)
    return seconds


def host_syncs(ops: dict[str, float]) -> float:
    """Of ``ops``, those whose result the host reads (on a GPU each waits for the device to drain its queue)."""
    return sum(ops.get(name, 0) for name in HOST_SYNCS)


def transformer_calls(pipe, call: dict, steps: int) -> int:
    """How many times diffusers' call of ``steps`` steps calls its transformer(s)."""
    import torch

    calls = [0]

    def count(*_):
        calls[0] += 1

    handles = [module.register_forward_pre_hook(count) for name, module in pipe.components.items()
               if name.startswith("transformer") and isinstance(module, torch.nn.Module)]  # fmt: skip
    try:
        run(pipe, call, steps)
    finally:
        for handle in handles:
            handle.remove()
    return calls[0]


def measure_family(preset: str, repeats: int) -> dict:
    """One family's row: seconds per step of diffusers' and xfuse's call (median, min-max over ``repeats`` slopes),
    the per-block figures and the aten ops a step issues on each side; and xfuse's call with its stage pass compiled
    as one graph: its step, and the time inside a stage pass per block against xfuse's eager one."""

    from xfuse.families.registry import model_spec, transformer_config

    spec = model_spec(preset)
    pipe = spec.build_preset_pipeline(preset)
    pipe.set_progress_bar_config(disable=True)
    # from_pipe takes its pipeline's transformer: xfuse's is a second build of the same seed (the same weights)
    xfuse_pipe = spec.pipeline_class().from_pipe(spec.build_preset_pipeline(preset), parallel={"pipefusion_degree": 1})
    xfuse_pipe.set_progress_bar_config(disable=True)
    call = family_call(spec)
    sides = {"diffusers": pipe, "xfuse": xfuse_pipe}

    def timed(runner, steps: int) -> float:
        start = time.perf_counter()
        run(runner, call, steps)
        return time.perf_counter() - start

    # The first calls (lazy initialisation, caches, the allocator's growth), which also show the two compute the
    # same latents: the comparison is of one computation's host cost.
    latents = [_latents(run(runner, call, SHORT)) for runner in sides.values()]
    max_abs_diff = (latents[0] - latents[1]).abs().max().item()
    times: dict[str, dict[int, list[float]]] = {side: {SHORT: [], LONG: []} for side in sides}
    for _ in range(repeats):
        for steps in (SHORT, LONG):
            for side, runner in sides.items():
                times[side][steps].append(timed(runner, steps))
    per_step = {side: [(long - short) / (LONG - SHORT) for short, long in zip(t[SHORT], t[LONG], strict=True)]
                for side, t in times.items()}  # fmt: skip
    # What a call costs besides its steps (the line's intercept): text encoding, preparation, the engine's set-up.
    per_call = {side: [short - SHORT * step for short, step in zip(t[SHORT], per_step[side], strict=True)]
                for side, t in times.items()}  # fmt: skip
    ops = {side: ops_per_step(runner, call) for side, runner in sides.items()}
    # The one-graph side: a third build, each stage pass after a request's first of its kind one Inductor graph (the
    # first call compiles them: compile.mode regional+graphs). A pass whose guards failed on a new request's objects
    # would compile again in every call: counted (``graphs_per_call``), and the recompile limit raised so that the
    # slope, from which a per-call cost cancels, could still be taken.
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graph_pipe = spec.pipeline_class().from_pipe(spec.build_preset_pipeline(preset), parallel={"pipefusion_degree": 1},
                                                 compile={"mode": "regional+graphs"})  # fmt: skip
    graph_pipe.set_progress_bar_config(disable=True)
    one_graph: dict = {}
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        start = time.perf_counter()
        graph_latents = _latents(run(graph_pipe, call, SHORT))
        one_graph["compile_s"] = time.perf_counter() - start
        compiled = counters["stats"]["unique_graphs"]
        graph_steps: dict[int, list[float]] = {SHORT: [], LONG: []}
        for _ in range(repeats):
            for steps in (SHORT, LONG):
                graph_steps[steps].append(timed(graph_pipe, steps))
        one_graph["graphs_per_call"] = (counters["stats"]["unique_graphs"] - compiled) / (2 * repeats)
        one_graph["step_s"] = spread([(long - short) / (LONG - SHORT) for short, long in
                                      zip(graph_steps[SHORT], graph_steps[LONG], strict=True)])  # fmt: skip
        one_graph["latents_max_abs_diff_to_eager"] = (graph_latents - latents[1]).abs().max().item()
        one_graph["pass_s"] = pass_seconds(graph_pipe, call)
    xfuse_pass_s = pass_seconds(xfuse_pipe, call)
    # The same call pipelined over PATCHES patches (still one rank): the host syncs a step's patches add.
    pipelined = spec.pipeline_class().from_pipe(
        spec.build_preset_pipeline(preset), parallel={"pipefusion_degree": 1, "num_patches": PATCHES, "warmup_steps": 1}
    )
    pipelined.set_progress_bar_config(disable=True)
    syncs_pipelined = host_syncs(ops_per_step(pipelined, call))
    syncs_in_passes = host_syncs(passes_ops(pipelined, call))
    config = transformer_config(preset)
    blocks = spec.num_blocks(config)
    passes = (transformer_calls(pipe, call, LONG) - transformer_calls(pipe, call, SHORT)) / (LONG - SHORT)
    row = {"preset": preset, "family": spec.name, "call": {k: v for k, v in call.items() if k != "prompt"},
           "blocks": blocks, "transformer_calls_per_step": passes, "latents_max_abs_diff": max_abs_diff}  # fmt: skip
    for side in sides:
        row[side] = {"step_s": spread(per_step[side]), "call_s": spread(per_call[side]),
                     "ops_per_step": sum(ops[side].values()), "host_syncs_per_step": host_syncs(ops[side])}  # fmt: skip
        row[side]["block_us"] = 1e6 * row[side]["step_s"]["median"] / (blocks * passes)
    row["xfuse"]["pass_block_us"] = 1e6 * statistics.median(xfuse_pass_s) / blocks
    if "pass_s" in one_graph:
        one_graph["pass_block_us"] = 1e6 * statistics.median(one_graph.pop("pass_s")) / blocks
        one_graph["over_xfuse_pass"] = one_graph["pass_block_us"] / row["xfuse"]["pass_block_us"]
    row["one_graph"] = one_graph
    row["xfuse"]["host_syncs_per_step_pipelined"] = syncs_pipelined
    row["xfuse"]["host_syncs_in_stage_passes"] = syncs_in_passes
    row["xfuse_over_diffusers"] = row["xfuse"]["step_s"]["median"] / row["diffusers"]["step_s"]["median"]
    extra = {
        name: ops["xfuse"].get(name, 0) - ops["diffusers"].get(name, 0) for name in ops["xfuse"] | ops["diffusers"]
    }
    row["extra_ops_per_step"] = dict(sorted(((k, v) for k, v in extra.items() if v), key=lambda kv: -abs(kv[1])))
    return row


def one_graph_cells(row: dict) -> str:
    """The one-graph columns of ``row``: its step, graphs compiled per call past the first, the stage pass's µs per
    block beside xfuse's eager, and their ratio."""
    g, x = row["one_graph"], row["xfuse"]
    step = g["step_s"]
    if g["graphs_per_call"]:  # each call compiles again: its slope holds compile times, not a step's cost
        steps = "- (compiles in every call)"
    else:
        steps = f"{1e3 * step['median']:.2f} ({1e3 * step['min']:.2f}-{1e3 * step['max']:.2f})"
    return (f"{steps} | "
            f"{g['graphs_per_call']:g} | {x['pass_block_us']:.0f}, {g['pass_block_us']:.0f} | "
            f"{g['over_xfuse_pass']:.2f}x")  # fmt: skip


def markdown(report: dict) -> str:
    lines = [f"Host cost per denoising step at {TOKEN_ROWS} x {TOKEN_ROWS} tokens, one torch thread, "
             f"{report['machine']}; slope of {LONG}- and {SHORT}-step calls, median (min-max) of "
             f"{report['repeats']}:", "",
             "| preset | blocks | diffusers ms/step | xfuse ms/step | xfuse / diffusers | µs per block pass "
             "(diffusers, xfuse) | ms per call besides its steps (diffusers, xfuse) | aten ops/step (diffusers, "
             "xfuse) | xfuse's extra ops/step (most) | latents, max abs diff | host syncs/step (diffusers, xfuse, "
             f"xfuse over {PATCHES} patches) | host syncs in xfuse's stage passes | one graph ms/step | graphs "
             "compiled per later call | µs per block inside a stage pass (xfuse eager, one graph) | one graph / eager "
             "pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in report["rows"]:
        d, x = row["diffusers"], row["xfuse"]

        def ms(s: dict) -> str:
            return f"{1e3 * s['median']:.2f} ({1e3 * s['min']:.2f}-{1e3 * s['max']:.2f})"

        extra = ", ".join(f"{name} {count:+.0f}" for name, count in list(row["extra_ops_per_step"].items())[:4])
        lines.append(f"| {row['preset']} | {row['blocks']} | {ms(d['step_s'])} | {ms(x['step_s'])} | "
                     f"{row['xfuse_over_diffusers']:.2f}x | {d['block_us']:.0f}, {x['block_us']:.0f} | "
                     f"{1e3 * d['call_s']['median']:.1f}, {1e3 * x['call_s']['median']:.1f} | "
                     f"{d['ops_per_step']:.0f}, {x['ops_per_step']:.0f} | {extra} | "
                     f"{row['latents_max_abs_diff']:.1e} | {d['host_syncs_per_step']:g}, {x['host_syncs_per_step']:g}, "
                     f"{x['host_syncs_per_step_pipelined']:g} | {x['host_syncs_in_stage_passes']:g} | "
                     + one_graph_cells(row) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--families", nargs="+", help="presets (default: each family's smallest)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for host.json and host.md")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    from xfuse.families.registry import FAMILIES

    torch.set_num_threads(1)
    presets = args.families or [spec.presets[0] for spec in FAMILIES]
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "repeats": args.repeats, "rows": []}  # fmt: skip
    for preset in presets:
        row = measure_family(preset, args.repeats)
        report["rows"].append(row)
        diffusers_ms, xfuse_ms = (1e3 * row[side]["step_s"]["median"] for side in ("diffusers", "xfuse"))
        print(
            f"{preset}: diffusers {diffusers_ms:.2f} ms/step, xfuse {xfuse_ms:.2f} ({row['xfuse_over_diffusers']:.2f}x)"
        )
    medians = [row["xfuse_over_diffusers"] for row in report["rows"]]
    text = markdown(report) + (f"\n\nxfuse over diffusers per step: median {statistics.median(medians):.2f}x over "
                               f"{len(medians)} families\n")  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    with open(os.path.join(args.out, "host.md"), "w") as fh:
        fh.write(text)
    print(text)


if __name__ == "__main__":
    main()
