"""The xfuse command line, run as a real subprocess."""

import os
import subprocess
import sys

import numpy as np
from PIL import Image

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def xfuse(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "xfuse", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def test_plan_prints_ranks_blocks_skips_and_bytes():
    out = xfuse("plan", "--config", "configs/hunyuandit/pp2.yaml", "--set", "model=bytes40",
                "--set", "parallel.placement=linear")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "route of a patch: r0[0-19] -> r1[20-39]" in text
    assert "0->39 (r0->r1)" in text and "18->21 (r0->r1)" in text  # all 19 skips cross at linear pp=2
    assert "sent skip" in text and "K/V buffers" in text


def test_plan_folded_has_no_cross_rank_skips_and_uneven_patches():
    out = xfuse("plan", "--config", "configs/tiny/pp2.yaml", "--set", "parallel.pipefusion_degree=3",
                "--set", "parallel.num_patches=5")
    assert out.returncode == 0, out.stderr
    assert "cross-rank skips: none" in out.stdout
    assert "patches (token rows): 0:[0,4)  1:[4,7)  2:[7,10)  3:[10,13)  4:[13,16)" in out.stdout
    assert "r0[0-2] -> r1[3-5] -> r2[6-7] -> r2[8-9] -> r1[10-12] -> r0[13-15]" in out.stdout


def test_plan_bad_value_exits_2_naming_the_key():
    out = xfuse("plan", "--config", "configs/tiny/pp2.yaml", "--set", "parallel.num_patches=17")
    assert out.returncode == 2
    assert "parallel.num_patches: must be an integer from 1 to the number of token rows, 16" in out.stderr


def test_generate_writes_png(tmp_path):
    target = tmp_path / "out.png"
    out = xfuse("generate", "--config", "configs/tiny/pp2.yaml", "--set", "generation.num_inference_steps=2",
                "--prompt", "a red house", "--output", str(target))
    assert out.returncode == 0, out.stderr
    assert f"wrote {target}" in out.stdout
    image = np.asarray(Image.open(target))
    assert image.shape == (256, 256, 3) and image.std() > 0
