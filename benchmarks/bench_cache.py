"""Step caching (``cache:``) on the trained ``shapes`` models: quality against the uncached image, and wall time.

    python benchmarks/bench_cache.py            # both models; writes benchmarks/results/cache.{json,md}
    python benchmarks/bench_cache.py --prompts 4 --models shapes

For each shipped model (``shapes``: HunyuanDiT, ``shapes-pixart``: PixArt-Σ), 20 and 50 steps, degree 1 (one
process, 2 threads) and degree 2 (pp2, M = 2, warm-up 1: two processes of 1 thread), five runs of every prompt: no
caching, First-Block Cache at thresholds 0.1, 0.2 and 0.3, and ``taylor`` at 0.2 (the same decisions, the cached
residual predicted to first order). The runs of one prompt are timed in turns (the order rotating with the prompt),
so machine drift falls on every run alike. Each row: the attribute classifier's accuracy (%) over the prompts' four
attributes, PSNR / SSIM against the uncached image of the same prompt, degree and steps (mean), the steps skipped
per image (mean), and the wall time of one image call (whole call: text, loop, VAE decode; median and min–max over
the prompts) with its speedup over the uncached run's median.
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

from benchmarks.quality import psnr, ssim  # noqa: E402
from tests.support.world import World  # noqa: E402
from xfuse.assets import shapes_world as shapes  # noqa: E402
from xfuse.families.folder import SHIPPED_IMAGE_MODELS, SHIPPED_MODELS  # noqa: E402
from xfuse.families.registry import model_spec  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RUNS = {
    "off": None,
    "first_block 0.1": {"method": "first_block", "threshold": 0.1},
    "first_block 0.2": {"method": "first_block", "threshold": 0.2},
    "first_block 0.3": {"method": "first_block", "threshold": 0.3},
    "taylor 0.2": {"method": "taylor", "threshold": 0.2},
}
PARALLEL = {1: {"pipefusion_degree": 1}, 2: {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 1}}


def rank_runs(model: str, degree: int, steps_list: list[int], scenes: list[shapes.Scene]) -> dict:
    """On every rank: each run's images, wall times and skipped steps for every step count and prompt (rank 0)."""
    pipes = {
        label: model_spec(model)
        .pipeline_class()
        .from_pretrained(SHIPPED_MODELS[model], parallel=PARALLEL[degree], comm={"timeout_s": 120}, cache=cache)
        for label, cache in RUNS.items()
    }
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    labels = list(RUNS)
    out: dict = {}
    for steps in steps_list:
        call = dict(shapes.SCORING_CALL, num_inference_steps=steps)
        rows = {label: {"images": [], "seconds": [], "skipped": []} for label in labels}
        for index, scene in enumerate(scenes):
            turn = labels[index % len(labels) :] + labels[: index % len(labels)]  # the order rotates per prompt
            for label in turn:
                pipe = pipes[label]
                start = time.perf_counter()
                image = pipe(prompt=scene.caption, generator=torch.Generator().manual_seed(index), **call)
                seconds = time.perf_counter() - start
                rows[label]["seconds"].append(seconds)
                rows[label]["skipped"].append(pipe.engine.cache_decisions.count(False))
                rows[label]["images"].append(None if image is None else np.asarray(image.images[0]))
        out[steps] = rows
    return out


def summarize(classifier, rows: dict, scenes: list[shapes.Scene]) -> dict:
    from PIL import Image

    base = rows["off"]
    base_median = statistics.median(base["seconds"])
    table = {}
    for label, row in rows.items():
        hits = shapes.attribute_hits(classifier, [Image.fromarray(a) for a in row["images"]], scenes)
        accuracy = 100 * sum(sum(h) for h in hits.values()) / sum(len(h) for h in hits.values())
        pairs = list(zip(row["images"], base["images"], strict=True))
        median = statistics.median(row["seconds"])
        table[label] = {
            "accuracy": round(accuracy, 1),
            "psnr_db": None if label == "off" else round(float(np.mean([min(psnr(a, b), 99.0) for a, b in pairs])), 2),
            "ssim": None if label == "off" else round(float(np.mean([ssim(a, b) for a, b in pairs])), 4),
            "skipped": round(float(np.mean(row["skipped"])), 1),
            "seconds_median": round(median, 3),
            "seconds_min": round(min(row["seconds"]), 3),
            "seconds_max": round(max(row["seconds"]), 3),
            "speedup": round(base_median / median, 2),
        }
    return table


def markdown(report: dict) -> str:
    lines = [
        "| model | steps | degree | run | accuracy (%) | PSNR (dB) | SSIM | steps skipped | s per image, median "
        "(min–max) | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, by_steps in report["results"].items():
        for steps, by_degree in by_steps.items():
            for degree, table in by_degree.items():
                for label, r in table.items():
                    closeness = "(reference)" if r["psnr_db"] is None else f"{r['psnr_db']:.2f}"
                    ssim_text = "(reference)" if r["ssim"] is None else f"{r['ssim']:.4f}"
                    lines.append(
                        f"| {model} | {steps} | {degree} | {label} | {r['accuracy']} | {closeness} | {ssim_text} | "
                        f"{r['skipped']} | {r['seconds_median']:.3f} ({r['seconds_min']:.3f}–{r['seconds_max']:.3f}) "
                        f"| {r['speedup']:.2f}x |"
                    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=SHIPPED_IMAGE_MODELS, default=list(SHIPPED_IMAGE_MODELS))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 50])
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    scenes = shapes.scoring_scenes(args.prompts)
    classifier = shapes.load_classifier()
    results: dict = {}
    start = time.time()
    for model in args.models:
        results[model] = {steps: {} for steps in args.steps}
        for degree in (1, 2):
            threads = 2 // degree  # the machine's 2 cores either way
            with World(degree, threads_per_rank=threads, start_timeout=600) as world:
                runs = world.run_ok(rank_runs, model, degree, args.steps, scenes, timeout=7200)[0]
            for steps in args.steps:
                results[model][steps][degree] = summarize(classifier, runs[steps], scenes)
                print(model, steps, degree, json.dumps(results[model][steps][degree]), flush=True)
    report = {
        "prompts": [s.caption for s in scenes],
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
        "seconds": round(time.time() - start),
        "results": results,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cache.json"), "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(os.path.join(args.out, "cache.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
