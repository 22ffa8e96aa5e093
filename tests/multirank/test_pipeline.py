"""PipeFusionHunyuanDiTPipeline against diffusers' own HunyuanDiTPipeline loaded from the same saved folder."""

import platform
import statistics

import numpy as np
import pytest
import torch
from diffusers import HunyuanDiTPipeline

from tests.support.heap_child import SETTLE
from tests.support.pipeline_fns import (
    as_array,
    changing_callback,
    heap_after_build_pipeline,
    interrupting_callback,
    log_callback,
    reference_runner,
    run_calls,
)
from tests.support.schedulers import PerPatchNoiseDDPM
from tests.support.world import World
from xfuse.families.hunyuandit.presets import save_tiny_pipeline
from xfuse.families.hunyuandit.reference import swap_scheduler

BASE = dict(
    prompt="a red house by a lake",
    height=128,
    width=96,
    num_inference_steps=3,
    output_type="np",
    use_resolution_binning=False,
)
EXACT = {"warmup_steps": 100}  # warm-up covers every step: exact mode


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "HunyuanDiT-tiny")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_runner(HunyuanDiTPipeline.from_pretrained(folder, local_files_only=True))


def embeds(reference, prompt, negative=""):
    """Precomputed prompt embeddings, as a user of prompt_embeds would pass them."""
    pipe, out = reference.pipe, {}
    for index, length, suffix in ((0, 77, ""), (1, 256, "_2")):
        emb, neg, mask, neg_mask = pipe.encode_prompt(
            prompt,
            device="cpu",
            dtype=torch.float32,
            num_images_per_prompt=1,
            do_classifier_free_guidance=True,
            negative_prompt=negative,
            max_sequence_length=length,
            text_encoder_index=index,
        )
        out.update(
            {
                f"prompt_embeds{suffix}": emb,
                f"negative_prompt_embeds{suffix}": neg,
                f"prompt_attention_mask{suffix}": mask,
                f"negative_prompt_attention_mask{suffix}": neg_mask,
            }
        )
    return out


def honoured_calls(reference):
    """Every __call__ argument, each in a call that diffusers runs too."""
    noise = torch.randn(1, 4, 16, 12, generator=torch.Generator().manual_seed(7))
    return {
        "base": {},
        "prompt_list_and_negative": dict(prompt=["a red house", "a cat"], negative_prompt=["blurry", "dark"]),
        "num_images_per_prompt": dict(num_images_per_prompt=2),
        "batch_and_images": dict(prompt=["a red house", "a cat"], num_images_per_prompt=2),
        "no_guidance": dict(guidance_scale=1.0),
        "guidance_and_rescale": dict(guidance_scale=7.5, guidance_rescale=0.7),
        "size_and_steps": dict(height=96, width=128, num_inference_steps=2),
        "eta": dict(eta=0.5),
        "latents": dict(latents=noise),
        "prompt_embeds": dict(prompt=None, **embeds(reference, "a red house by a lake", "ugly")),
        "output_pil": dict(output_type="pil"),
        "output_pt": dict(output_type="pt"),
        "output_latent": dict(output_type="latent"),
        "return_tuple": dict(return_dict=False),
        "callback": dict(callback_on_step_end=log_callback, callback_on_step_end_tensor_inputs=["latents"]),
        "size_conditioning": dict(original_size=(512, 512), target_size=(128, 96), crops_coords_top_left=(4, 4)),
        "resolution_binning": dict(height=1000, width=1010, use_resolution_binning=True, num_inference_steps=1),
        "seed": dict(seed=3),
    }


@pytest.fixture(scope="module")
def world2():
    with World(2) as w:
        yield w


@pytest.fixture(scope="module")
def world4():
    with World(4) as w:
        yield w


def test_the_cli_pipeline_leaves_the_start_up_heap_to_no_collection(world2):
    """``build_pipeline`` (``xfuse generate`` and ``xfuse serve``) freezes what start-up left alive: after it, the
    collector tracks a small fraction of the objects, so a full collection no longer walks the libraries and the
    model (150 ms on this machine, in the middle of a loop). It also keeps freed memory (``keep_freed_heap``):
    block passes, once settled, fault in no fresh pages (thousands per pass without it, tests/launch/test_heap.py)."""
    for frozen, tracked, faults in world2.run_ok(heap_after_build_pipeline, "configs/tiny/pp2.yaml", timeout=300):
        assert frozen > 100_000, frozen  # torch, transformers, diffusers and the model's modules
        assert tracked < frozen / 20, (tracked, frozen)
        if platform.libc_ver()[0] == "glibc":
            assert statistics.median(faults[SETTLE:]) < 100, faults


def check_against_diffusers(per_rank, calls, reference, atol=1e-4):
    """Rank 0's images equal diffusers'; every other rank returned None; the callback log (from whichever rank ran
    the callback) equals diffusers'."""
    for index, (name, call) in enumerate(calls.items()):
        result = per_rank[0][index]
        assert result["kind"] == "ok", (name, result)
        assert all(r[index]["kind"] == "none" for r in per_rank[1:]), name
        images = result["images"]
        expected, expected_log = reference({**BASE, **call})
        assert images.shape == expected.shape, name
        tolerance = 1 if images.dtype == np.uint8 else atol  # PIL: a 1e-6 difference may flip one 8-bit level
        assert np.abs(images.astype(np.float64) - expected).max() <= tolerance, name
        if call.get("callback_on_step_end"):
            log = [entry for r in per_rank for entry in r[index]["log"]]
            steps = list(range(call.get("num_inference_steps", BASE["num_inference_steps"])))
            assert [s for s, _, _ in log] == [s for s, _, _ in expected_log] == steps
            assert np.allclose([n for *_, n in log], [n for *_, n in expected_log], rtol=1e-5)
        expected_type = "tuple" if call.get("return_dict") is False else "StableDiffusionPipelineOutput"
        assert result["type"] == expected_type, name


def test_every_argument_honoured_at_pp2(world2, folder, reference):
    calls = honoured_calls(reference)
    results = world2.run_ok(
        run_calls, folder, {"pipefusion_degree": 2, **EXACT}, [{**BASE, **c} for c in calls.values()], timeout=600
    )
    check_against_diffusers(results, calls, reference)


@pytest.mark.parametrize(
    "parallel",
    [
        {"pipefusion_degree": 4, "num_patches": 3},
        {"pipefusion_degree": 4, "num_patches": 5, "placement": "linear"},
        {"pipefusion_degree": 2, "cfg_degree": 2},
    ],
)
def test_equivalence_and_batches_on_four_ranks(world4, folder, reference, parallel):
    calls = {
        k: v
        for k, v in honoured_calls(reference).items()
        if k in ("base", "batch_and_images", "prompt_list_and_negative", "callback", "output_latent")
    }
    results = world4.run_ok(
        run_calls, folder, {**parallel, **EXACT}, [{**BASE, **c} for c in calls.values()], timeout=600
    )
    check_against_diffusers(results, calls, reference)


def test_pipelined_mode_runs_and_is_deterministic(world4, folder, reference):
    call = {**BASE, "num_inference_steps": 6, "height": 256, "width": 192}
    results = world4.run_ok(
        run_calls,
        folder,
        {"pipefusion_degree": 2, "cfg_degree": 2, "warmup_steps": 1},
        [call, call],
        scheduler="DDIMScheduler",
        timeout=600,
    )
    first, second = (r["images"] for r in results[0])
    assert np.array_equal(first, second) and np.isfinite(first).all()
    swap_scheduler(reference.pipe, "DDIMScheduler")
    try:
        expected, _ = reference(call)
    finally:
        swap_scheduler(reference.pipe, "DDPMScheduler")
    assert 0 < np.abs(first - expected).mean() < 0.05  # stale K/V: close to, not equal to, serial


@pytest.mark.parametrize(
    "parallel",
    [
        {"pipefusion_degree": 4, "placement": "linear"},
        {"pipefusion_degree": 4, "placement": "folded"},
        {"pipefusion_degree": 2, "cfg_degree": 2},
    ],
)
def test_one_patch_pipelined_ddpm_draws_diffusers_noise(world4, folder, reference, parallel):
    """Pipelined steps (warm-up 1) with one patch: no K/V is stale, and DDPM (the model's own scheduler) draws each
    step's noise as diffusers does, so the images equal diffusers' for batches, several images per prompt and a list
    of generators; and a generator used for two calls in a row ends each call where diffusers' does on every rank
    (the stepping rank is not rank 0 with linear placement), the second call equal to diffusers' second call."""
    calls = {
        "base": {},
        "batch_and_images": dict(prompt=["a red house", "a cat"], num_images_per_prompt=2),
        "generator_list": dict(prompt=["a red house", "a cat"], seeds=[3, 4]),
    }
    pipelined = {**parallel, "num_patches": 1, "warmup_steps": 1}
    results = world4.run_ok(run_calls, folder, pipelined, [{**BASE, **c} for c in calls.values()], timeout=600)
    check_against_diffusers(results, calls, reference)
    twice = world4.run_ok(run_calls, folder, pipelined, [BASE, BASE], one_generator=5, timeout=600)
    generator = torch.Generator().manual_seed(5)
    for index in range(2):
        expected = as_array(reference.pipe(**BASE, generator=generator))
        assert np.abs(twice[0][index]["images"] - expected).max() <= 1e-4, index
        assert all(torch.equal(r[index]["generator_state"], generator.get_state()) for r in twice), index


def test_a_generator_list_is_refused_where_noise_is_drawn_per_patch(world2, folder):
    """Pipelined steps of a scheduler that draws its noise otherwise than through ``randn_tensor`` take one generator
    (per-patch generators derive from it): a list is refused on every rank, naming the scheduler and the way out."""
    call = {**BASE, "prompt": ["a red house", "a cat"], "seeds": [3, 4]}
    results = world2.run_ok(
        run_calls, folder, {"pipefusion_degree": 2, "warmup_steps": 1}, [call], scheduler=PerPatchNoiseDDPM
    )
    for rank_results in results:
        assert rank_results[0]["kind"] == "error" and rank_results[0]["type"] == "ValueError"
        assert rank_results[0]["message"].startswith(
            "generator: a list of generators works with PerPatchNoiseDDPM only with parallel.warmup_steps >= "
            "num_inference_steps"
        )


CALLBACK_REFUSED = [
    ("changes_latents", changing_callback, "callback_on_step_end returned a changed 'latents' at step 0"),
    ("interrupts", interrupting_callback, "interrupt flag"),
]


def test_callback_changes_are_refused_after_a_clean_loop(world2, folder):
    """Bad arguments in general: tests/launch/test_faults.py. Here: what only shows during the loop."""
    calls = [{**BASE, "callback_on_step_end": cb} for _, cb, _ in CALLBACK_REFUSED] + [BASE]
    results = world2.run_ok(
        run_calls, folder, {"pipefusion_degree": 2, "warmup_steps": 1, "num_patches": 2}, calls, timeout=300
    )
    for rank, rank_results in enumerate(results):
        # A refused callback change is raised where the callback ran (rank 0, folded), after a clean loop.
        for (name, _, text), result in zip(CALLBACK_REFUSED, rank_results[:-1], strict=True):
            if rank == 0:
                assert result["kind"] == "error" and text in result["message"], (name, result)
            else:
                assert result["kind"] == "none", (name, result)
        assert rank_results[-1]["kind"] == ("ok" if rank == 0 else "none")  # the world is still healthy
