"""The generic family (``xfuse.families.generic``): FLUX.1 and Wan run through their own diffusers forward, context-
parallel plan and attention dispatcher, with no hand-written stage, on real ranks. Exact mode equals diffusers'
serial loop; pipelined, each equals its hand-written family (the same algorithm: text with the step's first patch,
stale K/V of the other patches) and the independent oracle, at pp2 and pp3 with uneven bands.

Sizes as the hand-written families' tests: FLUX 128 x 96 px (8 x 6 token rows), Wan 9 frames of 64 x 96 px.
"""

import pytest

from tests.support.generic_fns import run_flux_both, run_wan_both
from tests.support.mmdit_fns import prepare_inputs, tiny
from tests.support.pipefusion_oracle import pipefusion_reference, pipefusion_video_reference
from tests.support.wan_fns import prepare_inputs as prepare_wan_inputs
from tests.support.wan_fns import tiny_wan
from tests.support.world import World

HEIGHT, WIDTH, STEPS = 128, 96, 3
FRAMES, WAN_HEIGHT = 9, 64


@pytest.fixture(scope="module")
def world3():
    with World(3, start_timeout=240) as w:
        yield w


def flux_oracle(num_patches, warmup, cfg):
    inputs = prepare_inputs(tiny("flux-tiny"), height=HEIGHT, width=WIDTH, steps=STEPS, cfg=cfg)
    return pipefusion_reference(tiny("flux-tiny"), inputs, height=HEIGHT, width=WIDTH, num_patches=num_patches,
                                warmup=warmup)  # fmt: skip


@pytest.mark.parametrize("cfg", [1.0, 2.0])  # true CFG with a negative prompt: [negative, positive] in one batch
def test_flux_through_its_own_forward_is_exact_and_equals_the_hand_written_family(world3, cfg):
    serial = flux_oracle(1, STEPS, cfg)
    for degree in (2, 3):
        generic, family = world3.run_ok(run_flux_both, degree, degree + 1, STEPS, height=HEIGHT, width=WIDTH,
                                        steps=STEPS, cfg=cfg)[0]  # fmt: skip
        assert (generic - serial).abs().max().item() <= 1e-4, degree
        assert (generic - family).abs().max().item() <= 1e-6, degree


@pytest.mark.parametrize("warmup", [0, 1])
def test_flux_pipelined_through_its_own_forward_equals_the_oracle(world3, warmup):
    """M = 2 and N + 1 (uneven bands) at pp2 and pp3, true CFG; the text computed with each step's first patch."""
    for degree in (2, 3):
        for num_patches in (2, degree + 1):
            generic, family = world3.run_ok(run_flux_both, degree, num_patches, warmup, height=HEIGHT, width=WIDTH,
                                            steps=STEPS, cfg=2.0)[0]  # fmt: skip
            oracle = flux_oracle(num_patches, warmup, 2.0)
            assert (generic - family).abs().max().item() <= 1e-6, (degree, num_patches)
            assert ((generic - oracle).abs().max() / oracle.abs().max()).item() <= 1e-5, (degree, num_patches)
    serial = flux_oracle(1, STEPS, 2.0)
    assert (flux_oracle(2, warmup, 2.0) - serial).abs().max().item() > 1e-3  # stale K/V matter: the test can fail


@pytest.mark.parametrize("direction", ["temporal", "spatial"])
def test_wan_through_its_own_forward_is_exact_and_pipelined_equals_the_oracle(world3, direction):
    """Exact (warm-up = steps) against diffusers' serial loop, pipelined (warm-up 1, M = N + 1) against the video
    oracle and ``WanStage``, CFG batched, at pp2 and pp3; a spatial band is a strip of rows across every frame."""
    call = dict(height=WAN_HEIGHT, width=WIDTH, num_frames=FRAMES, steps=STEPS, guidance_scale=5.0)
    inputs = prepare_wan_inputs(tiny_wan(), **call)
    serial = pipefusion_video_reference(tiny_wan(), inputs, direction=direction, num_patches=1, warmup=STEPS)
    for degree in (2, 3):
        generic, family = world3.run_ok(run_wan_both, degree, direction, degree + 1, STEPS, **call)[0]
        assert (generic - serial).abs().max().item() <= 1e-4, degree
        assert (generic - family).abs().max().item() <= 1e-5, degree
        generic, family = world3.run_ok(run_wan_both, degree, direction, degree + 1, 1, **call)[0]
        oracle = pipefusion_video_reference(tiny_wan(), inputs, direction=direction, num_patches=degree + 1,
                                            warmup=1)  # fmt: skip
        assert (generic - family).abs().max().item() <= 1e-5, degree  # float reassociation: 2.5e-6 seen
        assert ((generic - oracle).abs().max() / oracle.abs().max()).item() <= 1e-5, degree
        assert (oracle - serial).abs().max().item() > 1e-3  # stale K/V matter


@pytest.fixture(scope="module")
def ltx_folder(tmp_path_factory):
    from xfuse.families.ltx.presets import save_preset_pipeline

    return save_preset_pipeline(tmp_path_factory.mktemp("ltx") / "ltx-tiny", "ltx-tiny")


def test_ltx_guidance_rescale_equals_diffusers_in_exact_mode_and_is_refused_pipelined(world3, ltx_folder):
    """``guidance_rescale`` (whole-video statistics of the guided prediction) through the generic family's request:
    exact mode at pp3 equals ``diffusers.LTXPipeline`` and differs from no rescale; pipelined steps refuse it by name
    on every rank, before any communication."""
    import numpy as np
    from diffusers import LTXPipeline

    from tests.support.pipeline_fns import check_against_diffusers, reference_runner, run_calls

    reference = reference_runner(LTXPipeline.from_pretrained(ltx_folder, local_files_only=True))
    call = dict(prompt="a red house by a lake", negative_prompt="blurry", height=256, width=192, num_frames=17,
                num_inference_steps=3, guidance_scale=4.5, guidance_rescale=0.7, output_type="np")  # fmt: skip
    exact = {"pipefusion_degree": 3, "warmup_steps": 100}
    results = world3.run_ok(run_calls, ltx_folder, exact, [call], family="ltx", timeout=600)
    check_against_diffusers(results, {"base": {}}, reference, call, output_class="LTXPipelineOutput", callback_steps=())
    assert np.abs(results[0][0]["images"] - reference({**call, "guidance_rescale": 0.0})[0]).max() > 1e-3
    pipelined = world3.run_ok(run_calls, ltx_folder, {"pipefusion_degree": 3, "warmup_steps": 1}, [call],
                              family="ltx", timeout=600)  # fmt: skip
    for rank in pipelined:
        assert rank[0]["kind"] == "error" and "guidance_rescale=0.7 needs whole-video statistics" in rank[0]["message"]
