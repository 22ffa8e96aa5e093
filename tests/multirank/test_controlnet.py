"""ControlNet on sharded SD3 and FLUX pipelines (``xfuse/families/{sd3,flux}/controlnet.py``,
``xfuse/parallel/control.py``): xfuse's ControlNet pipelines against diffusers' ``StableDiffusion3ControlNetPipeline``
and ``FluxControlNetPipeline`` from the same folders, the residuals' bytes against the model's count, and the
pipelined mode against the oracle.

The ControlNets are built here from the tiny presets' transformers as diffusers' ``from_transformer`` builds them, with
their zero-initialised layers drawn at random so that the control acts; saved with ``save_pretrained``. SD3: 2 blocks
for the transformer's 4 (residuals to blocks 0-1 and 2; the last block takes none). FLUX: 1 double and 2 single blocks
for the transformer's 2 + 3 (residual 0 to both double blocks, 1 to singles 0-1, 2 to single 2). 128 x 96 px,
3 steps, CFG 2 (FLUX: true CFG, whose two halves take the residuals of one ControlNet pass on the positive prompt).
"""

import numpy as np
import pytest
import torch

from tests.support.controlnet_fns import (
    CONTROL_CALLS,
    GLOBAL_SEED,
    control_image,
    control_steps,
    load_controlnet,
    refused_controlnet_layout,
    save_controlnet,
    xfuse_control_steps,
)
from tests.support.mmdit_fns import NEGATIVE, PROMPT, grid_of, prepare_inputs
from tests.support.pipefusion_oracle import pipefusion_reference
from tests.support.world import World
from xfuse.families.registry import load_pipeline, model_spec

HEIGHT, WIDTH, STEPS = 128, 96, 3
FAMILY = {"sd3-tiny": "sd3", "flux-tiny": "flux"}
LAYERS = {"sd3-tiny": {"num_layers": 2}, "flux-tiny": {"num_layers": 1, "num_single_layers": 2}}
CALL = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
            max_sequence_length=16, output_type="latent", seed=0)  # fmt: skip
CFG = {"sd3-tiny": {"guidance_scale": 2.0}, "flux-tiny": {"true_cfg_scale": 2.0, "guidance_scale": 3.5}}


def call_of(preset):
    return CALL | CFG[preset]


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
    """preset -> (family, pipeline folder, ControlNet folder)."""
    out = {}
    for preset, family in FAMILY.items():
        root = tmp_path_factory.mktemp(preset)
        folder = model_spec(preset).save_preset_pipeline(root / "pipe", preset)
        controlnet = save_controlnet(load_pipeline(preset), root / "controlnet", seed=1, **LAYERS[preset])
        out[preset] = (family, str(folder), controlnet)
    return out


def diffusers_pipe(files, preset, controlled=True):
    import diffusers

    family, folder, controlnet_folder = files[preset]
    spec = model_spec(preset)
    if not controlled:
        pipe = getattr(diffusers, spec.diffusers_pipeline).from_pretrained(folder)
    else:
        controlnet = load_controlnet(family, controlnet_folder)
        pipe = getattr(diffusers, spec.controlnet).from_pretrained(folder, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


_EXPECTED = {}


def expected(files, preset):
    """diffusers' latents for each of ``CONTROL_CALLS``, and without the ControlNet."""
    if preset not in _EXPECTED:
        controlled = control_steps(diffusers_pipe(files, preset), call_of(preset), control_image(HEIGHT, WIDTH))
        call = {k: v for k, v in call_of(preset).items() if k != "seed"}
        base = diffusers_pipe(files, preset, controlled=False)
        plain = base(**call, generator=torch.Generator().manual_seed(CALL["seed"])).images.numpy()
        _EXPECTED[preset] = controlled, plain
    return _EXPECTED[preset]


def control_volume(preset, layout: dict):
    """The bytes per step ``comm_volume`` counts for this layout's ranks (one pipeline group)."""
    from xfuse.config import ParallelConfig
    from xfuse.parallel.control import ControlResiduals
    from xfuse.parallel.costs import comm_volume

    spec, pipe = model_spec(preset), load_pipeline(preset)
    config = pipe.transformer.config
    layers = LAYERS[preset]
    plan = spec.plan(spec.num_blocks(config), ParallelConfig(**layout), spec.num_blocks(layers))
    control = ControlResiduals(spec.control_samples(dict(config), layers), spec.num_blocks(layers))
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
# Residuals the embedding rank sends per pass, (SD3, FLUX) by layout. Rank 0 runs the ControlNet, so the linear plans
# give it fewer blocks (control_split): SD3 [1, 3] at pp2 (rank 1's blocks 1-2 take residuals 0 and 1, its block 3
# none) and [1, 1, 1, 1] at pp4; FLUX [1, 4] (residuals 0-2) and [1, 2, 1, 1] (0 and 1, 1, 2).
SENT_RESIDUALS = {"pp2": (2, 3), "pp4": (2, 4), "cfg2xpp2": (2, 3)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", FAMILY)
def test_exact_mode_with_controlnet_equals_diffusers(request, files, preset, layout):
    """Exact mode (every step whole-image): xfuse equals diffusers' ControlNet pipeline for both calls (full scale;
    0.7 for the first half of the steps) within 1e-4; only each group's embedding rank keeps the ControlNet; each
    rank sends what ``comm_volume`` counts: the embedding rank one (B, tokens, hidden) residual per residual each
    other rank's blocks take (SD3 at pp4: 1 each to ranks 1 and 2, none to rank 3, whose only block is SD3's last);
    each plan gives the embedding rank fewer blocks (``SENT_RESIDUALS``)."""
    controlled, plain = expected(files, preset)
    # the control acts, and the second call's scale and window change it
    assert np.abs(controlled[0] - plain).max() > 0.1 and np.abs(controlled[1] - controlled[0]).max() > 0.1
    world = request.getfixturevalue("world2" if layout == "pp2" else "world4")
    parallel = {**LAYOUTS[layout], "warmup_steps": STEPS}
    results = world.run_ok(xfuse_control_steps, *files[preset], parallel, call_of(preset), HEIGHT, WIDTH, True,
                           timeout=300)  # fmt: skip
    for got, want in zip(results[0]["steps"][:-1], controlled[:-1], strict=True):
        assert np.abs(got - want).max() <= 1e-4
    # every rank's generator ends where diffusers' does (FLUX: rank 0 alone drew the control image's sample)
    assert all(r["steps"][-1] == controlled[-1] for r in results)
    volume = control_volume(preset, LAYOUTS[layout])
    for r in results:
        assert r["holds_controlnet"] == (r["pipe_rank"] == 0) and r["blocks"][0] == 1
        assert {k: v for k, v in r["sent"].items() if v} == {k: v * STEPS for k, v in volume[r["pipe_rank"]].items()
                                                              if v}, r["pipe_rank"]  # fmt: skip
    residuals = SENT_RESIDUALS[layout][list(FAMILY).index(preset)]
    batch = 1 if layout == "cfg2xpp2" else 2
    assert volume[0]["control"] == residuals * batch * 48 * 32 * 4  # (B, 48 tokens, 32 hidden), 4 bytes


def oracle_inputs(pipe, preset, *, scale: float, guidance_end: float):
    """The oracle's inputs for the call, the ControlNet's as its pipeline prepares them (``CONTROL_CALLS`` style)."""
    from diffusers.pipelines.flux.pipeline_flux_controlnet import retrieve_latents

    # diffusers' controlnet_keep: 0 for step i where i / steps < start or (i + 1) / steps > end (start 0 here)
    scales = [scale * (1.0 - float((i + 1) / STEPS > guidance_end)) for i in range(STEPS)]
    vae = pipe.vae
    if preset.startswith("sd3"):
        inputs = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS, cfg=2.0)
        torch.manual_seed(GLOBAL_SEED)  # the VAE sample, drawn as diffusers' pipeline draws it
        image = pipe.prepare_image(control_image(HEIGHT, WIDTH), WIDTH, HEIGHT, 1, 1, "cpu", torch.float32,
                                   do_classifier_free_guidance=True)  # fmt: skip
        with torch.no_grad():
            latents = vae.encode(image).latent_dist.sample() * vae.config.scaling_factor  # InstantX: no shift
        pooled = torch.zeros_like(inputs["pooled_prompt_embeds"])
        return inputs | dict(control_image=latents, conditioning_scales=scales, controlnet_pooled_projections=pooled)
    generator = torch.Generator().manual_seed(CALL["seed"])  # the control image's sample first, then the latents
    image = pipe.prepare_image(control_image(HEIGHT, WIDTH), WIDTH, HEIGHT, 1, 1, "cpu", vae.dtype)
    with torch.no_grad():
        latents = retrieve_latents(vae.encode(image), generator=generator)
    latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
    packed = pipe._pack_latents(latents, 1, *latents.shape[1:])
    inputs = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS, cfg=2.0, generator=generator)
    guidance = torch.full([1], 3.5) if pipe.controlnet.config.guidance_embeds else None
    return inputs | dict(control_image=packed, conditioning_scales=scales, control_guidance=guidance)


# Pipelined layouts: linear at 2 and 4 ranks, and routes that visit a rank twice (SD3 folded: r0[0] r1[1] r1[2] r0[3];
# FLUX balanced: r0[0] r1[1] r1[2, 3] r0[4]): rank 1 keeps received residuals for its second segment, rank 0 its own
# for its last.
PIPELINED = {
    "pp2": {"pipefusion_degree": 2},
    "pp4": {"pipefusion_degree": 4},
    "pp2 twice": {"pipefusion_degree": 2, "placement": "folded"},
}


@pytest.mark.parametrize("layout", PIPELINED)
@pytest.mark.parametrize("preset", FAMILY)
def test_pipelined_with_controlnet_equals_the_oracle(request, files, preset, layout):
    """Pipelined (M = 3, warm-up 1): the ControlNet runs per patch with stale K/V of its own, and the result equals
    the oracle's (diffusers' ControlNet and transformer forwards per patch, each with its own stale K/V buffers)
    within 1e-5 for both calls; without the residuals the oracle is far from it."""
    parallel = {**PIPELINED[layout], "num_patches": 3, "warmup_steps": 1}
    if layout == "pp2 twice" and preset.startswith("flux"):  # 5 blocks: folded needs an even count
        parallel["placement"] = "balanced"
    world = request.getfixturevalue(f"world{parallel['pipefusion_degree']}")
    piped = world.run_ok(xfuse_control_steps, *files[preset], parallel, call_of(preset), HEIGHT, WIDTH, timeout=300)
    pipe = diffusers_pipe(files, preset)
    spec = model_spec(preset)
    text_tokens = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS, cfg=2.0)["prompt_embeds"].shape[1]
    tokens = [band.num_tokens for band in grid_of(spec, pipe, HEIGHT, WIDTH, 3, text_tokens)]  # cut by cost, as xfuse
    reference = dict(height=HEIGHT, width=WIDTH, num_patches=3, warmup=1, token_counts=tokens)
    for got, extra in zip(piped[0][:-1], CONTROL_CALLS, strict=True):
        inputs = oracle_inputs(pipe, preset, scale=extra.get("controlnet_conditioning_scale", 1.0),
                               guidance_end=extra.get("control_guidance_end", 1.0))  # fmt: skip
        want = pipefusion_reference(pipe, inputs, **reference).numpy()
        assert np.abs(got - want).max() / np.abs(want).max() <= 1e-5
    without = pipefusion_reference(pipe, oracle_inputs(pipe, preset, scale=0.0, guidance_end=1.0), **reference).numpy()
    assert np.abs(piped[0][0] - without).max() / np.abs(without).max() > 1e-2


@pytest.mark.parametrize(
    "parallel,cache,dtype,error,says",
    [
        ({"pipefusion_degree": 2, "ulysses_degree": 2}, None, None, "ConfigError", "parallel.ulysses_degree"),
        ({"pipefusion_degree": 4}, {"method": "first_block", "threshold": 0.1}, None, "ConfigError", "cache.method"),
        (
            {"pipefusion_degree": 4},
            None,
            torch.bfloat16,
            "ValueError",
            "controlnet is torch.float32 but the "
            "transformer runs in torch.bfloat16: load the ControlNet with torch_dtype=torch.bfloat16",
        ),
    ],
)
@pytest.mark.parametrize("preset", FAMILY)
def test_what_a_controlnet_does_not_run_with_is_refused_alike(world4, files, preset, parallel, cache, dtype, error,
                                                              says):  # fmt: skip
    """Sequence parallelism and step caching with a ControlNet, and a ControlNet in another dtype than the
    transformer: the same error on every rank, naming the key (the dtypes)."""
    results = world4.run_ok(refused_controlnet_layout, *files[preset], parallel, cache, dtype)
    assert len(set(results)) == 1 and results[0][0] == error and says in results[0][1], results


@pytest.mark.parametrize("preset", FAMILY)
def test_a_lora_on_the_controlnet_pipeline_equals_diffusers(world2, files, preset, tmp_path):
    """LoRA and ControlNet together (pp2, exact mode): an adapter loaded into xfuse's ControlNet pipeline (each rank
    its blocks' share) gives diffusers' ControlNet pipeline's latents with the same adapter, within 1e-4, and differs
    from them without it."""
    from tests.support.lora_fns import save_lora

    lora = save_lora(load_pipeline(preset), tmp_path / "a", seed=1, rank=4, alpha=8)
    parallel = {"pipefusion_degree": 2, "warmup_steps": STEPS}
    got = world2.run_ok(xfuse_control_steps, *files[preset], parallel, call_of(preset), HEIGHT, WIDTH, lora=lora,
                        timeout=300)[0]  # fmt: skip
    pipe = diffusers_pipe(files, preset)
    pipe.load_lora_weights(lora, adapter_name="a")
    want = control_steps(pipe, call_of(preset), control_image(HEIGHT, WIDTH))
    assert np.abs(got[0] - want[0]).max() <= 1e-4 and np.abs(got[1] - want[1]).max() <= 1e-4
    assert np.abs(want[0] - expected(files, preset)[0][0]).max() > 1e-3  # the adapter acts (FLUX: 7e-3)
