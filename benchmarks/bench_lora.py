"""LoRA on the sharded SD3 and FLUX pipelines: what an adapter costs per call, unfused and fused, and what loading,
switching and fusing cost, at degree 2.

    python benchmarks/bench_lora.py        # sd3-small and flux-small; writes benchmarks/results/lora.{json,md}
    python benchmarks/bench_lora.py --models sd3-small --rounds 3

Each model: pp2 (M = 2, warm-up 1; one thread per rank), 256 px, 8 steps. Two random adapters of rank 16 on every
attention projection (built with PEFT, saved as diffusers saves them), loaded by every rank (its share). Per round,
in turns (the order rotating with the round): the base model (``disable_lora``), one adapter unfused, both weighted
(0.7 / 0.4) unfused, and one adapter fused; a call each. Also timed: ``load_lora_weights`` per adapter,
``set_adapters`` (what ``xfuse serve`` does between requests), ``fuse_lora`` and ``unfuse_lora``; and each rank's
resident adapter weights. Median and min–max over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests.support

from tests.support.lora_fns import save_lora  # noqa: E402
from tests.support.world import World  # noqa: E402
from xfuse.families.registry import load_pipeline, model_spec  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PARALLEL = {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 1}
CALL = dict(prompt="a lighthouse at dusk", height=256, width=256, num_inference_steps=8, output_type="latent")
RUNS = ("base", "a", "a 0.7 + b 0.4", "a fused")


def rank_timings(model: str, folder: str, loras: dict[str, str], rounds: int) -> dict:
    """On every rank: the pipeline on ``folder`` (pp2) with the two adapters; rank 0 returns the timings."""
    torch.set_num_threads(1)
    pipe = model_spec(model).pipeline_class().from_pretrained(folder, parallel=PARALLEL, comm={"timeout_s": 300})
    pipe.set_progress_bar_config(disable=True)
    times: dict[str, list[float]] = {k: [] for k in (*RUNS, "load", "set_adapters", "fuse_lora", "unfuse_lora")}

    def timed(label, fn):
        start = time.perf_counter()
        out = fn()
        times[label].append(time.perf_counter() - start)
        return out

    def call():
        return pipe(**CALL, generator=torch.Generator().manual_seed(0))

    pipe(**CALL, generator=torch.Generator().manual_seed(0))  # the world's first call (buffers, kernels) untimed
    for name, path in loras.items():
        timed("load", lambda name=name, path=path: pipe.load_lora_weights(path, adapter_name=name))
    held = pipe.lora_parameter_count()
    for r in range(rounds):
        turn = RUNS[r % len(RUNS) :] + RUNS[: r % len(RUNS)]
        for run in turn:
            if run == "base":
                pipe.disable_lora()
                timed(run, call)
                pipe.enable_lora()
            elif run == "a":
                timed("set_adapters", lambda: pipe.set_adapters(["a"]))
                timed(run, call)
            elif run == "a 0.7 + b 0.4":
                timed("set_adapters", lambda: pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.4]))
                timed(run, call)
            else:
                pipe.set_adapters(["a"])
                timed("fuse_lora", pipe.fuse_lora)
                timed(run, call)
                timed("unfuse_lora", pipe.unfuse_lora)
    return {"times": times, "held_elements": held, "rank": pipe.context.rank}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["sd3-small", "flux-small"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    started, results = time.time(), {}
    with tempfile.TemporaryDirectory() as tmp, World(2, start_timeout=300) as world:
        for model in args.models:
            pipe = load_pipeline(model)
            folder = model_spec(model).save_preset_pipeline(os.path.join(tmp, model), model)
            loras = {name: save_lora(pipe, os.path.join(tmp, f"{model}-{name}"), seed=seed, rank=16, alpha=16)
                     for name, seed in (("a", 1), ("b", 2))}  # fmt: skip
            transformer_elements = sum(t.numel() for t in pipe.transformer.state_dict().values())
            per_rank = world.run_ok(rank_timings, model, folder, loras, args.rounds, timeout=3600)
            base = statistics.median(per_rank[0]["times"]["base"])
            rows = {}
            for label, values in per_rank[0]["times"].items():
                rows[label] = summary(values)
                if label in RUNS:
                    rows[label]["vs_base"] = statistics.median(values) / base
            results[model] = {
                "rows": rows,
                "held_elements": [r["held_elements"] for r in sorted(per_rank, key=lambda r: r["rank"])],
                "transformer_elements": transformer_elements,
            }
            print(model, json.dumps(rows, indent=1), flush=True)
    out = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "torch": torch.__version__,
        "seconds": round(time.time() - started),
        "call": CALL,
        "parallel": PARALLEL,
        "results": results,
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "lora.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(RESULTS, "lora.md"), "w") as f:
        f.write(markdown(out))
    print(markdown(out))


def markdown(out: dict) -> str:
    lines = [
        "| model | what | seconds, median (min–max) | vs the base model |",
        "|---|---|---|---|",
    ]
    for model, result in out["results"].items():
        for label, row in result["rows"].items():
            ratio = f"{row['vs_base']:.3f}x" if "vs_base" in row else ""
            lines.append(f"| {model} | {label} | {row['median']:.4f} ({row['min']:.4f}–{row['max']:.4f}) | {ratio} |")
    lines.append("")
    for model, result in out["results"].items():
        lines.append(f"{model}: adapter elements held per rank {result['held_elements']} (both adapters)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
