"""Compiled stages on a GPU: FLUX.1-dev at 1024 px, 20 steps, degree 1, eager against ``compile.mode: regional``
(Inductor), the start of a launch on a warm ``compile.cache_dir``, and the captured stage passes.

Processes on the same random bf16 model (``gpu_degree1.build_on_device``), each timed with CUDA events:

* eager: one warm-up call, then ``repeats`` calls (median, min-max);
* compiled, cold: ``compile.cache_dir`` a fresh folder; the first call (the compile: how long a launch's start
  takes) and then ``repeats`` calls; the graphs made and generated (``StageCompiler``'s counters);
* compiled, warm: a new process on that folder; its first call, and the graphs it generated (0: all from the cache);
* pipelined eager, ``graphs``, ``regional+graphs``: the call pipelined over ``PIPELINED_PATCHES`` patches at one rank
  (warm-up 1: every later step ``PIPELINED_PATCHES`` patch passes), eager and with each stage pass captured as a CUDA
  graph (``xfuse.parallel.pass_graphs``): what M patch passes cost with and without the host issuing every kernel,
  the graphs left uncaptured, and the latents' largest difference to the pipelined eager call's (bf16).

``quick``: the tiny FLUX preset at 64 px, 2 steps, ``aot_eager`` (dynamo's capture without code generation), on the
CPU where there is no GPU, so a test runs the section's processes (``graphs`` over 2 patches; not
``regional+graphs``: Inductor).
"""

from __future__ import annotations

import json
import tempfile
import time

from benchmarks.bench_pipefusion import spread
from benchmarks.gpu_degree1 import PROMPT, QUICK_SIZE, build_on_device, fmt
from benchmarks.own_process import row_in_own_process

STAGES = ("eager", "cold", "warm", "pipelined eager")
GRAPH_STAGES = ("graphs", "regional+graphs")  # after STAGES, those asked for
PIPELINED_PATCHES = 4  # patches of the pipelined stages (a graph per patch kind: 4 traces of the whole model)
QUICK_PATCHES = 2  # quick: the same path, half the traces
STAGE_TIMEOUT_S = 420  # a stage's process: the build, the compile (FLUX.1-dev's blocks on an H100) and the calls


def stage_row(stage: str, cache_dir: str, repeats: int, quick: bool) -> dict:
    """One stage's row (``compiled_stages`` makes each in a process of its own)."""
    import torch

    from xfuse.families.registry import model_spec
    from xfuse.pipelines.stage_compiler import compile_counts

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = "flux-tiny" if quick else "flux-dev"
    side, steps = (QUICK_SIZE, 2) if quick else (1024, 20)
    call = dict(prompt=PROMPT, height=side, width=side, guidance_scale=3.5, num_inference_steps=steps,
                output_type="latent")  # fmt: skip
    pipe = build_on_device(preset, device, dtype)
    section, parallel = None, {"pipefusion_degree": 1}
    if stage in ("cold", "warm"):
        section = {"mode": "regional", "cache_dir": cache_dir,
                   "backend": "aot_eager" if quick else "inductor"}  # fmt: skip
    elif stage != "eager":
        patches = QUICK_PATCHES if quick else PIPELINED_PATCHES
        parallel |= {"num_patches": patches, "warmup_steps": 1}
        call["num_inference_steps"] = max(steps, 3)  # a pass kind's graph runs from its second pass (step 2)
        if stage != "pipelined eager":
            section = {"mode": stage, "backend": "aot_eager" if quick else "inductor"}
    xfuse_pipe = model_spec(preset).pipeline_class().from_pipe(pipe, parallel=parallel, device=str(device),
                                                               compile=section)  # fmt: skip
    xfuse_pipe.set_progress_bar_config(disable=True)

    latents: list = []

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = xfuse_pipe(**call, generator=torch.Generator(device).manual_seed(0))
        if device.type == "cuda":
            torch.cuda.synchronize()
        latents[:] = [out.images]
        return time.perf_counter() - start

    first = timed()
    row = {"preset": preset, "call": {k: v for k, v in call.items() if k != "prompt"}, "first_s": first}
    row |= compile_counts()
    if stage not in ("eager", "cold", "warm"):
        row["patches"] = parallel["num_patches"]
        torch.save(latents[0].float().cpu(), f"{cache_dir}/{stage}.pt")  # compared with the pipelined eager call's
    if stage != "warm":
        row["seconds"] = spread([timed() for _ in range(repeats)])
    return row  # an exception: the error row (``row_in_own_process``)


def compiled_stages(quick: bool, repeats: int, graph_modes: tuple[str, ...] = ("graphs",)) -> dict:
    """The stages and the captured ones of ``graph_modes`` (``GRAPH_STAGES``), each in a process of its own (a
    compile's state must not reach the next stage); the captured stages' latents against the pipelined eager call's.
    ``quick``: no Inductor over a stage (minutes on a CPU)."""
    import torch

    out: dict = {"stages": {}}
    stages = out["stages"]
    with tempfile.TemporaryDirectory() as cache_dir:
        for stage in STAGES + tuple(m for m in graph_modes if not (quick and m == "regional+graphs")):
            start = time.monotonic()
            row = row_in_own_process(stage_row, (stage, cache_dir, repeats, quick), STAGE_TIMEOUT_S)
            stages[stage] = {**row, "stage_seconds": time.monotonic() - start}
            print(f"compiled {stage}: {time.monotonic() - start:.0f} s", flush=True)
            if stage in GRAPH_STAGES and "first_s" in row and "first_s" in stages["pipelined eager"]:
                eager, graphs = (torch.load(f"{cache_dir}/{name}.pt") for name in ("pipelined eager", stage))
                stages[stage]["max_abs_diff_to_eager"] = (graphs - eager).abs().max().item()
    if all("seconds" in stages[s] for s in ("eager", "cold")):
        out["speedup"] = stages["eager"]["seconds"]["median"] / stages["cold"]["seconds"]["median"]
    if all("first_s" in stages[s] for s in ("cold", "warm")):
        out["warm_start_factor"] = stages["cold"]["first_s"] / stages["warm"]["first_s"]
    for stage in GRAPH_STAGES:
        if all("seconds" in stages.get(s, {}) for s in ("pipelined eager", stage)):
            out[f"{stage}_speedup"] = (
                stages["pipelined eager"]["seconds"]["median"] / stages[stage]["seconds"]["median"]
            )
    return out


def markdown(section: dict) -> list[str]:
    stages = section["stages"]
    cold = stages.get("cold", {})
    lines = [f"Compiled stages, `{cold.get('preset', '?')}` at degree 1, {json.dumps(cold.get('call', {}))}; the "
             f"pipelined ones over {stages.get('graphs', {}).get('patches', PIPELINED_PATCHES)} patches (warm-up 1):",
             ""]  # fmt: skip
    lines += ["| stage | first call | steady call | graphs (generated, not captured) | latents to pipelined eager |",
              "|---|---|---|---|---|"]  # fmt: skip
    for name, row in stages.items():
        if "error" in row:
            lines.append(f"| {name} | {row['error'][:200]} | | | |")
            continue
        steady = fmt(row["seconds"]) if "seconds" in row else "-"
        diff = f"{row['max_abs_diff_to_eager']:.3g}" if "max_abs_diff_to_eager" in row else "-"
        lines.append(f"| {name} | {row['first_s']:.2f} s | {steady} | {row['graphs']} ({row['generated']}, "
                     f"{row.get('not_captured', 0)}) | {diff} |")  # fmt: skip
    if "speedup" in section:
        lines.append(f"\nCompiled over eager: {section['speedup']:.2f}x.")
    if "warm_start_factor" in section:
        lines.append(f"A warm launch's first call: {section['warm_start_factor']:.1f}x faster than the cold one's.")
    for stage in GRAPH_STAGES:
        if f"{stage}_speedup" in section:
            lines.append(f"`{stage}` over pipelined eager: {section[f'{stage}_speedup']:.2f}x.")
    return lines
