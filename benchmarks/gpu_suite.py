"""Every GPU measurement of docs/performance.md in one command (one device call); JSON and Markdown out.

    python benchmarks/gpu_suite.py [--out benchmarks/results] [--repeats 5] [--quick] [--only SECTION,...]
    python benchmarks/gpu_suite.py --merge A.json B.json [--out DIR]   # join the reports of split runs

Sections (``--only`` names them: patch_cost = p, degree1 = a-c, cpu_speedups = d, nccl_one_gpu = e, compiled = f); a
GPU section without a CUDA device is recorded as skipped, with the reason:

p. a patch's cost (``benchmarks/gpu_patch_cost.py``): per family at its released transformer shape (HunyuanDiT
   DiT-g/2, SD3.5-large, FLUX.1-dev, Qwen-Image, FLUX.2-dev at 1024 px; Wan 2.1 14B at 480 x 832 px, 81 frames),
   random bf16 weights built on the GPU, a pipelined step's M = 2, 4, 8 patch passes (each over the stale K/V of the
   rest) against one whole-image pass, per block and for a stage of four, and a Ulysses rank's share at U = 2, 4, 8
   (1/U of the tokens, attention with 1/U of the heads over all of them); first, as the figures the performance
   model most needs.

a. degree 1 against diffusers (``benchmarks/gpu_degree1.py``): HunyuanDiT ``dit-g2``, SD3.5-large, FLUX.1-dev at
   1024 px, 20 steps, and Wan 2.1 14B at 480 x 832 px, 81 frames, 2 steps; the same random bf16 model, diffusers'
   call then xfuse's at one rank, to latents, CUDA events, median of ``--repeats`` (min-max), each family in a
   process of its own; torch's SDPA with its default kernel choice (the flash-attn package is not used).
b. peak GPU memory of each of those calls (``torch.cuda.max_memory_allocated``).
c. synchronisations in the loop: one pipelined xfuse call (M = 2, warm-up 1) with the engine's ``denoise`` under
   ``torch.cuda.set_sync_debug_mode("warn")``; every synchronising call is listed with where it comes from.
d. xfuse's CPU speedups at degrees 2, 4 and 8 (one torch thread per rank, gloo; ``small``, 512 px, 20 steps, CFG,
   M = N, warm-up 1, first call included).
e. multi-rank NCCL on the one GPU: each rank gets its own ``NCCL_HOSTID`` (and ``NCCL_P2P_DISABLE=1
   NCCL_SHM_DISABLE=1``, sockets on loopback), so NCCL may treat the ranks as separate hosts. First NCCL alone
   (``benchmarks/gpu_nccl_probe.py``: collectives and batched P2P without xfuse), then xfuse. If it starts: exact mode
   at degrees 2 and 4 against degree 1 (the PNGs compared), a killed rank and a stalled rank (every rank's exit code,
   the time to the end, the reports); if not, what NCCL said. With the first degree also the text encoder's
   placements on CUDA (``parallel.text_encoder``): FLUX.2 [klein]'s tiny Qwen3 split over the ranks and offloaded,
   each against it kept on rank 0, and FLUX.2 [klein] at that degree with it on rank 0 (the second and third GPU
   runs' stop), again with ``CUDA_MODULE_LOADING=EAGER``; FLUX.2 [klein] at every later degree. Last, NCCL alone with
   batches grouped unlike on the two ranks (``gpu_nccl_probe.py --grouped-unlike``). Every launch sets
   ``comm.host_timeout_s`` well inside its limit; one that reaches the limit all the same gets SIGUSR1 first, so that
   its output ends with every rank's stacks.
f. compiled stages (``benchmarks/gpu_compiled.py``): FLUX.1-dev at 1024 px, 20 steps, degree 1, eager against
   ``compile.mode: regional`` (Inductor), the cold compile and a warm ``compile.cache_dir``'s start, then pipelined
   over 4 patches eager against ``compile.mode: graphs`` (``--graph-modes`` adds ``regional+graphs``), each in a
   process of its own (last, so that a cut-off run keeps the rest).

``--quick`` shrinks every section (tiny model, 256 px, 4 steps, degrees 1-2) so a test can run the suite's CPU parts.

``gpu.json`` and ``gpu.md`` are rewritten after every section, so a run stopped at the device call's time limit keeps
the sections it finished. On the lent GPU machine (its python3 has torch, transformers, accelerate, safetensors; not
diffusers), after ``bash benchmarks/device_wheels.sh`` here, one call with ``carry: [".whl"]``::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site &&
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --out $OUT

(about 9 minutes before the captured stages were added to the compiled section: the patch cost ~1-2 min, the other GPU
sections ~2 min each, the CPU speedups ~3; the pipelined and ``graphs`` stages add a FLUX.1-dev build, a trace of each
patch kind and their calls, not measured yet: ``--only`` splits it over two calls, ``--only compiled`` second, and
``--merge`` joins what they wrote). ``--quick`` runs the patch cost's tiny shapes on the CPU
when there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_pipefusion import ideal_speedup, interleaved_loops, speedups  # noqa: E402 (no torch at import time)
from benchmarks.gpu_compiled import GRAPH_STAGES, compiled_stages  # noqa: E402
from benchmarks.gpu_compiled import markdown as compiled_markdown  # noqa: E402
from benchmarks.gpu_degree1 import degree1, fmt  # noqa: E402
from benchmarks.gpu_degree1 import markdown as degree1_markdown  # noqa: E402
from benchmarks.gpu_patch_cost import markdown as patch_cost_markdown  # noqa: E402
from benchmarks.gpu_patch_cost import patch_cost  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "a red house by a lake"

SECTIONS = ("patch_cost", "degree1", "cpu_speedups", "nccl_one_gpu", "compiled")  # the order a full run takes


def no_cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "skipped: no CUDA device (torch.cuda.is_available() is False)"


# ---------------------------------------------------------------------------------------------- (d)
def cpu_speedups(preset: str, size: int, steps: int, degrees: tuple[int, ...], repeats: int) -> dict:
    configs = {degree: (degree, (preset, "folded", degree, 1, size)) for degree in degrees}  # M = N, warm-up 1
    rows = speedups(interleaved_loops(configs, repeats, steps), degrees[0])
    for degree, row in rows.items():
        row["ideal"] = ideal_speedup(steps, degree)
    return {"model": preset, "size": size, "steps": steps, "threads_per_rank": 1, "degrees": rows}


# ---------------------------------------------------------------------------------------------- (e)
NCCL_ONE_GPU_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_DEBUG": "WARN",  # NCCL's own reason, if it refuses, in the captured output
}
EXACT_COMM_TIMEOUT_S = 30  # the exact runs' comm.timeout_s: a refusing NCCL is reported well inside LAUNCH_TIMEOUT_S
# ... and their comm.host_timeout_s: a host stopped outside its waits (FLUX.2 [klein] at degree 2 on one H200, the
# second GPU run) is named by xfuse well inside LAUNCH_TIMEOUT_S too
EXACT_HOST_TIMEOUT_S = 20
EXACT = [f"comm.timeout_s={EXACT_COMM_TIMEOUT_S}", f"comm.host_timeout_s={EXACT_HOST_TIMEOUT_S}"]


PROBE_TIMEOUT_S = 90  # the probe's four steps take seconds; its groups' own timeout is 30 s
# one tiny generate on CUDA: start-up, NCCL set-up and a few steps (~20 s); a stop at an exchange ends at
# EXACT_COMM_TIMEOUT_S, so past this the launch is stuck where no deadline reaches (and must not eat the call)
LAUNCH_TIMEOUT_S = 120


def rank_entry(argv: list[str]) -> int:
    """Under torchrun: make this rank look like its own host to NCCL, put every rank on GPU 0, run ``xfuse``."""
    local_rank = os.environ.get("LOCAL_RANK", "0")
    os.environ["NCCL_HOSTID"] = f"xfuse-suite-host-{local_rank}"
    os.environ["LOCAL_RANK"] = "0"  # xfuse picks cuda:LOCAL_RANK; the machine has one GPU
    from xfuse.cli import main

    return main(argv)


def _generate(degree: int, out_png: str, steps: int, extra: list[str], env: dict, timeout: float):
    args = ["generate", "--config", os.path.join(ROOT, "configs/tiny/pp2.yaml"), "--output", out_png]
    sets = [
        f"parallel.pipefusion_degree={degree}",
        f"parallel.num_patches={degree}",
        f"generation.num_inference_steps={steps}",
        "runtime.device=cuda",
        *extra,
    ]
    for s in sets:
        args += ["--set", s]
    if degree == 1:
        cmd = [sys.executable, "-m", "xfuse", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={degree}"]
        cmd += [os.path.abspath(__file__), "--rank-entry", *args]
    start = time.monotonic()
    print(f"nccl_one_gpu: degree {degree}, {' '.join(extra)}", flush=True)  # a call cut off at its limit shows how far
    # stdout and stderr in one stream: NCCL_DEBUG writes to stdout, xfuse's reports to stderr
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **env}) as proc:  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, time.monotonic() - start, out
        except subprocess.TimeoutExpired:
            out = _stacks_then_kill(proc)
            return "timeout", time.monotonic() - start, out


def _stacks_then_kill(proc: subprocess.Popen) -> str:
    """A launch past its limit: SIGUSR1 to each of its ranks in turn (torchrun's children, or the process itself at
    degree 1: ``xfuse`` writes every thread's stack on it and goes on, ``register_stack_dump``), then the whole launch
    killed; the output, ending with the xfuse frames of those stacks."""
    children = f"/proc/{proc.pid}/task/{proc.pid}/children"
    ranks = [int(pid) for pid in open(children).read().split()] if os.path.exists(children) else []
    for pid in ranks or [proc.pid]:  # one at a time: ranks writing together interleave their lines
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)
    proc.kill()  # torchrun: its agent dies, and the ranks' pipes close behind them
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate()
    frames = [line.strip() for line in out.splitlines() if "/xfuse/" in line and line.strip().startswith("File")]
    return out + "\nxfuse frames of the stacks at the limit:\n" + "\n".join(frames[:40])


def _report_lines(stderr: str) -> list[str]:
    keep = ("failed:", "stopped", "terminated by", "first failure", "who waits", "CommTimeout", "PeerLost", "NCCL WARN",
            "NCCL error")  # fmt: skip
    return [line.strip() for line in stderr.splitlines() if any(k in line for k in keep)][:20]


def nccl_alone(env: dict, *args: str, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """``benchmarks/gpu_nccl_probe.py`` on two ranks: NCCL's own collectives and batched P2P, without xfuse (with
    ``--grouped-unlike``: its batches grouped unlike on the two ranks)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [os.path.join(ROOT, "benchmarks", "gpu_nccl_probe.py"), *args]
    print(f"nccl_one_gpu: NCCL alone (benchmarks/gpu_nccl_probe.py {' '.join(args)})", flush=True)
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **env}, timeout=timeout)  # fmt: skip
        rc, text = out.returncode, out.stdout
    except subprocess.TimeoutExpired as exc:
        rc, text = "timeout", (exc.stdout or b"").decode(errors="replace")
    steps = [line.strip() for line in text.splitlines() if line.startswith("rank ")]
    return {"rc": rc, "steps": steps, "ok": rc == 0 and bool(steps) and all(line.endswith(" ok") for line in steps)}


def nccl_one_gpu(steps: int, degrees: tuple[int, ...], progress: Callable[[dict], None] = lambda partial: None) -> dict:
    """The section (e in the module docstring); ``progress(result so far)`` after every launch, so that a device call
    cut off at its time limit keeps what finished."""
    env = dict(NCCL_ONE_GPU_ENV)
    result: dict = {"env": env, "note": "every rank on GPU 0, NCCL_HOSTID per rank"}
    result["nccl_alone"] = nccl_alone(env)
    progress(result)
    with tempfile.TemporaryDirectory() as tmp:
        exact = [f"parallel.warmup_steps={steps}", *EXACT]
        rc, wall, err = _generate(1, f"{tmp}/d1.png", steps, exact, env, LAUNCH_TIMEOUT_S)
        if rc != 0:
            return {**result, "error": f"degree 1 on CUDA failed (rc {rc}): {err[-2000:]}"}
        for degree in degrees:
            rc, wall, err = _generate(degree, f"{tmp}/d{degree}.png", steps, exact, env, LAUNCH_TIMEOUT_S)
            if rc != 0:
                result[f"exact_pp{degree}"] = {"rc": rc, "started": False, "nccl_said": err[-3000:]}
                progress(result)
                return result  # NCCL refused: nothing else can run over it
            diff = max_pixel_diff(f"{tmp}/d{degree}.png", f"{tmp}/d1.png")
            result[f"exact_pp{degree}"] = {
                "rc": rc,
                "seconds": wall,
                "max_abs_pixel_diff_vs_degree1": diff,
                "identical": diff == 0,
            }
            progress(result)
            if degree == degrees[0]:
                result.update(text_encoder_placements(tmp, steps, degree, env))
            else:  # the joint family (hidden and text stream per patch) at this degree too
                result[f"flux2_pp{degree}"] = flux2_at(tmp, steps, degree, env)
            progress(result)
            for fault, timeout_s in (("kill", 30), ("stall", 5)):
                faulty = {**env, "XFUSE_FAULT": f"{fault}:1:2"}
                rc, wall, err = _generate(
                    degree, f"{tmp}/never.png", 6, [f"comm.timeout_s={timeout_s}"], faulty, timeout_s + 120
                )
                result[f"{fault}_pp{degree}"] = {
                    "rc": rc,
                    "comm.timeout_s": timeout_s,
                    "seconds_to_exit": wall,
                    "reports": _report_lines(err),
                }
                progress(result)
    # last, as it may take its whole time limit: NCCL alone with the batches xfuse posted before one per peer
    result["nccl_grouped_unlike"] = nccl_alone(env, "--grouped-unlike", timeout=GROUPED_UNLIKE_TIMEOUT_S)
    progress(result)
    return result


GROUPED_UNLIKE_TIMEOUT_S = 50  # the probe's groups time out after 30 s; a stop past that is NCCL's kernel not ending
FLUX2 = ["model=flux2-klein-tiny", "parallel.placement=linear"]  # the joint family of the NCCL rows


def max_pixel_diff(png: str, reference: str) -> int:
    """The largest difference of one channel of one pixel between two PNGs of one size (0-255)."""
    import numpy as np
    from PIL import Image

    image, ref = (np.asarray(Image.open(path), dtype=np.int16) for path in (png, reference))
    return int(np.abs(image - ref).max())


def flux2_at(tmp: str, steps: int, degree: int, env: dict) -> dict:
    """FLUX.2 [klein] exact at ``degree``, against the placements' degree-1 run (``text_rank0``)."""
    png = f"{tmp}/flux2_pp{degree}.png"
    sets = [*FLUX2, "parallel.text_encoder=rank0", f"parallel.warmup_steps={steps}", *EXACT]
    rc, wall, out = _generate(degree, png, steps, sets, env, LAUNCH_TIMEOUT_S)
    if rc != 0:
        return {"rc": rc, "output": out[-2000:]}
    row: dict = {"rc": rc, "seconds": wall}
    if os.path.exists(f"{tmp}/text_rank0.png"):
        row["max_abs_pixel_diff_vs_degree1"] = max_pixel_diff(png, f"{tmp}/text_rank0.png")
    return row


def text_encoder_placements(tmp: str, steps: int, degree: int, env: dict) -> dict:
    """``parallel.text_encoder`` over NCCL and CUDA: FLUX.2 [klein]'s Qwen3 split over ``degree`` ranks and offloaded
    (accelerate's ``cpu_offload``) at degree 1, each against the text encoder kept on rank 0 (the PNGs compared)."""
    sets = [*FLUX2, f"parallel.warmup_steps={steps}", *EXACT]
    # FLUX.2 [klein] at degree with its text encoder on rank 0 first: the second and third GPU runs stopped there (one
    # rank's device queue does not drain while its peer's matching operation is enqueued: docs/performance/gpu.md);
    # then the same with CUDA's modules loaded eagerly (a lazily loaded kernel's first launch waits for the context's
    # queue, which holds the receives posted ahead), and the text encoder split only once rank 0's run finished; and
    # the tiny model of the exact rows in the same linear placement (theirs is folded)
    rank0, eager, split = (f"text_rank0_pp{degree}", f"text_rank0_eager_modules_pp{degree}", f"text_split_pp{degree}")
    runs = {"text_rank0": (1, ["parallel.text_encoder=rank0"], {}),
            "text_offload": (1, ["parallel.text_encoder=offload"], {}),
            rank0: (degree, ["parallel.text_encoder=rank0"], {}),
            eager: (degree, ["parallel.text_encoder=rank0"], {"CUDA_MODULE_LOADING": "EAGER"}),
            split: (degree, ["parallel.text_encoder=split"], {}),
            f"tiny_linear_pp{degree}": (degree, ["model=tiny"], {})}  # fmt: skip
    rows: dict = {}
    for name, (ranks, extra, more_env) in runs.items():
        if name == split and rows[rank0]["rc"] != 0:  # the same stop again would only spend the device's time
            rows[name] = {"skipped": f"{rank0} did not finish"}
            continue
        png = f"{tmp}/{name}.png"
        rc, wall, out = _generate(ranks, png, steps, [*sets, *extra], {**env, **more_env}, LAUNCH_TIMEOUT_S)
        rows[name] = {"rc": rc, "seconds": wall} if rc == 0 else {"rc": rc, "output": out[-2000:]}
        rows[name]["peaks"] = [line.strip() for line in out.splitlines() if "peak" in line][:8]  # each rank's memory
        if rc == 0 and name.startswith("text_") and name != "text_rank0" and rows["text_rank0"]["rc"] == 0:
            rows[name]["max_abs_pixel_diff_vs_rank0"] = max_pixel_diff(png, f"{tmp}/text_rank0.png")
        if rc == 0 and name.startswith("tiny_"):  # the exact rows' degree 1 (folded there, linear here)
            rows[name]["max_abs_pixel_diff_vs_degree1"] = max_pixel_diff(png, f"{tmp}/d1.png")
    return rows


# ---------------------------------------------------------------------------------------------- report
def markdown(r: dict) -> str:
    """The report as docs/performance.md's GPU section shows it; sections a run did not take (``--only``) are left
    out."""
    out = [f"Machine: {r['machine']}.", ""]
    cost = r.get("patch_cost")
    if cost is not None and "families" not in cost:
        out += [f"Patch cost: {cost.get('skipped') or cost.get('error')}", ""]
    elif cost is not None:
        out += [*patch_cost_markdown(cost), ""]
    d1 = r.get("degree1")
    if d1 is not None and "models" not in d1:
        out += [f"Degree-1 loop vs diffusers: {d1.get('skipped') or d1.get('error')}", ""]
    elif d1 is not None:
        out += [*degree1_markdown(d1), ""]
    cpu = r.get("cpu_speedups")
    if cpu is not None and "degrees" not in cpu:
        out += [f"CPU speedups: {cpu.get('error')}", ""]
    elif cpu is not None:
        out += [
            f"CPU, `{cpu['model']}`, {cpu['size']} px, {cpu['steps']} steps, one thread per rank, first call included:",
            "",
            "| degree | denoising loop | speedup | ideal |",
            "|---|---|---|---|",
        ]
        for degree, row in cpu["degrees"].items():
            out.append(f"| {degree} | {fmt(row)} | {row['speedup']:.2f}x | {row['ideal']:.2f}x |")
        out.append("")
    compiled = r.get("compiled")
    if compiled is not None and "stages" not in compiled:
        out += [f"Compiled stages: {compiled.get('skipped') or compiled.get('error')}", ""]
    elif compiled is not None:
        out += [*compiled_markdown(compiled), ""]
    nccl = r.get("nccl_one_gpu")
    if nccl is not None:
        out += ["NCCL, several ranks on one GPU (`NCCL_HOSTID` per rank):", ""]
        if "skipped" in nccl or "error" in nccl:
            out.append(nccl.get("skipped") or nccl.get("error"))
        else:
            out += [f"Outcome: {nccl_outcome(nccl)}", ""]
            for key, row in nccl.items():
                if key not in ("env", "note", "section_seconds", "diagnosis"):
                    out.append(f"- {key}: " + json.dumps(row)[:600])
            if "diagnosis" in nccl:  # what a later call found out about this outcome, in full
                out += ["", f"Diagnosis: {nccl['diagnosis']}"]
    return "\n".join(out).rstrip() + "\n"


def nccl_outcome(nccl: dict) -> str:
    """The NCCL section in one sentence: ran and matched, ran and differed, or refused (with NCCL's words)."""
    exact = {key: row for key, row in nccl.items() if key.startswith("exact_pp")}
    refused = {key: row for key, row in exact.items() if row.get("rc") != 0}
    if refused:
        key, row = next(iter(refused.items()))
        text = json.dumps(nccl).replace("\\n", "\n")  # every row's captured output and reports
        said = [line for line in text.splitlines() if any(k in line for k in ("NCCL error", "NCCL WARN", "ncclSystem"))]
        words = said[0].split("raised the following async exception: ")[-1].split('"')[0].strip()[:300] if said else ""
        alone = nccl.get("nccl_alone")
        who = "" if alone is None else "; NCCL alone " + ("ran every probe step" if alone["ok"] else "failed too")
        return f"refused: {key} ended with rc {row['rc']}" + (f"; NCCL said: {words}" if words else "") + who
    if not exact:
        return "nothing ran"
    if all(row.get("identical") for row in exact.values()):
        return f"ran and matched degree 1 exactly ({', '.join(exact)})"
    return "ran, but differed from degree 1: " + ", ".join(
        f"{key} max |pixel difference| {row.get('max_abs_pixel_diff_vs_degree1')}" for key, row in exact.items()
    )


def write(report: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu.json"), "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    with open(os.path.join(out_dir, "gpu.md"), "w") as fh:
        fh.write(markdown(report))


def merge(paths: list[str]) -> dict:
    """Reports of split runs (``--only``) joined: a later file's sections replace an earlier one's; all must come
    from the same machine."""
    report: dict = {}
    for path in paths:
        with open(path) as fh:
            part = json.load(fh)
        if report and part["machine"] != report["machine"]:
            raise SystemExit(f"--merge: {path} is from {part['machine']!r}, not {report['machine']!r}")
        report.update(part)
    return report


def main(argv=None) -> None:
    if argv is None and "--rank-entry" in sys.argv:
        rest = sys.argv[sys.argv.index("--rank-entry") + 1 :]
        sys.exit(rank_entry(rest))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes everywhere (what the test runs)")
    parser.add_argument("--only", help=f"comma-separated sections, of: {', '.join(SECTIONS)}")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="join the gpu.json files of split runs")
    parser.add_argument("--graph-modes", default="graphs",
                        help="the compiled section's captured stages, comma-separated, of: graphs, regional+graphs "
                             "(Inductor over a whole stage: minutes of compiling at a released shape)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.merge:
        report = merge(args.merge)
        write(report, args.out)
        print(markdown(report))
        return
    only = SECTIONS if args.only is None else args.only.split(",")
    unknown = [name for name in only if name not in SECTIONS]
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; allowed: {', '.join(SECTIONS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    graph_modes = tuple(args.graph_modes.split(","))
    if not set(graph_modes) <= set(GRAPH_STAGES):
        parser.error(f"--graph-modes: one or more of {', '.join(GRAPH_STAGES)} (got {args.graph_modes!r})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    report = dict(
        machine=f"{gpu}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, python {platform.python_version()}",
    )
    quick = args.quick
    skipped = no_cuda()
    sections = {
        "patch_cost": lambda: patch_cost(quick, 1 if quick else args.repeats),
        "degree1": lambda: degree1(quick, 1 if quick else args.repeats),
        "cpu_speedups": lambda: cpu_speedups(
            "tiny" if quick else "small",
            256 if quick else 512,
            4 if quick else 20,
            (1, 2) if quick else (1, 2, 4, 8),
            1 if quick else 3,
        ),
        "nccl_one_gpu": lambda: nccl_one_gpu(
            4 if quick else 8,
            (2,) if quick else (2, 4),
            lambda partial: write({**report, "nccl_one_gpu": {**partial, "unfinished": True}}, args.out),
        ),
        "compiled": lambda: compiled_stages(quick, 1 if quick else 3, graph_modes),
    }
    for name in only:
        if skipped and name != "cpu_speedups" and not (quick and name in ("patch_cost", "degree1", "compiled")):
            report[name] = {"skipped": skipped}
            continue
        start = time.monotonic()
        try:
            report[name] = sections[name]()
        except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others' figures
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()}
        report[name]["section_seconds"] = time.monotonic() - start
        print(f"{name}: done in {report[name]['section_seconds']:.0f} s", flush=True)
        write(report, args.out)  # after every section: a call stopped at its time limit keeps what it finished
    write(report, args.out)  # the skipped sections too
    print(markdown(report))


if __name__ == "__main__":
    main()
