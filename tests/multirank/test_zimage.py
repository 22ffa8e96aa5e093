"""Z-Image beyond the family contract (``tests/multirank/test_conformance.py`` runs that for ``z-image``): every
``__call__`` argument of ``ZImagePipeline`` against diffusers (the image's pad tokens, captions of different lengths in
one batch, ``cfg_truncation``, ``cfg_normalization``), Ulysses 4 over the tiny preset's 6 heads (a head count 4 does not
divide, as 4 and 8 do not divide the release's 30), the refusals, what each rank loads, ``from_pipe``, the Qwen3 text
encoder split by layers over the pipeline group, and an injected bug in the patch passes caught by the oracle.

Sizes are non-square (128 x 96 px: 8 x 6 token rows, 48 image tokens and 16 pad tokens); the tiny preset has 2 noise
refiner blocks and 4 main layers, 6 heads of 16, and a 4-layer Qwen3.
"""

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline, ZImageTransformer2DModel

from tests.support.flux2_fns import loaded_share
from tests.support.oracle_inputs import oracle_latents
from tests.support.pipeline_fns import check_against_diffusers as check
from tests.support.pipeline_fns import log_callback, reference_runner, run_calls
from tests.support.world import World
from tests.support.zimage_fns import from_pipe_call, pipelined_with_band_positions
from xfuse.config import config_from_dict
from xfuse.families.zimage.presets import save_preset_pipeline
from xfuse.perf.memory import rank_memory
from xfuse.perf.planner import workload

HEIGHT, WIDTH, STEPS = 128, 96, 3
BASE = dict(prompt="a red house by a lake", height=HEIGHT, width=WIDTH, num_inference_steps=STEPS, output_type="np")
EXACT = {"warmup_steps": 100}


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset_pipeline(tmp_path_factory.mktemp("z-image") / "z-image-tiny", "z-image-tiny")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_runner(ZImagePipeline.from_pretrained(folder, local_files_only=True))


def honoured_calls(reference):
    """Every ``__call__`` argument of the pipeline, each in a call diffusers runs too."""
    with torch.no_grad():
        emb, neg = reference.pipe.encode_prompt("a red house", device="cpu", negative_prompt="a blurry photo")
    return {
        "base": {},  # CFG at the default guidance_scale 5 on the empty negative prompt
        "negative_prompt": dict(negative_prompt="blurry, dark", guidance_scale=3.0),
        "no_guidance": dict(guidance_scale=0.0),  # Z-Image-Turbo's way: no CFG batch
        "batch_and_images": dict(prompt=["a red house", "a cat on a mat by the sea"], num_images_per_prompt=2),
        "no_image_pads": dict(height=128, width=128, num_inference_steps=2),  # 64 tokens: a multiple of 32
        "sigmas": dict(sigmas=[1.0, 0.6, 0.2]),
        "cfg_truncation": dict(cfg_truncation=0.4),  # the last step without CFG
        "cfg_normalization": dict(cfg_normalization=True, guidance_scale=8.0),  # every step whole (exact mode)
        "latents": dict(latents=torch.randn(1, 4, 16, 12, generator=torch.Generator().manual_seed(7))),
        "prompt_embeds": dict(prompt=None, prompt_embeds=emb, negative_prompt_embeds=neg),
        "max_sequence_length": dict(max_sequence_length=40),
        "callback": dict(callback_on_step_end=log_callback, callback_on_step_end_tensor_inputs=["latents"]),
        "output_pil": dict(output_type="pil"),
        "output_latent": dict(output_type="latent"),
        "return_tuple": dict(return_dict=False),
        "seed": dict(seed=3),
    }


def check_against_diffusers(per_rank, calls, reference):
    check(per_rank, calls, reference, BASE, output_class="ZImagePipelineOutput", callback_steps=list(range(STEPS)))


@pytest.mark.parametrize(
    "parallel",
    [{"pipefusion_degree": 4, "num_patches": 3}, {"pipefusion_degree": 2, "cfg_degree": 2}, {"ulysses_degree": 4},
     {"pipefusion_degree": 2, "ring_degree": 2}],
    ids=["pp4", "cfg2_pp2", "ulysses4", "pp2_ring2"],
)  # fmt: skip
def test_every_argument_honoured(world4, folder, reference, parallel):
    """Ulysses 4 splits the 6 heads 2, 2, 1, 1 (``SequenceParallel._head_groups``): exact as the others."""
    calls = honoured_calls(reference)
    if parallel.get("cfg_degree") == 2:  # a call without guidance has no batch to split (refused below)
        calls.pop("no_guidance")
    results = world4.run_ok(run_calls, folder, {**parallel, **EXACT}, [{**BASE, **c} for c in calls.values()],
                            family="z-image", timeout=600)  # fmt: skip
    check_against_diffusers(results, calls, reference)


def test_refusals_name_the_argument_on_every_rank(world4, folder):
    calls = [{**BASE, "joint_attention_kwargs": {"scale": 0.5}}, {**BASE, "height": 120},
             {**BASE, "prompt": None, "prompt_embeds": [torch.zeros(5, 32)]}]  # fmt: skip
    results = world4.run_ok(run_calls, folder, {"pipefusion_degree": 4, **EXACT}, calls, family="z-image",
                            timeout=300)  # fmt: skip
    for rank_results in results:  # the same error on every rank, before any communication
        assert [(r["kind"], r["message"]) for r in rank_results] == [(r["kind"], r["message"]) for r in results[0]]
    messages = [r["message"] for r in results[0]]
    assert messages[0].startswith("joint_attention_kwargs is not supported by PipeFusion")
    assert messages[1].startswith("generation.height: must be a positive multiple of 16 pixels")
    assert messages[2].startswith("When `prompt_embeds` is provided without `prompt`, `negative_prompt_embeds`")
    pipelined = world4.run_ok(run_calls, folder, {"pipefusion_degree": 4, "warmup_steps": 1},
                              [{**BASE, "cfg_normalization": True}], family="z-image", timeout=300)  # fmt: skip
    assert {r[0]["message"] for r in pipelined} == {
        "cfg_normalization is not supported by PipeFusion's patch steps (it rescales by the whole image's norm): set "
        "parallel.warmup_steps >= num_inference_steps (3) to run every step whole, or leave it False (got True)"
    }
    cfg = world4.run_ok(run_calls, folder, {"pipefusion_degree": 2, "cfg_degree": 2},
                        [{**BASE, "guidance_scale": 0.0}], family="z-image", timeout=300)  # fmt: skip
    assert {r[0]["message"] for r in cfg} == {
        "parallel.cfg_degree 2 splits the classifier-free-guidance batch, which ZImagePipeline runs only with "
        "guidance_scale > 0 (got 0.0)"
    }


def test_each_rank_loads_only_its_blocks(world4, folder):
    """pp4 over 2 refiner + 4 main blocks (linear: 0-1 | 2-3 | 4 | 5): a block's parameters on its rank only; the
    patch embedding, both pad tokens, the caption embedder and the context refiner on the first rank (the stream's
    first value is made there); the final layer on the last; the timestep embedder on every rank; ``xfuse plan``'s
    per-rank weights are those bytes exactly."""
    whole = ZImageTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    sizes = {name: p.numel() for name, p in whole.named_parameters()}
    per_rank = world4.run_ok(loaded_share, folder, {"pipefusion_degree": 4}, "z-image", timeout=300)
    assert [blocks for _, blocks in per_rank] == [[0, 1], [2, 3], [4], [5]]
    first = ("all_x_embedder.", "x_pad_token", "cap_embedder.", "cap_pad_token", "context_refiner.")
    for rank, (params, blocks) in enumerate(per_rank):
        assert all(sizes[name] == count for name, count in params.items())
        prefixes = {f"noise_refiner.{b}." if b < 2 else f"layers.{b - 2}." for b in blocks} | {"t_embedder."}
        prefixes |= set(first) if rank == 0 else set()
        prefixes |= {"all_final_layer."} if rank == 3 else set()
        assert set(params) == {name for name in sizes if name.startswith(tuple(prefixes))}, rank
    assert set().union(*(params for params, _ in per_rank)) == set(sizes)
    config = config_from_dict({"model": "z-image-tiny", "parallel": {"pipefusion_degree": 4}})
    planned = rank_memory("z-image-tiny", workload(config), config.parallel, torch.float32)
    assert [m.param_bytes for m in planned] == [4 * sum(params.values()) for params, _ in per_rank]


def test_from_pipe_equals_diffusers_and_refuses_another_family(world4, reference):
    results = world4.run_ok(from_pipe_call, {"pipefusion_degree": 4, **EXACT}, BASE, timeout=300)
    assert all("takes a ZImagePipeline" in refused for refused, _ in results)
    assert all(images is None for _, images in results[1:])
    assert np.abs(results[0][1] - reference(BASE)[0]).max() <= 1e-4


@pytest.mark.parametrize(
    "parallel", [{"pipefusion_degree": 4}, {"pipefusion_degree": 2, "cfg_degree": 2}], ids=["pp4", "cfg2_pp2"]
)
def test_split_text_encoder_equals_diffusers(world4, folder, reference, parallel):
    """Qwen3's 4 layers split over the pipeline group (Z-Image reads the second-to-last hidden state): the prompt
    and the negative prompt's second encode, a padded batch, given embeddings (no encoder call)."""
    with torch.no_grad():
        emb, neg = reference.pipe.encode_prompt("a red house", device="cpu", negative_prompt="")
    calls = {
        "base": {},
        "batch": dict(prompt=["a red house", "a cat on a mat by the sea"], negative_prompt=["", "dark"]),
        "prompt_embeds": dict(prompt=None, prompt_embeds=emb, negative_prompt_embeds=neg),
    }
    results = world4.run_ok(run_calls, folder, {**parallel, **EXACT, "text_encoder": "split"},
                            [{**BASE, **c} for c in calls.values()], family="z-image", timeout=600)  # fmt: skip
    check_against_diffusers(results, calls, reference)


def test_the_oracle_catches_band_positions_in_pipelined_patches(world4, folder, reference):
    """Pipelined pp4: the latents equal the oracle's; with a patch pass taking its positions from the image's first
    rows (an injected bug; whole-image passes unaffected), they do not."""
    call = {**BASE, "output_type": "latent"}
    parallel = {"pipefusion_degree": 4, "num_patches": 3, "warmup_steps": 1}
    expected = oracle_latents(reference.pipe, call, num_patches=3, warmup=1).numpy()

    def rel_max(images):
        return float(np.abs(images - expected).max() / np.abs(expected).max())

    good = world4.run_ok(run_calls, folder, parallel, [call], family="z-image", timeout=600)[0][0]
    assert rel_max(good["images"]) <= 1e-5
    bad = world4.run_ok(pipelined_with_band_positions, folder, parallel, [call], timeout=600)[0][0]
    assert rel_max(bad["images"]) > 1e-3
