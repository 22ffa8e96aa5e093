"""Video quality of PipeFusion on the trained ``shapes-video`` model (Wan 2.1): does the clip follow the prompt, and
how close is it to the serial clip, frame by frame, for temporal and for spatial patches?

    python benchmarks/quality_video.py            # writes benchmarks/results/quality_video.{json,md}
    python benchmarks/quality_video.py --quick    # 4 prompts, 2 configurations

For a fixed set of prompts (``xfuse.assets.shapes_video_world.scoring_clips``: every colour x direction, both
backgrounds, shapes cycling) and seeds (prompt i uses seed i), 64 px, 13 frames, 20 steps, guidance 5, CFG:

* serial: diffusers' own ``WanPipeline`` on the shipped folder;
* xfuse exact mode at degree 2 (every step synchronous);
* xfuse pipelined at degree 2, warm-up 1, M in {2, 4} patches cut along time (``video_patches: temporal``: runs of
  latent frames) or along rows (``spatial``: strips of every frame).

Each row: the clip classifier's accuracy per attribute (colour, shape, background, direction) and their mean; PSNR
against the serial clip of the same prompt and seed, per frame (mean over prompts) and over the clip. Also
``docs/shapes-video.png``: the first, middle and last frames of every third prompt, serial above, pipelined (temporal,
M = 2: what configs/shapes-video/pp2.yaml runs) below.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests.support

from benchmarks.quality import DOCS, RESULTS, contact_sheet, psnr  # noqa: E402
from tests.support.world import World  # noqa: E402
from xfuse.assets import shapes_video_world as world  # noqa: E402
from xfuse.families.folder import SHIPPED_MODELS  # noqa: E402
from xfuse.families.registry import load_pipeline, model_spec  # noqa: E402

MODEL = "shapes-video"
CALL = world.SCORING_CALL
DEFAULT_ROW = "pipelined pp2 temporal M=2 W=1"  # what configs/shapes-video/pp2.yaml runs (the demo)


def configurations(quick: bool) -> list[tuple[str, dict]]:
    """(label, parallel config) of each xfuse row."""
    steps = CALL["num_inference_steps"]
    rows = [("xfuse exact (pp2)", {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": steps})]
    for patches in (2,) if quick else (2, 4):
        for cut in ("temporal",) if quick else ("temporal", "spatial"):
            rows.append((f"pipelined pp2 {cut} M={patches} W=1", {
                "pipefusion_degree": 2, "num_patches": patches, "warmup_steps": 1, "video_patches": cut,
            }))  # fmt: skip
    return rows


def generate(pipe, clips: list[world.Clip]) -> list[np.ndarray] | None:
    """One clip per prompt, (T, H, W, 3) uint8, prompt i with seed i (diffusers' or xfuse's pipeline, the same call)."""
    out = []
    for seed, clip in enumerate(clips):  # every rank calls for every prompt; ranks other than 0 get None
        result = pipe(prompt=clip.caption, generator=torch.Generator().manual_seed(seed), output_type="np", **CALL)
        if result is not None:
            out.append((np.asarray(result.frames[0]) * 255).round().astype(np.uint8))  # (T, H, W, 3) -> uint8
    return out or None


def xfuse_rank(configs: list[tuple[str, dict]], clips: list[world.Clip]) -> dict:
    """On every rank of a 2-rank world: each configuration's clips (rank 0 returns them)."""
    torch.set_num_threads(1)
    pipeline_class = model_spec(MODEL).pipeline_class()
    out = {}
    for label, parallel in configs:
        pipe = pipeline_class.from_pretrained(SHIPPED_MODELS[MODEL], parallel=parallel, comm={"timeout_s": 120})
        pipe.set_progress_bar_config(disable=True)
        out[label] = generate(pipe, clips)
    return out


def score(classifier, videos: list[np.ndarray], clips: list[world.Clip], serial: list[np.ndarray] | None) -> dict:
    hits = world.attribute_hits(classifier, [list(video) for video in videos], clips)
    row: dict = {name: round(100 * sum(h) / len(h), 1) for name, h in hits.items()}
    row["mean"] = round(sum(row[name] for name in hits) / len(hits), 1)
    if serial is not None:
        # identical frames have infinite PSNR: counted as 99 dB so that the means stay numbers
        per_frame = np.array([[min(psnr(a, b), 99.0) for a, b in zip(video, ref, strict=True)]
                              for video, ref in zip(videos, serial, strict=True)])  # (prompts, T)  # fmt: skip
        row["psnr_db"] = round(float(per_frame.mean()), 2)
        row["psnr_db_by_frame"] = [round(float(v), 2) for v in per_frame.mean(axis=0)]
        row["psnr_db_by_prompt"] = [round(float(v), 2) for v in per_frame.mean(axis=1)]
        row["identical"] = sum(bool(np.array_equal(a, b)) for a, b in zip(videos, serial, strict=True))
    return row


def markdown(report: dict) -> str:
    frames = CALL["num_frames"]
    lines = [
        f"`{MODEL}` model (WanPipeline), {len(report['prompts'])} prompts x 1 seed, {CALL['height']} px, {frames} "
        f"frames, {CALL['num_inference_steps']} steps, guidance {CALL['guidance_scale']}; accuracy by the clip "
        "classifier (%), PSNR against the serial clip (dB, mean over prompts; an identical frame counts as 99 dB): "
        "over the clip, and at the first, middle and last frame.",
        "",
        "| run | colour | shape | background | direction | mean | PSNR clip | frame 1 | middle | last |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, row in report["rows"].items():
        closeness = "(reference) | | |"
        if "psnr_db" in row:
            by_frame = row["psnr_db_by_frame"]
            closeness = f"{row['psnr_db']:.2f} | " + " | ".join(
                f"{by_frame[i]:.2f}" for i in (0, frames // 2, frames - 1)
            )
        lines.append(
            f"| {label} | {row['color']} | {row['shape']} | {row['background']} | {row['direction']} | "
            f"{row['mean']} | {closeness} |"
        )
    return "\n".join(lines) + "\n"


def measure(clips: list[world.Clip], configs: list[tuple[str, dict]], sheet: str | None = None) -> dict:
    classifier = world.load_classifier()
    start = time.time()
    torch.set_num_threads(2)
    serial_pipe = load_pipeline(MODEL)  # diffusers' own WanPipeline, loader and loop
    serial_pipe.set_progress_bar_config(disable=True)
    serial = generate(serial_pipe, clips)
    assert serial is not None
    rows = {"serial diffusers": score(classifier, serial, clips, None)}
    print(f"serial: {rows['serial diffusers']} ({time.time() - start:.0f} s)", flush=True)
    with World(2, threads_per_rank=1, start_timeout=600) as ranks:
        videos = ranks.run_ok(xfuse_rank, configs, clips, timeout=7200)[0]
    for label, _ in configs:
        rows[label] = score(classifier, videos[label], clips, serial)
        print(f"{label}: { {k: v for k, v in rows[label].items() if 'by_' not in k} }", flush=True)
    if sheet is not None and DEFAULT_ROW in videos:
        frames = CALL["num_frames"]
        pick = [0, frames // 2, frames - 1]
        contact_sheet([[f for video in serial[::3] for f in video[pick]],
                       [f for video in videos[DEFAULT_ROW][::3] for f in video[pick]]]).save(sheet)  # fmt: skip
    return {"prompts": [c.caption for c in clips], "call": CALL, "rows": rows, "seconds": round(time.time() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--sheet", default=os.path.join(DOCS, f"{MODEL}.png"), help="the contact sheet's PNG")
    args = parser.parse_args()
    clips = world.scoring_clips(4 if args.quick else 24)
    report = measure(clips, configurations(args.quick), None if args.quick else args.sheet)
    os.makedirs(args.out, exist_ok=True)
    name = "quality_video_quick" if args.quick else "quality_video"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
