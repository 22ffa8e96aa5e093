"""ControlNet on a sharded SD3 pipeline (``xfuse/families/sd3/controlnet.py``, ``xfuse/parallel/control.py``): xfuse's
``PipeFusionStableDiffusion3ControlNetPipeline`` against diffusers' ``StableDiffusion3ControlNetPipeline`` from the
same folders, the residuals' bytes against the model's count, and the pipelined mode against the oracle.

The ControlNet is built here from ``sd3-tiny``'s transformer as diffusers' ``from_transformer`` builds one (2 of its
4 blocks), with its zero-initialised layers drawn at random so that the control acts; saved with ``save_pretrained``.
Its 2 residuals go to blocks 0-1 and 2 (SD3's last block takes none). 128 x 96 px, 3 steps, CFG 2.
"""

import numpy as np
import pytest
import torch

from tests.support.controlnet_fns import (
    CONTROL_CALLS,
    GLOBAL_SEED,
    control_image,
    control_steps,
    refused_controlnet_layout,
    save_controlnet,
    xfuse_control_steps,
)
from tests.support.mmdit_fns import NEGATIVE, PROMPT, grid_of, prepare_inputs
from tests.support.pipefusion_oracle import pipefusion_reference
from tests.support.world import World
from xfuse.families.registry import load_pipeline, model_spec

HEIGHT, WIDTH, STEPS, PRESET = 128, 96, 3, "sd3-tiny"
CALL = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
            max_sequence_length=16, output_type="latent", seed=0, guidance_scale=2.0)  # fmt: skip


@pytest.fixture(scope="module")
def world2():
    with World(2, start_timeout=240) as w:
        yield w


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(pipeline folder, ControlNet folder)."""
    root = tmp_path_factory.mktemp("controlnet")
    folder = model_spec(PRESET).save_preset_pipeline(root / "pipe", PRESET)
    return str(folder), save_controlnet(load_pipeline(PRESET), root / "controlnet", seed=1, num_layers=2)


def diffusers_pipe(files):
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    folder, controlnet_folder = files
    controlnet = SD3ControlNetModel.from_pretrained(controlnet_folder)
    pipe = StableDiffusion3ControlNetPipeline.from_pretrained(folder, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def expected(files):
    """diffusers' latents for each of ``CONTROL_CALLS``, and without the ControlNet."""
    from diffusers import StableDiffusion3Pipeline

    controlled = control_steps(diffusers_pipe(files), CALL, control_image(HEIGHT, WIDTH))
    base = StableDiffusion3Pipeline.from_pretrained(files[0])
    base.set_progress_bar_config(disable=True)
    call = {k: v for k, v in CALL.items() if k != "seed"}
    plain = base(**call, generator=torch.Generator().manual_seed(CALL["seed"])).images.numpy()
    return controlled, plain


def control_volume(layout: dict):
    """The bytes per step ``comm_volume`` counts for this layout's ranks (one pipeline group)."""
    from xfuse.config import ParallelConfig
    from xfuse.parallel.control import ControlResiduals
    from xfuse.parallel.costs import comm_volume

    spec, pipe = model_spec(PRESET), load_pipeline(PRESET)
    config = pipe.transformer.config
    plan = spec.plan(config.num_layers, ParallelConfig(**layout))
    control = ControlResiduals(spec.control_samples(dict(config), {"num_layers": 2}), 2)
    text_tokens = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS, cfg=2.0)["prompt_embeds"].shape[1]
    grid = grid_of(spec, pipe, HEIGHT, WIDTH, 1)
    batch = 1 if layout.get("cfg_degree") == 2 else 2
    return comm_volume(plan, grid, hidden_size=config.num_attention_heads * config.attention_head_dim, batch=batch,
                       latent_batch=1, in_channels=config.in_channels, stream_tokens={"text": text_tokens},
                       control_residuals=control.counts(plan))  # fmt: skip


LAYOUTS = {
    "pp2": {"pipefusion_degree": 2},
    "pp4": {"pipefusion_degree": 4},
    "cfg2xpp2": {"cfg_degree": 2, "pipefusion_degree": 2},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_mode_with_controlnet_equals_diffusers(request, files, expected, layout):
    """Exact mode (every step whole-image): xfuse equals diffusers' ControlNet pipeline for both calls (full scale;
    0.7 for the first half of the steps) within 1e-4; only each group's embedding rank keeps the ControlNet; each
    rank sends what ``comm_volume`` counts, the embedding rank one (B, tokens, hidden) residual per block-sharing
    rank and residual it takes (pp2: 1 to rank 1; pp4: 1 each to ranks 1 and 2, none to rank 3 whose only block,
    SD3's last, takes none)."""
    controlled, plain = expected
    # the control acts, and the second call's scale and window change it
    assert np.abs(controlled[0] - plain).max() > 0.1 and np.abs(controlled[1] - controlled[0]).max() > 0.1
    world = request.getfixturevalue("world2" if layout == "pp2" else "world4")
    parallel = {**LAYOUTS[layout], "warmup_steps": STEPS}
    results = world.run_ok(xfuse_control_steps, *files, parallel, CALL, HEIGHT, WIDTH, True, timeout=300)
    for got, want in zip(results[0]["steps"], controlled, strict=True):
        assert np.abs(got - want).max() <= 1e-4
    volume = control_volume(LAYOUTS[layout])
    for r in results:
        assert r["holds_controlnet"] == (r["pipe_rank"] == 0)
        assert {k: v for k, v in r["sent"].items() if v} == {k: v * STEPS for k, v in volume[r["pipe_rank"]].items()
                                                              if v}, r["pipe_rank"]  # fmt: skip
    assert volume[0]["control"] == {"pp2": 1, "pp4": 2, "cfg2xpp2": 1}[layout] * 48 * 32 * 4 * (
        1 if layout == "cfg2xpp2" else 2
    )  # residuals x (B, 48 tokens, 32 hidden) x 4 bytes


def oracle_inputs(pipe, *, scale: float, guidance_end: float):
    """The oracle's inputs for the call, the ControlNet's as its pipeline prepares them (``CONTROL_CALLS`` style)."""
    from xfuse.families.common.control import control_keep

    inputs = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS, cfg=2.0)
    torch.manual_seed(GLOBAL_SEED)  # the VAE sample, drawn as diffusers' pipeline draws it
    image = pipe.prepare_image(control_image(HEIGHT, WIDTH), WIDTH, HEIGHT, 1, 1, "cpu", torch.float32,
                               do_classifier_free_guidance=True)  # fmt: skip
    with torch.no_grad():
        latents = pipe.vae.encode(image).latent_dist.sample() * pipe.vae.config.scaling_factor  # InstantX: no shift
    keep = control_keep(STEPS, 0.0, guidance_end)
    return inputs | dict(control_image=latents, conditioning_scales=[scale * k for k in keep],
                         controlnet_pooled_projections=torch.zeros_like(inputs["pooled_prompt_embeds"]))  # fmt: skip


@pytest.mark.parametrize("degree", [2, 4])
def test_pipelined_with_controlnet_equals_the_oracle(request, files, degree):
    """Pipelined (M = 3, warm-up 1): the ControlNet runs per patch with stale K/V of its own, and the result equals
    the oracle's (diffusers' ControlNet and transformer forwards per patch, each with its own stale K/V buffers)
    within 1e-5 for both calls; without the residuals the oracle is far from it."""
    world = request.getfixturevalue(f"world{degree}")
    parallel = {"pipefusion_degree": degree, "num_patches": 3, "warmup_steps": 1}
    piped = world.run_ok(xfuse_control_steps, *files, parallel, CALL, HEIGHT, WIDTH, timeout=300)[0]
    pipe = diffusers_pipe(files)
    spec = model_spec(PRESET)
    text_tokens = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS, cfg=2.0)["prompt_embeds"].shape[1]
    tokens = [band.num_tokens for band in grid_of(spec, pipe, HEIGHT, WIDTH, 3, text_tokens)]  # cut by cost, as xfuse
    for got, extra in zip(piped, CONTROL_CALLS, strict=True):
        inputs = oracle_inputs(pipe, scale=extra.get("controlnet_conditioning_scale", 1.0),
                               guidance_end=extra.get("control_guidance_end", 1.0))  # fmt: skip
        want = pipefusion_reference(pipe, inputs, height=HEIGHT, width=WIDTH, num_patches=3, warmup=1,
                                    token_counts=tokens).numpy()  # fmt: skip
        scale = np.abs(want).max()
        assert np.abs(got - want).max() / scale <= 1e-5
    unscaled = oracle_inputs(pipe, scale=0.0, guidance_end=1.0)
    without = pipefusion_reference(pipe, unscaled, height=HEIGHT, width=WIDTH, num_patches=3, warmup=1,
                                   token_counts=tokens).numpy()  # fmt: skip
    assert np.abs(piped[0] - without).max() / np.abs(without).max() > 1e-2


@pytest.mark.parametrize(
    "parallel,cache,key",
    [
        ({"pipefusion_degree": 2, "ulysses_degree": 2}, None, "parallel.ulysses_degree"),
        ({"pipefusion_degree": 4}, {"method": "first_block", "threshold": 0.1}, "cache.method"),
    ],
)
def test_layouts_a_controlnet_does_not_run_with_are_refused_alike(world4, files, parallel, cache, key):
    """Sequence parallelism and step caching with a ControlNet: the same ConfigError on every rank, naming the key."""
    results = world4.run_ok(refused_controlnet_layout, *files, parallel, cache)
    assert len(set(results)) == 1 and results[0][0] == "ConfigError" and key in results[0][1], results
