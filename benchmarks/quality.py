"""Image quality of PipeFusion on the trained ``shapes`` models (HunyuanDiT and PixArt-Σ): does the image follow the
prompt, and how close is it to the serial image?

    python benchmarks/quality.py            # both models; writes benchmarks/results/quality.{json,md}
    python benchmarks/quality.py --quick    # 4 prompts, 2 configurations
    python benchmarks/quality.py --models shapes-pixart

For a fixed set of prompts (``xfuse.assets.shapes_world.scoring_scenes``: every colour x shape x background once,
positions cycling) and seeds (prompt i uses seed i), 256 px, 20 steps, guidance 5, CFG:

* serial: diffusers' own pipeline (``HunyuanDiTPipeline``, ``PixArtSigmaPipeline``) on the shipped folder;
* xfuse exact mode at degree 2 (every step synchronous: ``warmup_steps = num_inference_steps``);
* xfuse pipelined at degree 2 for M in {2, 4, 8} patches and warm-up in {0, 1, 2} steps.

Each row: the attribute classifier's accuracy per attribute (colour, shape, background, position) and their mean,
and PSNR / SSIM of each image against the serial image of the same prompt and seed (mean over prompts). Also
``docs/<model>.png`` (the pictures of docs/models.md): every third prompt, serial diffusers above and the default
pipelined mode (pp2, M = 2, warm-up 1: what the demo runs) below.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests.support

from tests.support.world import World  # noqa: E402
from xfuse.assets import shapes_world as shapes  # noqa: E402
from xfuse.families.folder import SHIPPED_IMAGE_MODELS, SHIPPED_MODELS  # noqa: E402
from xfuse.families.registry import load_pipeline, model_spec  # noqa: E402

CALL = shapes.SCORING_CALL
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def configurations(quick: bool) -> list[tuple[str, dict]]:
    """(label, parallel config) of each xfuse row."""
    steps = CALL["num_inference_steps"]
    rows = [("xfuse exact (pp2)", {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": steps})]
    for patches in (2,) if quick else (2, 4, 8):
        for warmup in (1,) if quick else (0, 1, 2):
            rows.append((f"pipelined pp2 M={patches} W={warmup}", {
                "pipefusion_degree": 2, "num_patches": patches, "warmup_steps": warmup,
            }))  # fmt: skip
    return rows


def generate(pipe, scenes: list[shapes.Scene]) -> list:
    """One image per scene, prompt i with seed i (a diffusers or an xfuse pipeline; the same call either way)."""
    images = []
    for seed, scene in enumerate(scenes):
        out = pipe(prompt=scene.caption, generator=torch.Generator().manual_seed(seed), **CALL)
        images.append(out.images[0] if out is not None else None)
    return images


def xfuse_rank(model: str, configs: list[tuple[str, dict]], scenes: list[shapes.Scene]) -> dict:
    """On every rank of a 2-rank world: each configuration's images (rank 0 returns them, PNG-free as arrays)."""
    torch.set_num_threads(1)
    pipeline_class = model_spec(model).pipeline_class()
    out = {}
    for label, parallel in configs:
        pipe = pipeline_class.from_pretrained(SHIPPED_MODELS[model], parallel=parallel, comm={"timeout_s": 120})
        pipe.set_progress_bar_config(disable=True)
        images = generate(pipe, scenes)
        out[label] = [np.asarray(image) for image in images] if images[0] is not None else None
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """SSIM (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03) per channel, averaged."""
    x = torch.from_numpy(np.array(a)).double().permute(2, 0, 1).unsqueeze(1)  # (H, W, 3) -> (3, 1, H, W)
    y = torch.from_numpy(np.array(b)).double().permute(2, 0, 1).unsqueeze(1)  # (H, W, 3) -> (3, 1, H, W)
    grid = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-(grid**2) / (2 * 1.5**2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2).view(1, 1, 11, 11)  # (11,) x (11,) -> (1, 1, 11, 11)

    def blur(t):
        return torch.nn.functional.conv2d(t, window)

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    index = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return index.mean().item()


def score(classifier, images: list, scenes: list[shapes.Scene], serial: list | None) -> dict:
    from PIL import Image

    pil = [Image.fromarray(np.asarray(image)) for image in images]
    hits = shapes.attribute_hits(classifier, pil, scenes)
    row = {name: round(100 * sum(h) / len(h), 1) for name, h in hits.items()}
    row["mean"] = round(sum(row[name] for name in hits) / len(hits), 1)
    if serial is not None:
        pairs = [(np.asarray(a), np.asarray(b)) for a, b in zip(images, serial, strict=True)]
        # identical images have infinite PSNR: counted as 99 dB so that the mean stays a number
        by_prompt = [min(psnr(a, b), 99.0) for a, b in pairs]
        row["psnr_db"] = round(float(np.mean(by_prompt)), 2)
        row["psnr_db_median"] = round(float(np.median(by_prompt)), 2)
        row["psnr_db_by_prompt"] = [round(value, 2) for value in by_prompt]
        row["identical"] = sum(bool(np.array_equal(a, b)) for a, b in pairs)
        row["ssim"] = round(float(np.mean([ssim(a, b) for a, b in pairs])), 4)
    return row


def markdown(model: str, report: dict) -> str:
    lines = [
        f"`{model}` model ({model_spec(model).diffusers_pipeline}), {len(report['prompts'])} prompts x 1 seed, "
        f"{CALL['height']} px, {CALL['num_inference_steps']} steps, guidance {CALL['guidance_scale']}; "
        "accuracy by the attribute classifier (%), PSNR / SSIM against the serial image (mean over prompts, and the "
        "median PSNR; an identical image counts as 99 dB).",
        "",
        "| run | colour | shape | background | position | mean | PSNR (dB), mean (median) | SSIM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, row in report["rows"].items():
        closeness = (
            f"{row['psnr_db']:.2f} ({row['psnr_db_median']:.2f}) | {row['ssim']:.4f}"
            if "psnr_db" in row
            else "(reference) | (reference)"
        )
        lines.append(
            f"| {label} | {row['color']} | {row['shape']} | {row['background']} | {row['position']} | "
            f"{row['mean']} | {closeness} |"
        )
    return "\n".join(lines) + "\n"


def contact_sheet(rows: list[list]):
    """One PIL image: the given rows of same-sized images side by side, rows stacked."""
    from PIL import Image

    side = np.asarray(rows[0][0]).shape[0]
    sheet = Image.new("RGB", (side * len(rows[0]), side * len(rows)), "white")
    for r, row in enumerate(rows):
        for c, image in enumerate(row):
            sheet.paste(Image.fromarray(np.asarray(image)), (c * side, r * side))
    return sheet


DEFAULT_ROW = "pipelined pp2 M=2 W=1"  # what `model: shapes*` with the pp2 configs runs (the demo)


def measure(model: str, scenes: list[shapes.Scene], configs: list[tuple[str, dict]], sheet: str | None = None) -> dict:
    """The table's rows for ``model``; with ``sheet``, a PNG of every third prompt: serial diffusers above, the
    default pipelined mode below."""
    classifier = shapes.load_classifier()
    start = time.time()
    torch.set_num_threads(2)
    serial_pipe = load_pipeline(model)  # diffusers' own pipeline class and loader
    serial_pipe.set_progress_bar_config(disable=True)
    serial = generate(serial_pipe, scenes)
    rows = {"serial diffusers": score(classifier, serial, scenes, None)}
    print(f"{model} serial: {rows['serial diffusers']} ({time.time() - start:.0f} s)", flush=True)
    with World(2, threads_per_rank=1, start_timeout=600) as world:
        images = world.run_ok(xfuse_rank, model, configs, scenes, timeout=7200)[0]
    for label, _ in configs:
        rows[label] = score(classifier, images[label], scenes, serial)
        print(f"{model} {label}: {rows[label]}", flush=True)
    if sheet is not None and DEFAULT_ROW in images:
        contact_sheet([serial[::3], images[DEFAULT_ROW][::3]]).save(sheet)
    return {"prompts": [s.caption for s in scenes], "call": CALL, "rows": rows, "seconds": round(time.time() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=SHIPPED_IMAGE_MODELS, default=list(SHIPPED_IMAGE_MODELS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--sheets", default=DOCS, help="folder for each model's <model>.png contact sheet")
    args = parser.parse_args()
    scenes = shapes.scoring_scenes(4 if args.quick else 24)
    reports = {
        model: measure(
            model, scenes, configurations(args.quick), None if args.quick else os.path.join(args.sheets, f"{model}.png")
        )
        for model in args.models
    }
    os.makedirs(args.out, exist_ok=True)
    name = "quality_quick" if args.quick else "quality"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(reports, f, indent=2)
    text = "\n".join(markdown(model, report) for model, report in reports.items())
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
