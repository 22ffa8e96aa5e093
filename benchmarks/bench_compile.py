"""Regional compile (``compile.mode: regional``, Inductor on this CPU) against eager, per family, at degree 1.

    python benchmarks/bench_compile.py                  # every family; writes benchmarks/results/compile_cpu.{json,md}
    python benchmarks/bench_compile.py --presets flux-tiny,small --repeats 3

Each family's preset (``small``: HunyuanDiT at a width where compute shows; the others their ``*-tiny``), one
process per measurement so that nothing of one run's compile state reaches the next: eager (a first call, then the
median and min-max of ``--repeats`` calls), compiled with an empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a
fresh folder: the first call is the cold compile; then the steady calls), and compiled again on that cache (the
warm start's first call). Each row: the three first calls, steady eager and compiled (median, min-max) and the
speedup, the graphs the first call made (dynamo's count), and the compiled latents' max abs difference from eager.
Torch threads: 2 (this machine's cores). The output is latents (no VAE decode), 256 px, 4 steps (Wan: 5 frames, 128
px).
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


def child(preset: str, compiled: bool, repeats: int, out_path: str) -> None:
    """One measurement, in this process: the first call and ``repeats`` more; the latents saved to ``out_path``."""
    import torch

    from xfuse.families.registry import load_pipeline, model_spec

    torch.set_num_threads(2)
    compile_section = {"mode": "regional"} if compiled else None
    pipe = model_spec(preset).pipeline_class().from_pipe(load_pipeline(preset), parallel={"pipefusion_degree": 1},
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
        return time.perf_counter() - start, (out.frames if video else out.images)

    first, latents = once()
    steady = [once()[0] for _ in range(repeats)]
    utils = sys.modules.get("torch._dynamo.utils")
    graphs = 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])
    torch.save(latents, out_path)
    print(json.dumps({"first_s": first, "steady_s": steady, "graphs": graphs}))


def measure(preset: str, compiled: bool, repeats: int, cache_dir: str, out_path: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", preset, str(int(compiled)), str(repeats), out_path]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{preset} ({'compiled' if compiled else 'eager'}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}–{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    import torch

    rows = {}
    for preset in args.presets.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            eager = measure(preset, False, args.repeats, f"{tmp}/unused", f"{tmp}/eager.pt")
            cold = measure(preset, True, args.repeats, f"{tmp}/inductor", f"{tmp}/cold.pt")
            warm = measure(preset, True, 1, f"{tmp}/inductor", f"{tmp}/warm.pt")
            reference, compiled = torch.load(f"{tmp}/eager.pt"), torch.load(f"{tmp}/cold.pt")
            diff = float((compiled - reference).abs().max())
            scale = float(reference.abs().max())
        rows[preset] = {
            "eager_first_s": eager["first_s"], "eager_s": eager["steady_s"],
            "compiled_cold_first_s": cold["first_s"], "compiled_warm_first_s": warm["first_s"],
            "compiled_s": cold["steady_s"], "graphs": cold["graphs"], "warm_graphs": warm["graphs"],
            "speedup": statistics.median(eager["steady_s"]) / statistics.median(cold["steady_s"]),
            "max_abs_diff": diff, "max_abs_eager": scale,
        }  # fmt: skip
        print(preset, json.dumps(rows[preset]), flush=True)
    report = {"machine": f"{os.cpu_count()} cores, torch {torch.__version__}", "repeats": args.repeats, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compile_cpu.json"), "w") as fh:
        json.dump(report, fh, indent=2)
    lines = [
        "| preset | eager first call | compiled first call, cold / warm cache | eager | compiled | speedup | graphs "
        "| max abs diff (of max abs) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for preset, r in rows.items():
        lines.append(
            f"| `{preset}` | {r['eager_first_s']:.2f} s | {r['compiled_cold_first_s']:.1f} s / "
            f"{r['compiled_warm_first_s']:.1f} s | {fmt(r['eager_s'])} | {fmt(r['compiled_s'])} | "
            f"{r['speedup']:.2f}x | {r['graphs']} | {r['max_abs_diff']:.1e} ({r['max_abs_eager']:.1f}) |"
        )
    with open(os.path.join(args.out, "compile_cpu.md"), "w") as fh:
        fh.write(f"Machine: {report['machine']}; {args.repeats} steady calls each.\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], bool(int(sys.argv[3])), int(sys.argv[4]), sys.argv[5])
    else:
        main()
