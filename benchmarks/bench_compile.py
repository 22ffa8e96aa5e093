"""Regional compile (``compile.mode: regional``, Inductor on this CPU) against eager, per family, at degrees 1 and 2,
and the start of a second launch with a warm ``compile.cache_dir``.

    python benchmarks/bench_compile.py                  # every family; writes benchmarks/results/compile_cpu.{json,md}
    python benchmarks/bench_compile.py --presets flux-tiny,small --repeats 3 --launches 2 --degrees 1

Each family's preset (``small``: HunyuanDiT at a width where compute shows; the others their ``*-tiny``), one
process (degree 2: one torchrun world) per measurement so that nothing of one run's compile state reaches the next.
Per degree: eager (a first call, then the median and min-max of ``--repeats`` calls) and compiled with an empty
``compile.cache_dir`` (the first call is the cold compile; then the steady calls). At degree 1, ``--launches`` pairs
of launches on a fresh ``compile.cache_dir`` each, cold then warm: the first call of each (what a launch's start
costs), the warm/cold factor, and the graphs the warm launch generated (0: everything came from the cache). Each row:
first calls, steady eager and compiled (median, min-max) and the speedup, the graphs the first call made (dynamo's
count, rank 0), and the compiled latents' max abs difference from eager. Torch threads: 2 at degree 1 (this
machine's cores), 1 per rank at degree 2. The output is latents (no VAE decode), 256 px, 4 steps (Wan: 5 frames,
128 px); degree 2 is PipeFusion over 2 patches, one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PRESETS = ("small", "pixart-tiny", "sd3-tiny", "flux-tiny", "flux2-tiny", "qwen-image-tiny", "z-image-tiny", "wan-tiny")


def child(preset: str, compiled: bool, repeats: int, out_path: str, cache_dir: str, degree: int) -> None:
    """One measurement, in this process (a rank of a torchrun world at degree 2): the first call and ``repeats``
    more; rank 0 saves its latents to ``out_path`` and prints its numbers."""
    import torch

    from xfuse.families.registry import load_pipeline, model_spec
    from xfuse.pipelines.stage_compiler import compile_counts

    torch.set_num_threads(2 if degree == 1 else 1)
    compile_section = {"mode": "regional", "cache_dir": cache_dir} if compiled else None
    parallel = {"pipefusion_degree": degree} | ({"num_patches": 2, "warmup_steps": 1} if degree > 1 else {})
    pipe = model_spec(preset).pipeline_class().from_pipe(load_pipeline(preset), parallel=parallel,
                                                        compile=compile_section)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    video = preset.startswith("wan")
    side = 128 if video else 256
    call = dict(prompt="a red house by a lake", num_inference_steps=4, output_type="latent", height=side, width=side)
    if video:
        call["num_frames"] = 5

    def once():
        start = time.perf_counter()
        out = pipe(**call, generator=torch.Generator().manual_seed(0))
        return time.perf_counter() - start, None if out is None else (out.frames if video else out.images)

    first, latents = once()
    counts = compile_counts()
    steady = [once()[0] for _ in range(repeats)]
    if latents is not None:
        torch.save(latents, out_path)
        print(json.dumps({"first_s": first, "steady_s": steady} | counts))


def measure(preset: str, compiled: bool, repeats: int, cache_dir: str, out_path: str, degree: int = 1) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = [os.path.abspath(__file__), "--child", preset, str(int(compiled)), str(repeats), out_path, cache_dir,
            str(degree)]  # fmt: skip
    if degree == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={degree}", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{preset} ({'compiled' if compiled else 'eager'}, degree {degree}) failed:\n"
                         f"{out.stderr[-3000:]}")  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}–{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--launches", type=int, default=3, help="cold/warm launch pairs per preset (degree 1)")
    parser.add_argument("--degrees", default="1,2")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    import torch

    rows: dict[str, dict] = {}
    for degree in map(int, args.degrees.split(",")):
        for preset in args.presets.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                eager = measure(preset, False, args.repeats, f"{tmp}/unused", f"{tmp}/eager.pt", degree)
                cold = measure(preset, True, args.repeats, f"{tmp}/cache", f"{tmp}/cold.pt", degree)
                reference, compiled = torch.load(f"{tmp}/eager.pt"), torch.load(f"{tmp}/cold.pt")
                row = {
                    "degree": degree, "eager_first_s": eager["first_s"], "eager_s": eager["steady_s"],
                    "compiled_cold_first_s": cold["first_s"], "compiled_s": cold["steady_s"], "graphs": cold["graphs"],
                    "speedup": statistics.median(eager["steady_s"]) / statistics.median(cold["steady_s"]),
                    "max_abs_diff": float((compiled - reference).abs().max()),
                    "max_abs_eager": float(reference.abs().max()),
                }  # fmt: skip
                if degree == 1:  # launches on a fresh compile.cache_dir each: cold, then warm
                    starts = []
                    for launch in range(args.launches):
                        cache = f"{tmp}/launch{launch}"
                        first = measure(preset, True, 0, cache, f"{tmp}/first.pt")
                        second = measure(preset, True, 0, cache, f"{tmp}/second.pt")
                        starts.append((first["first_s"], second["first_s"], second["generated"], second["cached"]))
                    row["launches"] = starts
            rows[f"{preset}@{degree}"] = row
            print(preset, json.dumps(row), flush=True)
    report = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}", "repeats": args.repeats, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compile_cpu.json"), "w") as fh:
        json.dump(report, fh, indent=2)
    lines = [
        "| preset | degree | eager first call | compiled first call (cold) | eager | compiled | speedup "
        "| graphs (rank 0) | max abs diff (of max abs) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        lines.append(
            f"| `{key.split('@')[0]}` | {r['degree']} | {r['eager_first_s']:.2f} s "
            f"| {r['compiled_cold_first_s']:.1f} s | {fmt(r['eager_s'])} | {fmt(r['compiled_s'])} "
            f"| {r['speedup']:.2f}x | {r['graphs']} "
            f"| {r['max_abs_diff']:.1e} ({r['max_abs_eager']:.1f}) |"
        )
    starts = [
        "| preset | first call, cold launch | first call, warm launch | warm / cold "
        "| graphs the warm launch generated |",
        "|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        if "launches" in r:
            cold_s, warm_s = [c for c, *_ in r["launches"]], [w for _, w, *_ in r["launches"]]
            factors = [c / w for c, w, *_ in r["launches"]]
            generated = sorted({g for *_, g, _ in r["launches"]})
            starts.append(
                f"| `{key.split('@')[0]}` | {fmt(cold_s)} | {fmt(warm_s)} | {statistics.median(factors):.1f}x "
                f"({min(factors):.1f}–{max(factors):.1f}) faster | {', '.join(map(str, generated))} |"
            )
    with open(os.path.join(args.out, "compile_cpu.md"), "w") as fh:
        fh.write(f"Machine: {report['machine']}; {args.repeats} steady calls each, {args.launches} launch pairs.\n\n"
                 + "\n".join(lines) + "\n\nA launch's start with compile.cache_dir (degree 1):\n\n"
                 + "\n".join(starts) + "\n")  # fmt: skip
    print("\n".join(lines + [""] + starts))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], bool(int(sys.argv[3])), int(sys.argv[4]), sys.argv[5], sys.argv[6], int(sys.argv[7]))
    else:
        main()
