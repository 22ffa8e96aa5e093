"""Qwen-Image beyond the family contract (``tests/multirank/test_conformance.py`` runs that for ``qwen-image``, true
CFG included): every ``__call__`` argument of ``QwenImagePipeline`` against diffusers (prompts of different lengths in
one batch: padded and masked), the refusals, what each rank loads, ``from_pipe``, the Qwen2.5-VL text encoder split by
layers over the pipeline group, and an injected bug in the masked pipelined path caught by the oracle.

Sizes are non-square (128 x 96 px: 8 x 6 token rows); the tiny preset has 4 blocks and a 4-layer text encoder.
"""

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

from tests.support.flux2_fns import loaded_share
from tests.support.oracle_inputs import oracle_latents
from tests.support.pipeline_fns import check_against_diffusers as check
from tests.support.pipeline_fns import log_callback, reference_runner, run_calls
from tests.support.qwenimage_fns import from_pipe_call, holds_vae, pipelined_forgetting_the_padding
from tests.support.world import World
from xfuse.config import config_from_dict
from xfuse.families.qwenimage.presets import save_preset_pipeline
from xfuse.perf.memory import rank_memory
from xfuse.perf.planner import workload

HEIGHT, WIDTH, STEPS = 128, 96, 3
BASE = dict(prompt="a red house by a lake", height=HEIGHT, width=WIDTH, num_inference_steps=STEPS, output_type="np")
CFG = dict(negative_prompt="blurry", true_cfg_scale=2.0)
EXACT = {"warmup_steps": 100}


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset_pipeline(tmp_path_factory.mktemp("qwen-image") / "qwen-image-tiny", "qwen-image-tiny")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_runner(QwenImagePipeline.from_pretrained(folder, local_files_only=True))


def honoured_calls(reference):
    """Every ``__call__`` argument of the pipeline, each in a call diffusers runs too."""
    with torch.no_grad():
        emb, _ = reference.pipe.encode_prompt("a red house", device="cpu")
        neg, _ = reference.pipe.encode_prompt("a blurry photo", device="cpu")
        batch, batch_mask = reference.pipe.encode_prompt(["a red house", "a cat on a mat by the sea"], device="cpu")
    assert batch_mask is not None and not bool(batch_mask.all())  # the shorter prompt is padded
    return {
        "true_cfg": CFG,
        "no_cfg": {},  # no negative prompt: true_cfg_scale's default 4.0 does nothing (diffusers warns)
        "batch_and_images": dict(prompt=["a red house", "a cat on a mat by the sea"], num_images_per_prompt=2),
        "batch_true_cfg": dict(
            prompt=["a red house", "a cat on a mat by the sea"], negative_prompt=["", "dark"], true_cfg_scale=3.0
        ),  # fmt: skip
        "size_and_steps": dict(height=96, width=128, num_inference_steps=2),
        "sigmas": dict(sigmas=[1.0, 0.7, 0.3]),
        "guidance_scale_ignored": dict(guidance_scale=2.5),
        "latents": dict(latents=torch.randn(1, 48, 16, generator=torch.Generator().manual_seed(7))),
        "prompt_embeds": dict(prompt=None, prompt_embeds=emb, negative_prompt_embeds=neg, true_cfg_scale=2.0),
        "prompt_embeds_mask": dict(prompt=None, prompt_embeds=batch, prompt_embeds_mask=batch_mask),
        "max_sequence_length": dict(max_sequence_length=40, **CFG),
        "callback": dict(callback_on_step_end=log_callback, callback_on_step_end_tensor_inputs=["latents"]),
        "output_pil": dict(output_type="pil"),
        "output_latent": dict(output_type="latent", **CFG),
        "return_tuple": dict(return_dict=False),
        "seed": dict(seed=3),
    }


def check_against_diffusers(per_rank, calls, reference):
    check(per_rank, calls, reference, BASE, output_class="QwenImagePipelineOutput", callback_steps=list(range(STEPS)))


@pytest.mark.parametrize(
    "parallel",
    [{"pipefusion_degree": 4, "num_patches": 3}, {"pipefusion_degree": 2, "cfg_degree": 2},
     {"pipefusion_degree": 2, "ring_degree": 2}],
    ids=["pp4", "cfg2_pp2", "pp2_ring2"],
)  # fmt: skip
def test_every_argument_honoured(world4, folder, reference, parallel):
    calls = honoured_calls(reference)
    if parallel.get("cfg_degree") == 2:  # a call without true CFG has no batch to split (refused: test_mmdit.py)
        calls = {name: call for name, call in calls.items() if "true_cfg_scale" in call}
    results = world4.run_ok(run_calls, folder, {**parallel, **EXACT}, [{**BASE, **c} for c in calls.values()],
                            family="qwen-image", timeout=600)  # fmt: skip
    check_against_diffusers(results, calls, reference)


def test_refusals_name_the_argument_on_every_rank(world4, folder):
    calls = [{**BASE, "attention_kwargs": {"scale": 0.5}}, {**BASE, "height": 120},
             {**BASE, "max_sequence_length": 2000}]  # fmt: skip
    results = world4.run_ok(run_calls, folder, {"pipefusion_degree": 4, **EXACT}, calls, family="qwen-image",
                            timeout=300)  # fmt: skip
    for rank_results in results:  # the same error on every rank, before any communication
        assert [(r["kind"], r["message"]) for r in rank_results] == [(r["kind"], r["message"]) for r in results[0]]
    messages = [r["message"] for r in results[0]]
    assert messages[0].startswith("attention_kwargs is not supported by PipeFusion")
    assert messages[1].startswith("generation.height: must be a positive multiple of 16 pixels")
    assert messages[2] == "`max_sequence_length` cannot be greater than 1024 but is 2000"  # diffusers' own check
    results = world4.run_ok(run_calls, folder, {"pipefusion_degree": 2, "cfg_degree": 2}, [BASE], family="qwen-image",
                            timeout=300)  # fmt: skip
    assert {r[0]["message"] for r in results} == {
        "parallel.cfg_degree 2 splits true CFG's [negative, positive] batch, which QwenImagePipeline runs only with "
        "true_cfg_scale > 1 and a negative prompt (got true_cfg_scale=4.0, no negative prompt)"
    }


def test_each_rank_loads_only_its_blocks(world4, folder):
    """pp4 over 4 blocks: a block's parameters (its own modulation with them) on its rank only, ``img_in`` on the
    first rank, ``norm_out`` and ``proj_out`` on the last, the timestep embedding and the text input layers on every
    rank; ``xfuse plan``'s per-rank weights are those bytes exactly, and the VAE is rank 0's alone."""
    whole = QwenImageTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    sizes = {name: p.numel() for name, p in whole.named_parameters()}
    per_rank = world4.run_ok(loaded_share, folder, {"pipefusion_degree": 4}, "qwen-image", timeout=300)
    assert [blocks for _, blocks in per_rank] == [[0], [1], [2], [3]]
    everywhere = ("time_text_embed.", "txt_norm.", "txt_in.")
    for rank, (params, blocks) in enumerate(per_rank):
        assert all(sizes[name] == count for name, count in params.items())
        prefixes = {f"transformer_blocks.{b}." for b in blocks} | set(everywhere)
        prefixes |= {"img_in."} if rank == 0 else set()
        prefixes |= {"norm_out.", "proj_out."} if rank == 3 else set()
        assert set(params) == {name for name in sizes if name.startswith(tuple(prefixes))}, rank
    assert set().union(*(params for params, _ in per_rank)) == set(sizes)
    config = config_from_dict({"model": "qwen-image-tiny", "parallel": {"pipefusion_degree": 4}})
    planned = rank_memory("qwen-image-tiny", workload(config), config.parallel, torch.float32)
    assert [m.param_bytes for m in planned] == [4 * sum(params.values()) for params, _ in per_rank]
    # the causal 3-D VAE decodes on rank 0 (vae_parallel auto): no other rank loads it, nor does the plan count it
    assert world4.run_ok(holds_vae, folder, {"pipefusion_degree": 4}, timeout=300) == [True, False, False, False]
    assert [m.vae_bytes > 0 for m in planned] == [True, False, False, False]


def test_from_pipe_equals_diffusers_and_refuses_another_family(world4, reference):
    call = {**BASE, **CFG}
    results = world4.run_ok(from_pipe_call, {"pipefusion_degree": 4, **EXACT}, call, timeout=300)
    assert all("takes a QwenImagePipeline" in refused for refused, _ in results)
    assert all(images is None for _, images in results[1:])
    assert np.abs(results[0][1] - reference(call)[0]).max() <= 1e-4


@pytest.mark.parametrize(
    "parallel", [{"pipefusion_degree": 4}, {"pipefusion_degree": 2, "cfg_degree": 2}], ids=["pp4", "cfg2_pp2"]
)
def test_split_text_encoder_equals_diffusers(world4, folder, reference, parallel):
    """Qwen2.5-VL's 4 layers split over the pipeline group: a padded batch of two prompts, the negative prompt's
    second encode, given embeddings (no encoder call)."""
    with torch.no_grad():
        emb, _ = reference.pipe.encode_prompt("a red house", device="cpu")
    calls = {
        "true_cfg": CFG,
        "batch_true_cfg": dict(
            prompt=["a red house", "a cat on a mat by the sea"], negative_prompt=["", "dark"], true_cfg_scale=3.0
        ),  # fmt: skip
        "prompt_embeds": dict(prompt=None, prompt_embeds=emb, **CFG),
    }
    results = world4.run_ok(run_calls, folder, {**parallel, **EXACT, "text_encoder": "split"},
                            [{**BASE, **c} for c in calls.values()], family="qwen-image", timeout=600)  # fmt: skip
    check_against_diffusers(results, calls, reference)


def test_the_oracle_catches_padding_forgotten_in_pipelined_patches(world4, folder, reference):
    """Pipelined pp4 with true CFG batched (the negative prompt padded): the latents equal the oracle's; with the
    padding mask dropped in patch passes only (an injected bug), they do not."""
    call = {**BASE, **CFG, "output_type": "latent"}
    parallel = {"pipefusion_degree": 4, "num_patches": 3, "warmup_steps": 1}
    expected = oracle_latents(reference.pipe, call, num_patches=3, warmup=1).numpy()

    def rel_max(images):
        return float(np.abs(images - expected).max() / np.abs(expected).max())

    good = world4.run_ok(run_calls, folder, parallel, [call], family="qwen-image", timeout=600)[0][0]
    assert rel_max(good["images"]) <= 1e-5
    bad = world4.run_ok(pipelined_forgetting_the_padding, folder, parallel, [call], timeout=600)[0][0]
    assert rel_max(bad["images"]) > 1e-3
