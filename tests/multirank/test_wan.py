"""Wan, the fifth family and the first video one: ``PipeFusionWanPipeline`` against diffusers' own ``WanPipeline``
from the same folder (exact mode, both patch directions, degrees 2-4, CFG batched and parallel, sequence parallel),
and the pipelined engine against the independent oracle (``tests.support.pipefusion_oracle``'s video reference).

Clips are 9 frames (3 latent frames) of 64 x 96 px (4 x 6 token rows per frame: 12 stacked token rows), so M = N + 1
bands never fall on frame boundaries alike in both directions and the bands are uneven.
"""

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from PIL import Image

from tests.support.pipefusion_oracle import pipefusion_video_reference
from tests.support.pipeline_fns import check_against_diffusers as check
from tests.support.pipeline_fns import log_callback, reference_runner, run_calls
from tests.support.wan_fns import (
    calls_with_one_timestep,
    calls_without_scheduler_merge,
    load_error,
    prepare_image_inputs,
    prepare_inputs,
    run_engine,
    tiny_wan,
)
from tests.support.world import World
from xfuse.families.registry import model_spec
from xfuse.families.wan.presets import save_preset_pipeline
from xfuse.families.wan.spec import WAN

HEIGHT, WIDTH, FRAMES, STEPS = 64, 96, 9, 3
DIRECTIONS = ("temporal", "spatial")
BASE = dict(
    prompt="a red ball rolls across a table",
    height=HEIGHT,
    width=WIDTH,
    num_frames=FRAMES,
    num_inference_steps=STEPS,
    output_type="np",
)
EXACT = {"warmup_steps": 100}


def rel_max(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset_pipeline(tmp_path_factory.mktemp("wan") / "Wan2.1-T2V-tiny")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_runner(WanPipeline.from_pretrained(folder, local_files_only=True))


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


def honoured_calls(reference):
    """Every ``WanPipeline.__call__`` argument, each in a call diffusers runs too."""
    with torch.no_grad():
        emb, neg = reference.pipe.encode_prompt("a red ball", negative_prompt="blurry", device="cpu")
    return {
        "base": {},
        "no_guidance": dict(guidance_scale=1.0),
        "batch_and_videos": dict(prompt=["a red ball", "a cat"], num_videos_per_prompt=2, negative_prompt="dark"),
        "size_frames_steps": dict(height=96, width=64, num_frames=13, num_inference_steps=2, guidance_scale=3.0),
        "latents": dict(latents=torch.randn(1, 4, 3, 8, 12, generator=torch.Generator().manual_seed(7))),
        "prompt_embeds": dict(prompt=None, prompt_embeds=emb, negative_prompt_embeds=neg),
        "max_sequence_length": dict(max_sequence_length=20),
        "callback": dict(callback_on_step_end=log_callback),
        "output_pil": dict(output_type="pil"),
        "output_latent": dict(output_type="latent"),
        "return_tuple": dict(return_dict=False),
        "seed": dict(seed=3),
    }


def check_against_diffusers(per_rank, calls, reference):
    check(per_rank, calls, reference, BASE, output_class="WanPipelineOutput", callback_steps=list(range(STEPS)))


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_argument_honoured_at_pp4(world4, folder, reference, direction):
    calls = honoured_calls(reference)
    parallel = {"pipefusion_degree": 4, "num_patches": 5, "video_patches": direction, **EXACT}
    results = world4.run_ok(
        run_calls, folder, parallel, [{**BASE, **c} for c in calls.values()], family="wan", timeout=600
    )
    check_against_diffusers(results, calls, reference)


LAYOUTS = {
    "cfg2_pp2": {"cfg_degree": 2, "pipefusion_degree": 2, "num_patches": 3},
    "pp2_ulysses2": {"pipefusion_degree": 2, "ulysses_degree": 2, "num_patches": 3},
    "pp2_ring2": {"pipefusion_degree": 2, "ring_degree": 2, "num_patches": 2},
    "ulysses2_ring2": {"ulysses_degree": 2, "ring_degree": 2},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hybrid_layouts_equal_diffusers(world4, folder, reference, layout):
    """CFG parallel, and sequence parallel (Ulysses, Ring, both) inside each PipeFusion stage; spatial patches."""
    calls = {k: v for k, v in honoured_calls(reference).items() if k in ("base", "batch_and_videos", "callback")}
    parallel = {**LAYOUTS[layout], "video_patches": "spatial", **EXACT}
    results = world4.run_ok(
        run_calls, folder, parallel, [{**BASE, **c} for c in calls.values()], family="wan", timeout=600
    )
    check_against_diffusers(results, calls, reference)


def test_refusals_name_the_argument_on_every_rank(world4, folder):
    calls = [
        {**BASE, "num_frames": 10},  # diffusers rounds it to 9 with a warning
        {**BASE, "height": 72},  # diffusers' check_inputs refuses it too
        {**BASE, "attention_kwargs": {"scale": 0.5}},
        {**BASE, "guidance_scale_2": 3.0},  # a second expert's scale, without one
        {**BASE, "latents": torch.zeros(1, 4, 2, 8, 12)},  # 2 latent frames for 9 frames (3)
    ]
    results = world4.run_ok(run_calls, folder, {"pipefusion_degree": 4, **EXACT}, calls, family="wan", timeout=300)
    for rank_results in results:  # the same error on every rank, before any communication
        kinds = [(r["kind"], r.get("message", "")) for r in rank_results]
        assert all(kind == "error" for kind, _ in kinds), kinds
        assert kinds == [(k, m) for k, m in [(r["kind"], r.get("message", "")) for r in results[0]]]
    messages = [r["message"] for r in results[0]]
    assert messages[0].startswith("num_frames: must be 4k + 1 (WanPipeline's VAE keeps the first frame")
    assert messages[0].endswith("e.g. 9 or 13 (got 10)")
    assert messages[1] == "`height` and `width` have to be divisible by 16 but are 72 and 96."
    assert messages[2].startswith("attention_kwargs is not supported by PipeFusion")
    assert "guidance_scale_2" in messages[3]
    assert messages[4].startswith("latents must be a tensor of shape (1, 4, 3, 8, 12)")


# --- the engine on real ranks against the oracle -----------------------------------------------------------------


_ORACLE = {}


def oracle(direction, num_patches, warmup):
    key = (direction, num_patches, warmup)
    if key not in _ORACLE:
        pipe = tiny_wan()
        inputs = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, num_frames=FRAMES, steps=STEPS, guidance_scale=5.0)
        _ORACLE[key] = pipefusion_video_reference(
            pipe, inputs, direction=direction, num_patches=num_patches, warmup=warmup
        )
    return _ORACLE[key]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("degree", [2, 3, 4])
def test_pipelined_equals_the_oracle(world4, degree, direction):
    """UniPC (multistep state kept per patch) with M = 2 and N + 1 (uneven bands), warm-up 0 and 1."""
    size = dict(height=HEIGHT, width=WIDTH, num_frames=FRAMES, steps=STEPS, guidance_scale=5.0)
    for num_patches in sorted({2, degree + 1}):
        for warmup in (0, 1):
            out = world4.run_ok(run_engine, degree, direction, num_patches, warmup, **size)[0]
            assert rel_max(out, oracle(direction, num_patches, warmup)) <= 1e-5, (num_patches, warmup)
    assert rel_max(oracle(direction, 2, 1), oracle(direction, 1, STEPS)) > 1e-4  # stale K/V matter here


def test_the_oracle_tells_the_directions_apart():
    """Temporal and spatial bands are different patches (different K/V stale at each pass): the oracle gives
    different latents, so each direction's engine result above is checked against its own semantics."""
    assert rel_max(oracle("temporal", 3, 1), oracle("spatial", 3, 1)) > 1e-4


@pytest.fixture(scope="module")
def world3():
    with World(3, start_timeout=240) as w:
        yield w


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pp3_from_the_folder(world3, folder, reference, direction):
    """An odd degree: 4 blocks as 2 + 1 + 1; M = 4 bands of the 12 stacked rows (and of 16 for 13 frames)."""
    keep = ("base", "no_guidance", "size_frames_steps")
    calls = {k: v for k, v in honoured_calls(reference).items() if k in keep}
    parallel = {"pipefusion_degree": 3, "num_patches": 4, "video_patches": direction, **EXACT}
    results = world3.run_ok(
        run_calls, folder, parallel, [{**BASE, **c} for c in calls.values()], family="wan", timeout=600
    )
    check_against_diffusers(results, calls, reference)


# --- Wan 2.2: two experts -----------------------------------------------------------------------------------------

# 6 steps of the release's shift 12: timesteps 999, 983, 960, 923 are the high-noise expert's (>= 875), 857 and 707
# the low-noise one's; with warm-up 1 each expert has a whole step and pipelined ones.
EXPERTS = dict(BASE, num_inference_steps=6, guidance_scale=4.0, guidance_scale_2=3.0)


@pytest.fixture(scope="module")
def folder22(tmp_path_factory):
    return save_preset_pipeline(tmp_path_factory.mktemp("wan22") / "Wan2.2-T2V-tiny", "wan2.2-tiny")


@pytest.fixture(scope="module")
def reference22(folder22):
    return reference_runner(WanPipeline.from_pretrained(folder22, local_files_only=True))


@pytest.mark.parametrize("layout", ["pp4", "cfg2_pp2"])
def test_two_experts_exact_mode_equals_diffusers(world4, folder22, reference22, layout):
    """Each rank holds its blocks of both experts (read from transformer/ and transformer_2/); the switch at the
    boundary, guidance_scale_2, callbacks numbered through both, no guidance."""
    calls = {
        "base": {},
        "callback": dict(callback_on_step_end=log_callback),
        "no_guidance": dict(guidance_scale=1.0, guidance_scale_2=None),
        "output_latent": dict(output_type="latent"),
    }
    parallel = {"pipefusion_degree": 4, "num_patches": 5} if layout == "pp4" else LAYOUTS["cfg2_pp2"]
    if layout == "cfg2_pp2":  # CFG parallelism needs guidance
        calls.pop("no_guidance")
    results = world4.run_ok(
        run_calls, folder22, {**parallel, **EXACT}, [{**EXPERTS, **c} for c in calls.values()], family="wan"
    )
    check(results, calls, reference22, EXPERTS, output_class="WanPipelineOutput", callback_steps=list(range(6)))


def two_expert_oracle(folder22, direction, num_patches):
    pipe = WanPipeline.from_pretrained(folder22, local_files_only=True)
    inputs = prepare_inputs(
        pipe, height=HEIGHT, width=WIDTH, num_frames=FRAMES, steps=6, guidance_scale=4.0, prompt=BASE["prompt"]
    )
    return pipefusion_video_reference(
        pipe, {**inputs, "guidance_scale_2": 3.0}, direction=direction, num_patches=num_patches, warmup=1
    )


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_two_experts_pipelined_equals_the_oracle(world4, folder22, reference22, direction):
    """Pipelined (warm-up 1 per expert, M = 5 at pp4): the pipeline class equals the oracle's two-expert semantics;
    with the scheduler's state not handed from the first expert's patches to the second (an injected bug) it does
    not."""
    call = dict(EXPERTS, output_type="latent")
    parallel = {"pipefusion_degree": 4, "num_patches": 5, "warmup_steps": 1, "video_patches": direction}
    out = world4.run_ok(run_calls, folder22, parallel, [call], family="wan")[0][0]
    oracle_latents = two_expert_oracle(folder22, direction, 5)
    assert rel_max(torch.from_numpy(out["images"]), oracle_latents) <= 1e-5
    assert rel_max(oracle_latents, torch.from_numpy(reference22(call)[0])) > 1e-4  # stale K/V matter here
    broken = world4.run_ok(calls_without_scheduler_merge, folder22, parallel, [call])[0][0]
    assert rel_max(torch.from_numpy(broken["images"]), oracle_latents) > 1e-3


# --- Wan 2.2 TI2V-5B: the 16 px VAE, text-to-video and image-to-video on one transformer ---------------------------

# 128 x 224 px at 32 px per token (VAE 16 x patch 2): 4 x 7 tokens per latent frame, 3 latent frames.
TI2V = dict(BASE, height=128, width=224)
IMAGE = Image.fromarray((np.random.RandomState(0).rand(128, 224, 3) * 255).astype(np.uint8))
I2V = "PipeFusionWanImageToVideoPipeline"


@pytest.fixture(scope="module")
def folder_ti2v(tmp_path_factory):
    return save_preset_pipeline(tmp_path_factory.mktemp("ti2v") / "Wan2.2-TI2V-tiny", "wan2.2-ti2v-tiny")


@pytest.fixture(scope="module")
def reference_i2v(folder_ti2v):
    return reference_runner(WanImageToVideoPipeline.from_pretrained(folder_ti2v, local_files_only=True))


def test_ti2v_folders_have_the_vae_factor_of_their_vae(folder_ti2v):
    """The 5B's VAE is 16 px per latent pixel (AutoencoderKLWan's scale_factor_spatial); a Wan 2.1 folder's is 8."""
    assert model_spec(folder_ti2v).vae_scale_factor == model_spec("wan2.2-ti2v-5b").vae_scale_factor == 16
    assert model_spec(folder_ti2v).latent_scale * 2 == 32 and model_spec("wan-tiny") is WAN


def test_ti2v_text_to_video_equals_diffusers(world4, folder_ti2v):
    """WanPipeline with expand_timesteps: every token at the step's timestep, 48-channel-style latents at 16 px."""
    reference = reference_runner(WanPipeline.from_pretrained(folder_ti2v, local_files_only=True))
    calls = {"base": {}, "no_guidance": dict(guidance_scale=1.0), "callback": dict(callback_on_step_end=log_callback)}
    parallel = {"pipefusion_degree": 4, "num_patches": 5, "video_patches": "spatial", **EXACT}
    results = world4.run_ok(run_calls, folder_ti2v, parallel, [{**TI2V, **c} for c in calls.values()], family="wan")
    check(results, calls, reference, TI2V, output_class="WanPipelineOutput", callback_steps=list(range(STEPS)))


I2V_LAYOUTS = {
    "pp4_temporal": {"pipefusion_degree": 4, "num_patches": 5, "video_patches": "temporal"},
    "pp4_spatial": {"pipefusion_degree": 4, "num_patches": 5, "video_patches": "spatial"},
    "cfg2_pp2": {**LAYOUTS["cfg2_pp2"], "video_patches": "spatial"},
    "pp2_ulysses2": {**LAYOUTS["pp2_ulysses2"], "video_patches": "spatial"},
}


@pytest.mark.parametrize("layout", sorted(I2V_LAYOUTS))
def test_image_to_video_equals_diffusers(world4, folder_ti2v, reference_i2v, layout):
    """WanImageToVideoPipeline on the TI2V folder: the image's latents as the first frame of every input, its tokens
    at timestep 0 (bands with both timesteps: per-token modulation), the clip's first frame the image's."""
    calls = {
        "base": {},
        "batch_and_videos": dict(prompt=["a red ball", "a cat"], num_videos_per_prompt=2, negative_prompt="dark"),
        "callback": dict(callback_on_step_end=log_callback),
        "output_latent": dict(output_type="latent"),
    }
    if layout == "pp4_temporal":
        calls |= {"no_guidance": dict(guidance_scale=1.0), "frames_steps": dict(num_frames=13, num_inference_steps=2)}
    base = dict(TI2V, image=IMAGE)
    results = world4.run_ok(
        run_calls, folder_ti2v, {**I2V_LAYOUTS[layout], **EXACT}, [{**base, **c} for c in calls.values()],
        family="wan", pipeline=I2V, timeout=600,
    )  # fmt: skip
    check(results, calls, reference_i2v, base, output_class="WanPipelineOutput", callback_steps=list(range(STEPS)))


def image_oracle(reference_i2v, direction):
    inputs = prepare_image_inputs(reference_i2v.pipe, IMAGE, height=128, width=224, num_frames=FRAMES, steps=STEPS,
                                  guidance_scale=5.0, prompt=BASE["prompt"])  # fmt: skip
    return pipefusion_video_reference(reference_i2v.pipe, inputs, direction=direction, num_patches=5, warmup=1)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_image_to_video_pipelined_equals_the_oracle(world4, folder_ti2v, reference_i2v, direction):
    """Pipelined (warm-up 1, M = 5 at pp4) equals the oracle, which runs diffusers' forward with a 2-D timestep per
    box; with every token at the step's timestep (the per-token timesteps dropped: an injected bug) it does not."""
    call = dict(TI2V, image=IMAGE, output_type="latent")
    parallel = {"pipefusion_degree": 4, "num_patches": 5, "warmup_steps": 1, "video_patches": direction}
    out = world4.run_ok(run_calls, folder_ti2v, parallel, [call], family="wan", pipeline=I2V)[0][0]
    expected = image_oracle(reference_i2v, direction)
    assert rel_max(torch.from_numpy(out["images"]), expected) <= 1e-5
    assert rel_max(expected, torch.from_numpy(reference_i2v(call)[0])) > 1e-4  # stale K/V matter here
    broken = world4.run_ok(calls_with_one_timestep, folder_ti2v, parallel, [call])[0][0]
    assert rel_max(torch.from_numpy(broken["images"]), expected) > 1e-3


def test_image_to_video_refusals_name_the_argument_on_every_rank(world4, folder_ti2v, folder):
    base = dict(TI2V, image=IMAGE)
    calls = [
        {**base, "image_embeds": torch.zeros(1, 257, 32)},
        {**base, "last_image": IMAGE},
        {**base, "height": 112},  # a multiple of diffusers' 16, not of 32 px per token (diffusers rounds it down)
        {**base, "image": None},
    ]
    results = world4.run_ok(run_calls, folder_ti2v, {"pipefusion_degree": 4, **EXACT}, calls, family="wan",
                            pipeline=I2V)  # fmt: skip
    for rank_results in results:  # the same error on every rank, before any communication
        assert [r["kind"] for r in rank_results] == ["error"] * len(calls)
        assert [r["message"] for r in rank_results] == [r["message"] for r in results[0]]
    messages = [r["message"] for r in results[0]]
    assert messages[0].startswith("image_embeds is not supported by PipeFusion"), messages[0]
    assert messages[1].startswith("last_image is not supported by PipeFusion"), messages[1]
    assert messages[2].startswith("generation.height: must be a positive multiple of 32 pixels (VAE factor 16")
    assert messages[3].startswith("Provide either `image` or `prompt_embeds`. Cannot leave both `image` and")
    # A Wan 2.1 folder (no expand_timesteps) is refused by the image-to-video class on every rank, at load.
    refused = world4.run_ok(load_error, folder, I2V)
    assert all(message == refused[0] for message in refused)
    assert refused[0].startswith("xfuse runs image-to-video with Wan 2.2 TI2V folders (expand_timesteps")


# ---------------------------------------------------------------------------------- the decode over the world
def assert_same_levels(levels: np.ndarray, expected: np.ndarray) -> None:
    """uint8 frames equal up to float rounding: one level at most (a pixel within 1e-4 of a rounding boundary)."""
    diff = np.abs(levels.astype(int) - expected.astype(int))
    assert diff.max() <= 1, (diff.max(), int((diff > 0).sum()))


DECODES = {  # (folder fixture, call, pipeline, layout): latent rows 8 for 4 ranks in both (Wan 2.1's 8 px, 2.2's 16)
    "t2v_cfg2_pp2": ("folder", BASE, None, LAYOUTS["cfg2_pp2"]),
    "i2v_pp4": ("folder_ti2v", dict(TI2V, image=IMAGE), I2V, I2V_LAYOUTS["pp4_spatial"]),
}


@pytest.mark.parametrize("case", sorted(DECODES))
def test_decoding_over_the_world_equals_rank_0_alone(world4, request, case):
    """``vae_parallel: on`` decodes the clip in bands on all 4 ranks (Wan 2.1's VAE; Wan 2.2's for image-to-video)
    and gives the frames of ``off``, where rank 0 decodes alone: float frames within 1e-4, uint8 frames within one
    level; a batch of two videos."""
    name, base, pipeline, layout = DECODES[case]
    folder = request.getfixturevalue(name)
    calls = [{**base, "output_type": "np"}, {**base, "output_type": "pil", "num_videos_per_prompt": 2}]
    frames = {}
    for mode in ("on", "off"):
        parallel = {**layout, "video_patches": "spatial", "warmup_steps": 1, "vae_parallel": mode}
        results = world4.run_ok(run_calls, folder, parallel, calls, family="wan", pipeline=pipeline, timeout=600)
        assert [r["kind"] for r in results[0]] == ["ok", "ok"], results[0]
        bands = mode == "on"  # on: every rank decoded its band and sent halo rows; off: no decode message anywhere
        assert all(r["decode_ranks"] == (4 if bands else 1) for rank in results for r in rank)
        assert all(("vae halo" in r["sent"]) is bands and ("vae kv" in r["sent"]) is bands for rank in results
                   for r in rank)  # fmt: skip
        frames[mode] = [r["images"] for r in results[0]]
    (unit_on, levels_on), (unit_off, levels_off) = frames["on"], frames["off"]
    assert unit_on.shape == unit_off.shape and levels_on.shape == levels_off.shape == (2, FRAMES, *unit_on.shape[2:])
    assert np.abs(unit_on - unit_off).max() <= 1e-4
    assert_same_levels(levels_on, levels_off)
