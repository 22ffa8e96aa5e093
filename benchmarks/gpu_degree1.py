"""Degree 1 against diffusers: the same random model at a family's released shape, diffusers' pipeline call and
xfuse's at one rank, to latents; the time, the peak memory and the synchronisations inside xfuse's denoising loop.

One row per family (HunyuanDiT DiT-g/2, SD3.5-large, FLUX.1-dev at 1024 px, 20 steps; Wan 2.1 14B at 480 x 832 px, 81
frames, 2 steps, as its step is ~7 s on an H100). The pipeline is built with its parameters made on the device
(``accelerate.init_on_device``: FLUX.1's 12 B parameters never pass through the host in float32), cast to bf16 with
the modules diffusers keeps in float32 put back, then:

a. diffusers' call, then xfuse's (``from_pipe`` of that pipeline at ``pipefusion_degree=1``: the same weights), each
   after a one-step warm-up, timed with CUDA events, median of the repeats (min-max); torch's SDPA with its default
   kernel choice (the flash-attn package is not used);
b. the peak memory of each call (``torch.cuda.max_memory_allocated``);
c. one pipelined xfuse call (M = 2, warm-up 1) with the engine's ``denoise`` under
   ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising call, grouped by where it comes from.

``quick``: each family's tiny preset at a few tokens on the CPU (wall clock, no peak memory, no sync report), so a
test runs every row's build and calls where there is no GPU.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
import warnings
from typing import Any

from benchmarks.bench_pipefusion import spread
from benchmarks.own_process import row_in_own_process

PROMPT = "a red house by a lake"


@dataclasses.dataclass(frozen=True)
class Degree1Case:
    name: str  # the released model whose transformer shape the preset has
    preset: str  # xfuse's preset of that shape
    quick_preset: str  # the family's tiny preset, for --quick on the CPU
    call: dict[str, Any]  # the pipeline call (size, frames, guidance), besides prompt, steps and output_type
    steps: int
    max_repeats: int | None = None  # fewer repeats where one call takes long (Wan's 14 B at 81 frames)
    note: str = ""


CASES = (
    Degree1Case(
        "HunyuanDiT v1.2 (DiT-g/2)", "dit-g2", "tiny",
        dict(height=1024, width=1024, guidance_scale=5.0, use_resolution_binning=False), steps=20,
        note="CFG: batch of 2",
    ),
    Degree1Case(
        "SD3.5-large", "sd3.5-large", "sd3-tiny", dict(height=1024, width=1024, guidance_scale=4.5), steps=20,
        note="CFG: batch of 2",
    ),
    Degree1Case(
        "FLUX.1-dev", "flux-dev", "flux-tiny", dict(height=1024, width=1024, guidance_scale=3.5), steps=20,
        note="guidance distilled into the model: batch of 1",
    ),
    Degree1Case(
        "Wan 2.1 T2V 14B", "wan2.1-t2v-14b", "wan-tiny",
        dict(height=480, width=832, num_frames=81, guidance_scale=5.0), steps=2, max_repeats=2,
        note="CFG: two passes a step (diffusers' WanPipeline)",
    ),
)  # fmt: skip
CASE_TIMEOUT_S = 300  # a case's process: the build, 2 x (1 + repeats) calls and the sync report (Wan's: ~90 s, H100)
QUICK_SIZE = 64  # px: 4 x 4 tokens of the tiny presets (VAE 8, patch 2)


def build_on_device(preset: str, device, dtype):
    """The preset's diffusers pipeline with its parameters made on ``device`` (buffers and the scheduler's tables on
    the host until ``.to``), cast to ``dtype`` except what diffusers' ``from_pretrained(torch_dtype=...)`` keeps in
    float32 (``_keep_in_fp32_modules``: Wan's norms, time embedder and modulation)."""
    import torch
    from accelerate import init_on_device
    from diffusers.utils import logging

    from xfuse.families.registry import load_pipeline

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # .to(dtype) warns about the float32 modules, which are put back below
    try:
        with init_on_device(torch.device(device), include_buffers=False):
            pipe = load_pipeline(preset)
        pipe = pipe.to(device, dtype)
    finally:
        logging.set_verbosity(verbosity)
    for module in pipe.components.values():
        keep = getattr(module, "_keep_in_fp32_modules", None) or ()
        if isinstance(module, torch.nn.Module) and keep:
            for name, param in module.named_parameters():
                if any(part in keep for part in name.split(".")):
                    param.data = param.data.float()
    pipe.set_progress_bar_config(disable=True)
    return pipe


class _Clock:
    """CUDA events on a GPU (the device's time, synchronised at the end), the wall clock on the CPU."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"

    def time(self, call) -> tuple[float, float | None]:
        """(seconds, peak GiB or None) of ``call()``."""
        import torch

        if not self.cuda:
            start = time.perf_counter()
            call()
            return time.perf_counter() - start, None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated() / 2**30


def _timed(pipe, call: dict, device, repeats: int) -> dict:
    import torch

    clock = _Clock(device)

    def run(steps: int):
        return lambda: pipe(**{**call, "num_inference_steps": steps}, generator=torch.Generator(device).manual_seed(0))

    run(1)()  # warm-up: kernels chosen, caches filled, the first call's allocations made
    times, peaks = zip(*(clock.time(run(call["num_inference_steps"])) for _ in range(repeats)), strict=True)
    return {"seconds": spread(list(times)), "peak_gib": None if peaks[0] is None else max(peaks)}


def measure_case(case: Degree1Case, device, dtype, repeats: int, quick: bool) -> dict:
    import torch

    from xfuse.families.registry import model_spec

    preset = case.quick_preset if quick else case.preset
    spec = model_spec(preset)
    call = dict(case.call, prompt=PROMPT, num_inference_steps=case.steps, output_type="latent")
    if quick:
        call.update(height=QUICK_SIZE, width=QUICK_SIZE, num_inference_steps=2)
        if "num_frames" in call:
            call["num_frames"] = 1 + spec.vae_temporal_factor  # two latent frames
    repeats = min(repeats, case.max_repeats or repeats)
    row: dict = {"model": case.name, "preset": preset, "call": {k: v for k, v in call.items() if k != "prompt"}}
    row.update(repeats=repeats, note=case.note)
    pipe = build_on_device(preset, device, dtype)
    row["diffusers"] = _timed(pipe, call, device, repeats)
    xfuse_pipe = spec.pipeline_class().from_pipe(pipe, parallel={"pipefusion_degree": 1}, device=str(device))
    xfuse_pipe.set_progress_bar_config(disable=True)
    row["xfuse"] = _timed(xfuse_pipe, call, device, repeats)
    row["xfuse_over_diffusers"] = row["xfuse"]["seconds"]["median"] / row["diffusers"]["seconds"]["median"]
    if torch.device(device).type == "cuda":
        row["sync_debug"] = sync_report(xfuse_pipe, call, device)
    else:
        row["sync_debug"] = {"skipped": "no CUDA: synchronisations are counted by CUDA's sync debug mode"}
    return row


def degree1(quick: bool, repeats: int) -> dict:
    """Every case of ``CASES`` (``quick``: the tiny presets on the CPU), each in a process of its own: a case's model
    (Wan's 14 B is 56 GB in float32 while it is built) must not meet what the previous case's pipelines still hold. A
    case that fails is recorded with its error and the next one runs."""
    import torch

    device = "cpu" if quick and not torch.cuda.is_available() else "cuda"
    dtype = "float32" if device == "cpu" else "bfloat16"
    out: dict = {"device": device, "dtype": dtype, "models": {}}
    for case in CASES:
        start = time.monotonic()
        row = row_in_own_process(case_row, (case.name, repeats, quick), CASE_TIMEOUT_S)
        out["models"][case.name] = {**row, "case_seconds": time.monotonic() - start}
        print(f"degree1 {case.name}: {time.monotonic() - start:.0f} s", flush=True)
    return out


def case_row(name: str, repeats: int, quick: bool) -> dict:
    """The row of the case named ``name`` (``degree1`` makes it in a process of its own)."""
    import torch

    case = next(case for case in CASES if case.name == name)
    device = torch.device("cpu" if quick and not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    return measure_case(case, device, dtype, repeats, quick)  # an exception: the error row (``row_in_own_process``)


def sync_report(xfuse_pipe, call: dict, device) -> dict:
    """One pipelined call (M = 2, warm-up 1) with the denoising loop under sync debug mode "warn"; every
    synchronisation grouped by the innermost diffusers/xfuse frame that made it (and the xfuse frame that called
    that)."""
    import torch

    from xfuse.parallel.engine import PipeFusionEngine

    found: dict[str, int] = {}
    original = PipeFusionEngine.denoise
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack() if "/xfuse/" in f.filename or "/diffusers/" in f.filename]
        inner = frames[-1] if frames else None
        caller = next((f for f in reversed(frames) if "/xfuse/" in f.filename), None)
        where = "?" if inner is None else f"{_short(inner.filename)}:{inner.lineno} {inner.name}"
        if caller is not None and caller is not inner:
            where += f" (from {_short(caller.filename)}:{caller.lineno} {caller.name})"
        found[where] = found.get(where, 0) + 1

    def denoise(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    # Two patches on the one rank: the pipelined path (stale K/V, per-patch scheduler steps); warm-up stays 1.
    xfuse_pipe.parallel = xfuse_pipe.parallel.with_changes(num_patches=2)
    PipeFusionEngine.denoise = denoise
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            xfuse_pipe(**call, generator=torch.Generator(device).manual_seed(0))
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:  # catch_warnings restored showwarning already
        PipeFusionEngine.denoise = original
    return {"steps": call["num_inference_steps"], "patches": 2, "total": sum(found.values()), "by_source": found}


def _short(path: str) -> str:
    for marker in ("/xfuse/", "/diffusers/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return path


def fmt(row: dict) -> str:
    """A ``spread`` of seconds as the reports print it: median (min–max)."""
    return f"{row['median']:.3f} s ({row['min']:.3f}–{row['max']:.3f})"


def markdown(d1: dict) -> list[str]:
    """The section's table (one row per family) and each family's synchronisations."""
    timer = "CUDA events" if d1["device"].startswith("cuda") else "wall clock"
    out = [
        f"Degree 1 against diffusers on the same random model, {d1['dtype']}, pipeline call to latents, each after a "
        f"one-step warm-up ({timer}, median of the repeats, min–max; peak memory of the call):",
        "",
        "| model | call | diffusers | xfuse | xfuse / diffusers | peak GiB diffusers / xfuse | syncs in loop (M = 2) |",
        "|---|---|---|---|---|---|---|",
    ]
    sources = []
    for name, row in d1["models"].items():
        if "error" in row:
            out.append(f"| {name} | | {row['error'][:200]} | | | | |")
            continue
        call = row["call"]
        frames = f", {call['num_frames']} frames" if "num_frames" in call else ""
        shape = f"{call['width']} x {call['height']} px{frames}"
        a, b = row["diffusers"], row["xfuse"]
        peaks = "" if a["peak_gib"] is None else f"{a['peak_gib']:.2f} / {b['peak_gib']:.2f}"
        sync = row.get("sync_debug", {})
        syncs = sync.get("total", sync.get("skipped", ""))
        if "error" in sync:  # the reason, where the report has one, else the error's first words
            syncs = f"not counted: {sync.get('why') or sync['error'][:80]}"
        out.append(
            f"| {name} (`{row['preset']}`) | {shape}, {call['num_inference_steps']} steps, {row['note']}, "
            f"x{row['repeats']} | "
            f"{fmt(a['seconds'])} | {fmt(b['seconds'])} | {row['xfuse_over_diffusers']:.3f} | {peaks} | {syncs} |"
        )
        for where, count in sync.get("by_source", {}).items():
            sources.append(f"- {name}: {count}x {where}")
    if sources:
        out += ["", "Where the synchronisations come from:", "", *sources]
    return out
