"""The xfuse command line: what it does and prints (``plan``; ``generate`` on one rank and on the module's 2-rank world,
run as torchrun's ranks run it: ``tests.support.cli_fns``; the examples too), and as a real subprocess where the
process is the case (plain ``python -m xfuse``, an example under torchrun, a world torchrun started too small, the
launcher refusing a missing file, compilation and its cache, ``doctor``'s self-test)."""

import gc
import json
import os
import re
import subprocess
import sys
from itertools import pairwise

import numpy as np
import pytest
from PIL import Image

from tests.support.cli_fns import CliRun, cli_here, on_a_fresh_world, script_on_ranks
from tests.support.cli_fns import on_ranks as on_ranks_argv
from tests.support.fault_fns import generate_on_a_fresh_world
from tests.support.world import World

ENV = dict(os.environ)  # offline: tests/conftest.py


def xfuse(*args, timeout=120):
    """``python -m xfuse ARGS``, a real process."""
    return subprocess.run(
        [sys.executable, "-m", "xfuse", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def xfuse_here(*args) -> CliRun:
    """``xfuse ARGS`` in this process: a command that starts no rank, or a one-rank ``generate``."""
    return cli_here(list(args))


def on_ranks(ranks: World, *args) -> CliRun:
    """``torchrun --nproc_per_node=2 -m xfuse ARGS`` on the module's world (``tests.support.cli_fns.on_ranks``)."""
    return on_ranks_argv(ranks, list(args))


def torchrun(*args, nproc=2, timeout=180, cwd=None, env=None):
    """``torchrun --standalone --nproc_per_node=nproc ARGS`` (a script path, or ``-m xfuse ...``); ``env``: variables
    added to the tests' environment."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV | (env or {}), timeout=timeout, cwd=cwd)


def test_plan_prints_ranks_blocks_skips_and_bytes():
    out = xfuse_here(
        "plan",
        "--config",
        "configs/hunyuandit/pp2.yaml",
        "--set",
        "model=bytes40",
        "--set",
        "parallel.placement=linear",
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "route of a patch: r0[0-19] -> r1[20-39]" in text
    assert "0->39 (r0->r1)" in text and "18->21 (r0->r1)" in text  # all 19 skips cross at linear pp=2
    assert "sent skip" in text and "K/V buffers" in text


def test_plan_folded_has_no_cross_rank_skips_and_uneven_patches():
    out = xfuse_here(
        "plan",
        "--config",
        "configs/tiny/pp2.yaml",
        "--set",
        "parallel.pipefusion_degree=3",
        "--set",
        "parallel.num_patches=5",
    )
    assert out.returncode == 0, out.stderr
    assert "cross-rank skips: none" in out.stdout
    assert (
        "patches (token rows, tokens, share of the work): 0:[0,4) 64 25.0%  1:[4,7) 48 18.8%  2:[7,10) 48 18.8%  "
        "3:[10,13) 48 18.8%  4:[13,16) 48 18.8%\n" in out.stdout
    )
    assert "r0[0-2] -> r1[3-5] -> r2[6-7] -> r2[8-9] -> r1[10-12] -> r0[13-15]" in out.stdout


def test_plan_bad_value_exits_2_naming_the_key():
    out = xfuse_here("plan", "--config", "configs/tiny/pp2.yaml", "--set", "parallel.num_patches=17")
    assert out.returncode == 2
    assert "parallel.num_patches: must be an integer from 1 to the number of token rows, 16" in out.stderr


def test_generate_degree_1_with_plain_python(tmp_path):
    target = tmp_path / "out.png"
    out = xfuse(
        "generate",
        "--config",
        "configs/tiny/pp2.yaml",
        "--set",
        "parallel.pipefusion_degree=1",
        "--set",
        "generation.num_inference_steps=2",
        "--prompt",
        "a red house",
        "--output",
        str(target),
    )
    assert out.returncode == 0, out.stderr
    assert f"wrote {target}: 256x256, 2 steps" in out.stdout and "rank 0 sent 0.00 MiB (nothing)" in out.stdout
    image = np.asarray(Image.open(target))
    assert image.shape == (256, 256, 3) and image.std() > 0


def test_generate_starts_up_with_the_collector_paused_and_runs_the_request_with_it_on(tmp_path, monkeypatch):
    """``xfuse generate``'s start-up (its imports, the config, the load) runs with Python's collector off, the build
    freezing what it left (``xfuse.runtime.heap``); the request runs with the collector on, as it was before."""
    from xfuse import build

    states = {}
    real_build, real_call = build.build_pipeline, build.image_call_kwargs

    def building(config, model):
        states["build"] = gc.isenabled()
        return real_build(config, model)

    def calling(**request):
        states["request"] = gc.isenabled()
        return real_call(**request)

    monkeypatch.setattr(build, "build_pipeline", building)
    monkeypatch.setattr(build, "image_call_kwargs", calling)
    assert gc.isenabled()
    out = xfuse_here("generate", "--config", "configs/tiny/pp2.yaml", "--set", "parallel.pipefusion_degree=1",
                     "--set", "generation.num_inference_steps=1", "--output", str(tmp_path / "out.png"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert states == {"build": False, "request": True} and gc.isenabled()


def test_plan_with_sequence_parallelism_names_the_degrees_and_refuses_heads_it_cannot_split():
    out = xfuse_here("plan", "--config", "configs/tiny/pp2.yaml", "--set", "parallel.ulysses_degree=2",
                "--set", "parallel.ring_degree=2")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "world 8 = pipefusion 2 x cfg 1 x ulysses 2 x ring 2;" in out.stdout
    assert "sequence parallelism: each rank above is a group of 4 ranks (ulysses 2 x ring 2)" in out.stdout
    out = xfuse_here("plan", "--config", "configs/tiny/pp2.yaml", "--set", "parallel.ulysses_degree=4")
    assert out.returncode == 2
    assert "parallel.ulysses_degree: must be at most the model's 2 attention heads" in out.stderr
    assert "(got 4)" in out.stderr


def test_plan_auto_ranks_every_layout_of_a_world_and_refuses_bad_options_by_name():
    request = ["--set", "model=flux-small", "--set", "generation.height=512", "--set", "generation.width=512",
               "--set", "generation.num_inference_steps=20"]  # fmt: skip
    out = xfuse_here("plan", "--auto", "--gpus", "2", *request)  # this machine: CPU ranks over gloo
    assert out.returncode == 0, out.stderr
    rows = [line.split()[0:2] for line in out.stdout.splitlines() if line.split()[-1:] and "." in line.split()[-1]]
    assert [" ".join(r) for r in rows[:3]] == ["pipefusion 2", "ring 2", "ulysses 2"]
    assert "\nchoice: pipefusion 2 (" in out.stdout and "2 x CPU rank (1 thread, fp32), gloo on loopback" in out.stdout
    for options, says in (
        (["--gpus", "8", "--device", "h100", "--link", "pcie"], "--link: no 'pcie' link is known for 'h100'"),
        (["--gpus", "0"], "--gpus: must be a positive number of devices (got 0)"),
        (["--gpus", "8", "--nodes", "3", "--device", "a100"], "--nodes: must divide --gpus (8) into equal nodes"),
    ):
        bad = xfuse_here("plan", "--auto", *options, *request)
        assert bad.returncode == 2 and says in bad.stderr, bad.stderr


def test_generate_auto_runs_the_top_ranked_layout_of_its_world(ranks, tmp_path):
    """``--auto`` on 2 ranks: every rank picks the same layout from the model (rank 0 says which, and what the
    config had), the run uses it (the summary's degrees), and with warm-up = all steps it draws the degree-1 PNG."""
    from xfuse.config.io import load_config
    from xfuse.perf.model import machine
    from xfuse.perf.planner import rank_layouts

    common = ["--config", "configs/tiny/pp2.yaml", "--set", "generation.num_inference_steps=3",
              "--set", "parallel.warmup_steps=3", "--prompt", "a red house"]  # fmt: skip
    auto = on_ranks(ranks, "generate", *common, "--auto", "--output", str(tmp_path / "auto.png"))
    assert auto.returncode == 0, auto.stderr[-3000:]
    config = load_config("configs/tiny/pp2.yaml", ["generation.num_inference_steps=3", "parallel.warmup_steps=3"])
    best = rank_layouts(config, 2, machine("cpu", "gloo", 2))[0][0]
    assert f"--auto: {best.name} for 2 x CPU rank (1 thread, fp32) (gloo on loopback (2 cores))" in auto.stdout
    assert "the config's was pipefusion 2" in auto.stdout
    par = best.parallel
    assert f"on 2 rank(s) (pipefusion {par.pipefusion_degree} x cfg {par.cfg_degree}," in auto.stdout
    one = xfuse_here("generate", *common, "--set", "parallel.pipefusion_degree=1", "--output", str(tmp_path / "1.png"))
    assert one.returncode == 0, one.stderr
    a, b = (np.asarray(Image.open(tmp_path / name)).astype(int) for name in ("1.png", "auto.png"))
    assert a.shape == b.shape and np.abs(a - b).max() <= 1


def test_generate_with_ulysses_draws_the_degree_1_image(ranks, tmp_path):
    """``parallel.ulysses_degree: 2`` from the command line, exact (warm-up = all steps): the PNG of degree 1, up to
    one level of rounding in a pixel."""
    common = [
        "--config",
        "configs/tiny/pp2.yaml",
        "--set",
        "generation.num_inference_steps=3",
        "--set",
        "parallel.pipefusion_degree=1",
        "--set",
        "parallel.warmup_steps=3",  # whole-image steps: degree 1 exact too (the config has 2 patches)
        "--prompt",
        "a red house",
    ]
    one = xfuse_here("generate", *common, "--output", str(tmp_path / "1.png"))
    assert one.returncode == 0, one.stderr
    sp = on_ranks(ranks, "generate", *common, "--set", "parallel.ulysses_degree=2",
                  "--output", str(tmp_path / "sp.png"))  # fmt: skip
    assert sp.returncode == 0, sp.stderr[-3000:]
    assert "ulysses qkv" in sp.stdout  # the summary's bytes sent, by kind
    a, b = (np.asarray(Image.open(tmp_path / name)).astype(int) for name in ("1.png", "sp.png"))
    assert a.shape == b.shape and np.abs(a - b).max() <= 1


def test_generate_with_the_text_encoder_split_draws_the_same_image(ranks, tmp_path):
    """``parallel.text_encoder: split`` from the command line (a preset: ``from_pipe`` shards the loaded encoder):
    FLUX.2 [klein]'s Qwen3 over the two pipeline ranks, its messages in the summary, the PNG of the encoder kept on
    rank 0 bit for bit; the summary names the placement."""
    common = ["--config", "configs/tiny/pp2.yaml", "--set", "model=flux2-klein-tiny", "--set",
              "parallel.placement=linear", "--set", "generation.num_inference_steps=2", "--set",
              "parallel.warmup_steps=2"]  # fmt: skip
    runs = {}
    for placement in ("rank0", "split"):
        runs[placement] = on_ranks(ranks, "generate", *common, "--set", f"parallel.text_encoder={placement}",
                                   "--output", str(tmp_path / f"{placement}.png"))  # fmt: skip
        assert runs[placement].returncode == 0, runs[placement].stderr[-3000:]
        assert f"; text encoders {placement})" in runs[placement].stdout
    assert "text-encoder-layers" in runs["split"].stdout and "text-encoder" not in runs["rank0"].stdout
    a, b = (np.asarray(Image.open(tmp_path / f"{name}.png")) for name in ("rank0", "split"))
    assert np.array_equal(a, b)


def test_generate_with_yaml_and_overrides(ranks, tmp_path):
    target = tmp_path / "pp2.png"
    overrides = ["parallel.placement=linear", "generation.height=192", "parallel.num_patches=3"]
    sets = [arg for value in overrides for arg in ("--set", value)]
    out = on_ranks(ranks, "generate", "--config", "configs/tiny/pp2.yaml", *sets, "--output", str(target),
                   "--trace", str(tmp_path / "trace.json"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"wrote {target}: 256x192" in out.stdout and "linear, 3 patches" in out.stdout
    assert "rank 0 sent" in out.stdout and "skip" in out.stdout  # linear sends skips
    assert np.asarray(Image.open(target)).shape == (192, 256, 3)
    # The merged timeline: both ranks, compute spans per segment and patch that never overlap on a rank.
    events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        compute = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in spans if e["pid"] == rank and e["tid"] == 0)
        # configs/tiny/pp2.yaml has 8 steps: 1 whole-image warm-up step in its two CFG batch parts, then 7 steps x 3
        # patches per rank (rank 0's collect tasks, which only receive the final latents, are waits, not compute),
        # each pipelined step's per-step work prepared after the rank's last task of the step before
        names = [name.split(" blocks")[0] for *_, name in compute]
        assert len(compute) == 2 + 7 * 4
        assert names[:4] == ["s0 whole b0", "s0 whole b1", "s1 prepare", "s1 p0"]
        for step in range(1, 8):
            assert names.count(f"s{step} prepare") == 1 and names.index(f"s{step} prepare") < names.index(f"s{step} p0")
            assert step == 1 or names.index(f"s{step - 1} p2") < names.index(f"s{step} prepare")
        assert all(a[1] <= b[0] + 1 for a, b in pairwise(compute))
        waits = [e["name"] for e in spans if e["tid"] == 1 and e["pid"] == rank]  # the communication track
        assert waits and (rank == 1 or sum(name == "recv latent from r1" for name in waits) >= 3)
        (loop,) = [e for e in spans if e["tid"] == 2 and e["pid"] == rank]  # one denoising loop span per call
        assert loop["ts"] <= compute[0][0] and compute[-1][1] <= loop["ts"] + loop["dur"] + 1


def test_generate_and_plan_report_step_caching(ranks, tmp_path):
    """With a cache section, xfuse plan says what caching does with the plan and xfuse generate how many steps it
    computed and skipped (both ranks having taken the same decisions: the run succeeds)."""
    sets = ["--set", "cache.method=first_block", "--set", "cache.threshold=0.4", "--set", "cache.warmup_steps=2"]
    out = xfuse_here("plan", "--config", "configs/tiny/pp2.yaml", *sets)
    assert out.returncode == 0, out.stderr
    assert (
        "step cache: first_block, threshold 0.4: block 0 always runs; each step's first patch decides after it and "
        "carries the decision with its hand-offs (a 1-element message); steps 0-1 always computed, at most 6 of 8 "
        "skipped"
    ) in out.stdout
    out = on_ranks(ranks, "generate", "--config", "configs/tiny/pp2.yaml", *sets, "--output",
                   str(tmp_path / "c.png"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("step cache (first_block, threshold 0.4): ")]
    computed, skipped = map(int, re.fullmatch(r".*: (\d+) of 8 steps computed, (\d+) skipped .*", line).groups())
    assert computed + skipped == 8 and computed >= 2 and skipped >= 1, line
    assert line.endswith("(every patch takes its step's branch)")


def test_generate_refuses_a_world_that_does_not_match():
    """A launcher that started fewer ranks than the config needs (torchrun with 1 for pp2); without a launcher,
    ``xfuse generate`` starts the 2 ranks itself (tests/launch/test_launcher.py)."""
    out = torchrun("-m", "xfuse", "generate", "--config", os.path.abspath("configs/tiny/pp2.yaml"), nproc=1)
    assert out.returncode != 0
    assert "must equal the world size (1); start 2 ranks (xfuse ... --nproc-per-node 2, or " in out.stderr
    assert "torchrun --nproc_per_node=2)" in out.stderr


def test_generate_refuses_a_missing_file_by_name_before_any_rank_talks(ranks, tmp_path):
    """The files a config names (generation.lora, image, controlnet, control_image) are checked where generate starts
    (``xfuse.build.check_files``): exit 2 naming the key, from the launcher before it starts the ranks, and from every
    rank of a launched world before any communication (on the module's world: under torchrun the first rank to exit
    gets the other killed, sometimes before it has printed)."""
    image = str(tmp_path / "control.png")
    Image.new("RGB", (64, 64)).save(image)
    cases = [
        (["--lora", "/nowhere/a.safetensors"], "generation.lora: no LoRA file or folder at '/nowhere/a.safetensors'"),
        (["--image", "/nowhere/first.png"], "generation.image: must be an image file, the first frame of an"),
        (["--set", "generation.controlnet=/nowhere", "--set", f"generation.control_image={image}"],
         "generation.controlnet: must be a local diffusers ControlNet folder, with config.json"),
    ]  # fmt: skip
    for args, says in cases:  # pp2 without a launcher: xfuse starts the 2 ranks itself, after the check
        out = xfuse("generate", "--config", "configs/tiny/pp2.yaml", *args, timeout=60)
        assert out.returncode == 2 and says in out.stderr, out.stderr[-2000:]
        assert "rank 1" not in out.stderr and "Traceback" not in out.stderr
    out = on_ranks(ranks, "generate", "--config", "configs/tiny/pp2.yaml", *cases[0][0])
    assert out.returncode == 2
    for rank in (0, 1):
        assert f"xfuse generate: rank {rank}: error: {cases[0][1]}" in out.stderr, out.stderr[-2000:]


def test_the_hunyuandit_example_runs_under_torchrun(tmp_path):
    """The examples' launch as their docstrings give it (this one also destroys the group it made when it is done);
    the other examples' case is their code, run on the module's world below."""
    out = torchrun(os.path.abspath("examples/hunyuandit_pipefusion.py"), "--model", "tiny", "--steps", "2", "--size",
                   "128", "--output", str(tmp_path / "out.png"), cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"wrote {tmp_path / 'out.png'}" in out.stdout
    assert len(list(tmp_path.glob("*.png"))) == 1


@pytest.mark.parametrize(
    "script,args",
    [
        ("examples/from_diffusers.py", ["tiny"]),
        ("examples/pixart_pipefusion.py", ["--model", "pixart-tiny", "--steps", "2", "--output"]),
        ("examples/sd3_pipefusion.py", ["--model", "sd35-tiny", "--steps", "2", "--output"]),
        (
            "examples/flux_pipefusion.py",
            ["--model", "flux-tiny", "--steps", "2", "--true-cfg", "2", "--negative-prompt", "dark", "--output"],
        ),
    ],
)
def test_examples_run_on_two_ranks(ranks, tmp_path, script, args):
    args = [*args, str(tmp_path / "out.png")] if args[-1] == "--output" else args
    out = script_on_ranks(ranks, os.path.abspath(script), args, str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "wrote" in out.stdout
    assert len(list(tmp_path.glob("*.png"))) == 1


def test_the_video_example_writes_a_clip_on_two_ranks(ranks, tmp_path):
    script = os.path.abspath("examples/wan_pipefusion.py")
    args = ["--model", "wan-tiny", "--steps", "2", "--height", "64", "--width", "96", "--frames", "9"]
    out = script_on_ranks(ranks, script, [*args, "--output", str(tmp_path / "c.mp4")], str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"wrote {tmp_path / 'c.mp4'}: 9 frames at 16 fps (temporal patches)" in out.stdout
    assert (tmp_path / "c.mp4").stat().st_size > 1000
    # Image-to-video with the TI2V preset: 32 px per token.
    Image.new("RGB", (224, 128), (200, 40, 40)).save(tmp_path / "first.png")
    args = ["--model", "wan2.2-ti2v-tiny", "--steps", "2", "--height", "128", "--width", "224", "--frames", "9",
            "--image", str(tmp_path / "first.png"), "--patches", "spatial"]  # fmt: skip
    out = script_on_ranks(ranks, script, [*args, "--output", str(tmp_path / "i.mp4")], str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"wrote {tmp_path / 'i.mp4'}: 9 frames at 16 fps (spatial patches)" in out.stdout


def test_doctor_reports_and_passes_its_self_test():
    out = xfuse_here("doctor")  # its self-test's two ranks are spawned processes of their own
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("xfuse 0.1.0, torch ") and "backends: gloo yes" in out.stdout
    assert "flash-attn: " in out.stdout and "attention: torch SDPA" in out.stdout
    assert lines[-1].startswith("self-test: 2-rank gloo p2p on loopback") and lines[-1].split(": ")[-1].startswith(
        "PASS"
    )


def test_doctor_self_test_fails_on_a_missing_interface():
    out = cli_here(["doctor", "--timeout", "5"], env={"GLOO_SOCKET_IFNAME": "nope0"})  # its spawned ranks read it
    assert out.returncode == 1
    assert "GLOO_SOCKET_IFNAME=nope0" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("self-test: 2-rank gloo p2p on loopback: FAIL")


def test_plan_and_generate_detect_pixart_from_the_folder(ranks, tmp_path):
    from xfuse.families.pixart.presets import save_preset_pipeline

    folder = save_preset_pipeline(tmp_path / "pixart")
    planned = xfuse_here("plan", "--set", f"model={folder}", "--set", "parallel.pipefusion_degree=2")
    assert planned.returncode == 0, planned.stderr
    assert "(pixart-sigma): 8 blocks" in planned.stdout and "placement linear" in planned.stdout
    assert "cross-rank skips: none" in planned.stdout and "the T5 text is static" in planned.stdout
    output = tmp_path / "pixart.png"
    settings = ("parallel.pipefusion_degree=2", "generation.height=128", "generation.width=96")
    sets = [arg for value in (*settings, "generation.num_inference_steps=3") for arg in ("--set", value)]
    generated = on_ranks(ranks, "generate", "--set", f"model={folder}", *sets, "--output", str(output))
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert f"wrote {output}: 96x128, 3 steps" in generated.stdout and "linear" in generated.stdout
    assert np.asarray(Image.open(output)).shape == (128, 96, 3)


@pytest.mark.parametrize(
    "preset, family, blocks",
    [("sd35-tiny", "sd3", "4 blocks"), ("flux-tiny", "flux", "5 blocks")],
)
def test_plan_and_generate_detect_the_mmdit_families_from_the_folder(ranks, tmp_path, preset, family, blocks):
    """SD3.5 and FLUX folders: the family from model_index.json, the text stream in the plan, a PNG on 2 ranks."""
    from xfuse.families.registry import PRESET_MODELS

    folder = PRESET_MODELS[preset].save_preset_pipeline(tmp_path / preset, preset)
    planned = xfuse_here("plan", "--set", f"model={folder}", "--set", "parallel.pipefusion_degree=2")
    assert planned.returncode == 0, planned.stderr
    assert f"({family}): {blocks}" in planned.stdout and "placement linear" in planned.stdout
    assert "sent text" in planned.stdout and "the text stream" in planned.stdout
    output = tmp_path / f"{preset}.png"
    settings = ("parallel.pipefusion_degree=2", "generation.height=128", "generation.width=96")
    sets = [arg for value in (*settings, "generation.num_inference_steps=3") for arg in ("--set", value)]
    generated = on_ranks(ranks, "generate", "--set", f"model={folder}", *sets, "--output", str(output))
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert f"wrote {output}: 96x128, 3 steps" in generated.stdout
    assert np.asarray(Image.open(output)).shape == (128, 96, 3)


def test_plan_prints_the_vae_decode_where_it_runs_its_memory_and_the_whole_image_tensors():
    """The plan's VAE decode (xfuse.perf.vae): the shipped model's VAE at 256 px stays on rank 0 under auto, and is
    costed over both ranks all the same; on, it decodes in bands; --device costs it on that device."""
    out = xfuse_here("plan", "--config", "configs/shapes/pp2.yaml", "--device", "cpu", "--link", "gloo")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert (
        "VAE decode: AutoencoderKL [16, 32, 64, 64], layers_per_block 1, 4 latent channels, x8; 8.05 GFLOP per image; "
        "weights 3.73 MiB on rank(s) 0-1\nthis request decodes on rank 0 alone (auto: 256x256 px is below 384x384;"
    ) in text
    assert "predicted decode (CPU rank (1 thread, fp32), gloo on loopback (2 cores)): rank 0 alone " in text
    assert "; over 2 ranks " in text and " + 51 exchanges " in text
    rows = re.findall(r"^ +(\d) +\[(\d+),(\d+)\) +3\.73 MiB +([\d.]+ MiB|-) +([\d.]+) MiB$", text, re.MULTILINE)
    assert [row[:3] for row in rows] == [("0", "0", "16"), ("1", "16", "32")], text
    alone, bands = float(rows[0][3].split()[0]), [float(row[4]) for row in rows]
    assert rows[1][3] == "-" and all(band < alone / 1.5 for band in bands)  # a band holds well under the whole
    assert (
        "whole-image tensors, on rank 0 only however the decode is split: final latents (1, 4, 32, 32) 0.02 MiB; "
        "decoded image (1, 3, 256, 256) 0.75 MiB (twice while rank 0 joins the bands); post-processed (float32, "
        "NHWC) (1, 256, 256, 3) 0.75 MiB; uint8 pixels (PIL, PNG) (1, 256, 256, 3) 0.19 MiB"
    ) in text
    on = xfuse_here("plan", "--config", "configs/shapes/pp2.yaml", "--set", "parallel.vae_parallel=on",
                    "--device", "a100")  # fmt: skip
    assert on.returncode == 0, on.stderr
    assert "this request decodes in row bands over the 2 ranks (parallel.vae_parallel on;" in on.stdout
    assert "predicted decode (A100 SXM 80GB, A100 NVLink 3 / NVSwitch): rank 0 alone " in on.stdout
    assert "convolution workspaces not counted" in on.stdout


def test_generate_decodes_over_both_ranks_from_512_px_and_reports_each_ranks_memory(ranks, tmp_path):
    """``vae_parallel: auto`` at 512 x 512 px on 2 ranks: the summary says the decode ran on both, each rank sent its
    share of the decode's messages and reports its peak memory; the PNG is the one rank 0 decodes alone (``off``),
    up to one level of rounding in a pixel."""
    common = ["--config", "configs/tiny/pp2.yaml", "--set", "generation.num_inference_steps=2",
              "--set", "generation.height=512", "--set", "generation.width=512"]  # fmt: skip
    bands = on_ranks(ranks, "generate", *common, "--output", str(tmp_path / "bands.png"))
    assert bands.returncode == 0, bands.stderr[-3000:]
    assert "; VAE decode on 2 rank(s); text encoders rank0)" in bands.stdout
    for rank in (0, 1):
        line = next(line for line in bands.stdout.splitlines() if line.startswith(f"  rank {rank} sent"))
        assert "vae halo" in line and "vae kv" in line and re.search(r"peak RSS \d+ MiB", line), line
        assert re.search(r"; decode: sent \d+\.\d\d MiB, \+\d+ MiB resident at its peak$", line), line
    alone = on_ranks(ranks, "generate", *common, "--set", "parallel.vae_parallel=off",
                     "--output", str(tmp_path / "alone.png"))  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "; VAE decode on 1 rank(s); text encoders rank0)" in alone.stdout and "vae halo" not in alone.stdout
    a, b = (np.asarray(Image.open(tmp_path / name)).astype(int) for name in ("bands.png", "alone.png"))
    assert a.shape == b.shape == (512, 512, 3) and np.abs(a - b).max() <= 1


def test_generate_with_regional_compile_draws_the_eager_image_and_says_what_it_compiled(ranks, tmp_path):
    """``compile.mode: regional`` on two ranks (``aot_eager``: dynamo's capture without code generation, so the
    test takes seconds): the request's size compiled before it runs, each rank saying so in one line, and the
    pipelined image of the eager run. Rank 1's first compile made 8 s slower (a fault drill): rank 0, waiting on it,
    names it and what it compiles, and the run ends well (the bound is 60 s). One family: that every family's
    compiled blocks equal its eager ones is tests/multirank/test_regional_compile.py's (a FLUX.1 run here as well cost
    16 s of launch and said nothing more)."""
    common = ["--config", "configs/tiny/pp2.yaml", "--set", "generation.num_inference_steps=3",
              "--set", "compile.backend=aot_eager", "--set", "compile.timeout_s=60"]  # fmt: skip
    runs = {  # eager on the module's world; compiled on ranks of its own (dynamo's caches live in a process)
        "off": on_ranks(ranks, "generate", *common, "--set", "compile.mode=off", "--output", str(tmp_path / "off.png")),
        "regional": on_a_fresh_world(["generate", *common, "--set", "compile.mode=regional", "--output",
                                      str(tmp_path / "regional.png")], env={"XFUSE_FAULT": "slow_compile:1:8"}),
    }  # fmt: skip
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-3000:]
    stderr = runs["regional"].stderr
    lines = re.findall(r"rank (\d): compile.mode regional: shape 1 of 1 \(256x256\): (\d+) graph\(s\) in ([\d.]+) s of "
                       r"compiling; its denoising took", stderr)  # fmt: skip
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"] and all(int(n) > 0 for _, n, _ in lines), lines
    assert "compile.mode regional" not in runs["off"].stderr
    assert float(dict((rank, took) for rank, _, took in lines)["1"]) >= 8.0  # the drill's seconds are counted
    said = re.search(r"rank 0: waiting ([\d.]+) s: recv of \w+ from rank 1 at step \d+[^;]*; rank 1 is compiling "
                     r"shape 1 of 1 \(256x256\) for ([\d.]+) s", stderr)  # fmt: skip
    assert said and float(said.group(1)) >= 5.0, stderr[-3000:]
    a, b = (np.asarray(Image.open(tmp_path / f"{mode}.png"), dtype=np.int16) for mode in ("off", "regional"))
    assert np.abs(a - b).max() <= 1


COMPILE_TIMEOUT_S = 12


def test_a_rank_compiling_past_compile_timeout_s_ends_the_world_naming_itself(tmp_path):
    """The fault drill past the bound: rank 1's first compile would take 120 s more, ``compile.timeout_s`` is 12 s
    (rank 0's own compile must end within it: no warm-up step, so only the patches' shapes, 9 graphs in 1.9 s here
    alone, several times that on a loaded 2-core machine running two test modules at once). Rank 1 names itself, the
    shape and the bound within a poll of it; rank 0 (waiting on it) ends naming rank 1's failure as the world's first;
    every rank exits non-zero, long before the 120 s."""
    argv = ["generate", "--config", "configs/tiny/pp2.yaml", "--set", "generation.num_inference_steps=3",
            "--set", "parallel.warmup_steps=0", "--set", "compile.mode=regional", "--set", "compile.backend=aot_eager",
            "--set", f"compile.timeout_s={COMPILE_TIMEOUT_S}", "--output", str(tmp_path / "x.png")]  # fmt: skip
    # new rank processes that end as the command's do (the failure ends them with os._exit)
    returncode, stderr, _ = generate_on_a_fresh_world(2, argv, {"XFUSE_FAULT": "slow_compile:1:120"}, tmp_path)
    assert returncode != 0
    named = ("rank 1: CompileTimeout: rank 1: compiling shape 1 of 1 (256x256) took more than compile.timeout_s = "
             f"{COMPILE_TIMEOUT_S} s ({COMPILE_TIMEOUT_S}.")  # fmt: skip
    assert f"rank 1 failed: {named[8:]}" in stderr, stderr[-4000:]
    assert re.search(r"rank 0 (failed|stopped|terminated)[^\n]*\n(.*\n)*?  first failure in the world: "
                     + re.escape(named), stderr), stderr[-4000:]  # fmt: skip
    slowed = _clock(stderr, r"\[xfuse-fault ([\d:.]+)\] rank 1: slow_compile")
    ended = _clock(stderr, r"\[xfuse ([\d:.]+)\] rank 1 failed")
    assert 0 <= ended - slowed <= COMPILE_TIMEOUT_S + 1.0, (slowed, ended)  # the bound, and a poll of it


def _clock(text: str, pattern: str) -> float:
    """Seconds of the day of the ``HH:MM:SS.mmm`` ``pattern`` captures in ``text``."""
    hours, minutes, seconds = re.search(pattern, text).group(1).split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def test_a_second_launch_with_a_warm_compile_cache_generates_nothing(tmp_path):
    """``compile.cache_dir`` with Inductor (the backend whose artefacts a cache keeps): the first launch generates
    every graph's code, the second finds every graph in the cache and generates none, and draws the same image;
    ``xfuse doctor --compile-cache`` reports the key, its torch and the request shape. (How much faster the warm
    start is, is measured by ``benchmarks/bench_compile.py --cache``, not timed here.) No warm-up step: the patches'
    shapes alone, on PixArt-Sigma's tiny preset (rank 0: 8 graphs to generate, rank 1 finds its 6 where rank 0 put
    them; HunyuanDiT's tiny preset 9 and 4 more, FLUX.1's 22 on rank 0: 10 CPU-s more here for the same kind of
    thing cached)."""
    cache = tmp_path / "compile-cache"
    args = ["generate", "--config", "configs/tiny/pp2.yaml", "--set", "model=pixart-tiny",
            "--set", "compile.mode=regional", "--set", "generation.num_inference_steps=3",
            "--set", "parallel.warmup_steps=0",
            "--set", f"compile.cache_dir={cache}"]  # fmt: skip
    counts = {}
    for launch in ("cold", "warm"):  # each on new rank processes: nothing compiled in them, as in a new launch
        run = on_a_fresh_world([*args, "--output", str(tmp_path / f"{launch}.png")])
        assert run.returncode == 0, run.stderr[-3000:]
        found = re.findall(r"rank (\d): compile.mode regional: shape 1 of 1 \(256x256\): (\d+) graph\(s\), (\d+) from "
                           r"compile.cache_dir, (\d+) generated", run.stderr)  # fmt: skip
        assert sorted(rank for rank, *_ in found) == ["0", "1"], run.stderr[-3000:]
        counts[launch] = {rank: tuple(map(int, numbers)) for rank, *numbers in found}
    for rank in ("0", "1"):
        (graphs, cached, generated), (warm_graphs, warm_cached, warm_generated) = (
            counts["cold"][rank],
            counts["warm"][rank],
        )
        # cold: each graph generated, or found where the other rank had just put it (the ranks of a node share it)
        assert graphs > 0 and cached + generated == graphs, counts
        assert warm_graphs == graphs and warm_cached == graphs and warm_generated == 0, counts
    assert sum(generated for _, _, generated in counts["cold"].values()) > 0, counts
    a, b = (np.asarray(Image.open(tmp_path / f"{launch}.png"), dtype=np.int16) for launch in ("cold", "warm"))
    assert np.array_equal(a, b)
    doctor = xfuse_here("doctor", "--compile-cache", str(cache), "--timeout", "20")
    assert doctor.returncode == 0, doctor.stderr
    assert f"compile cache {cache}: 1 key(s)" in doctor.stdout
    key = (r": pixart-sigma \(model config \w+\), torch.float32 on cpu, inductor, dynamic false; torch \S+ "
           r"\(this torch\); 1 request shape\(s\): latents 1x4x32x32;")  # fmt: skip
    assert re.search(key, doctor.stdout), doctor.stdout
