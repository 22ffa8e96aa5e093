"""PixArt-Σ, the second family: its stage against diffusers' forward, the pipelined engine against the independent
oracle, and ``PipeFusionPixArtSigmaPipeline`` against diffusers' own ``PixArtSigmaPipeline`` from the same folder
(the CLI on a PixArt folder: tests/launch/test_cli.py).

Sizes are non-square (128 x 96 px: 8 x 6 token rows) so that M = N + 1 gives uneven bands.
"""

import copy

import numpy as np
import pytest
import torch
from diffusers import PixArtSigmaPipeline

from tests.support.engine_fns import inject_unrefreshed_kv
from tests.support.pipefusion_oracle import pipefusion_reference
from tests.support.pipeline_fns import check_against_diffusers as check
from tests.support.pipeline_fns import legacy_callback, reference_runner, run_calls
from tests.support.pixart_fns import engine_latents, from_pipe_call, prepare_inputs, run_engine, tiny_pixart
from tests.support.world import World
from xfuse.config import ParallelConfig
from xfuse.families.pixart.presets import save_preset_pipeline
from xfuse.families.pixart.stage import PixArtStage
from xfuse.families.registry import PIXART_SIGMA
from xfuse.parallel.patch_grid import patch_grid

HEIGHT, WIDTH, STEPS = 128, 96, 3
PLACEMENTS = ("linear", "folded")
BASE = dict(
    prompt="a red house by a lake",
    height=HEIGHT,
    width=WIDTH,
    num_inference_steps=STEPS,
    output_type="np",
    use_resolution_binning=False,
    clean_caption=False,
)
EXACT = {"warmup_steps": 100}


def rel_max(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def plan(degree, placement):
    return PIXART_SIGMA.plan(8, ParallelConfig(pipefusion_degree=degree, placement=placement))


# --- the stage, in one process --------------------------------------------------------------------------------


@pytest.mark.parametrize("degree,placement", [(1, "linear"), (2, "linear"), (3, "linear"), (4, "folded")])
def test_same_input_replay_patch_by_patch_equals_the_whole_image_pass(degree, placement):
    """The same-input replay (docs/models.md; the shared research/models.md §1.6): after a whole-image pass has
    filled the K/V buffers, the same input patch by patch (uneven bands, positions sliced from the whole table)
    gives the whole-image output; both equal diffusers' forward."""
    model = tiny_pixart().transformer
    g = torch.Generator().manual_seed(1)
    latents, text = torch.randn(2, 4, 16, 12, generator=g), torch.randn(2, 300, 32, generator=g)
    mask = torch.ones(2, 300)
    mask[0, 20:] = 0  # padding: the cross-attention bias must mask it
    t = torch.tensor([500, 500])
    the_plan = plan(degree, placement)
    stages = {r: PixArtStage(copy.deepcopy(model), the_plan, r) for r in range(degree)}
    with torch.no_grad():
        expected = model(
            latents,
            encoder_hidden_states=text,
            encoder_attention_mask=mask,
            timestep=t,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
            return_dict=False,
        )[0]
        for stage in stages.values():
            stage.begin_request(patch_grid(16, 12, 1, 2))
        bias = ((1 - mask) * -10000.0).unsqueeze(1)  # (B, 1, S_text), as the model's forward builds it
        cond = stages[0].conditioning(t, stages[0].text_states(text), bias, torch.float32)
        outputs = {}
        for num_patches in (1, degree + 2):  # the whole image first: it fills the K/V buffers
            grid = patch_grid(16, 12, num_patches, 2)
            bands, parts = ([None] if num_patches == 1 else list(grid)), []
            for band in bands:
                rows = slice(None) if band is None else band.latent_rows
                hidden = stages[the_plan.embed_rank].embed(latents[:, :, rows], band)  # (B, tokens, hidden)
                for segment in the_plan.route:
                    hidden = stages[segment.rank].run_segment(hidden, segment, cond, band, {})
                parts.append(stages[the_plan.output_rank].head(hidden, cond, grid.token_cols))
            outputs[num_patches] = torch.cat(parts, dim=2)  # bands stacked along latent rows
    assert (outputs[1] - expected).abs().max().item() <= 1e-5
    assert (outputs[degree + 2] - expected).abs().max().item() <= 1e-5


def test_a_band_embedded_by_diffusers_gets_wrong_positions():
    """Why the stage slices the whole table: ``PatchEmbed.forward`` rescales the grid to the band's height."""
    embed = tiny_pixart().transformer.pos_embed
    stage = PixArtStage(copy.deepcopy(tiny_pixart().transformer), plan(1, "linear"), 0)
    grid = patch_grid(16, 12, 2, 2)
    stage.begin_request(grid)
    band_rows = torch.randn(1, 4, 8, 12)
    with torch.no_grad():
        sliced, recomputed = stage.embed(band_rows, grid[1]), embed(band_rows)
    assert (sliced - recomputed).abs().max().item() > 0.1


# --- the engine on real ranks against the oracle and against diffusers -----------------------------------------


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


_ORACLE, _SERIAL = {}, {}


def oracle(num_patches, warmup, guidance_scale=4.5):
    key = (num_patches, warmup, guidance_scale)
    if key not in _ORACLE:
        pipe = tiny_pixart()
        inputs = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS, guidance_scale=guidance_scale)
        _ORACLE[key] = pipefusion_reference(
            pipe, inputs, height=HEIGHT, width=WIDTH, num_patches=num_patches, warmup=warmup
        )
    return _ORACLE[key]


def serial(guidance_scale=4.5):
    """diffusers' PixArtSigmaPipeline on the same latents and embeddings (output_type latent)."""
    if guidance_scale not in _SERIAL:
        pipe = tiny_pixart()
        inputs = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS, guidance_scale=guidance_scale)
        n = inputs["latents"].shape[0]
        emb, mask = inputs["prompt_embeds"], inputs["prompt_attention_mask"]
        text = dict(prompt_embeds=emb[-n:], prompt_attention_mask=mask[-n:])
        if guidance_scale > 1:
            text.update(negative_prompt_embeds=emb[:n], negative_prompt_attention_mask=mask[:n])
        _SERIAL[guidance_scale] = pipe(
            **text,
            negative_prompt=None,
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=STEPS,
            guidance_scale=guidance_scale,
            latents=inputs["latents"].clone(),
            output_type="latent",
            use_resolution_binning=False,
        ).images
    return _SERIAL[guidance_scale]


@pytest.mark.parametrize("guidance_scale", [4.5, 1.0])  # CFG batched, and no CFG
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("degree", [2, 3, 4])
def test_exact_mode_equals_diffusers(world4, degree, placement, guidance_scale):
    out = world4.run_ok(run_engine, degree, placement, degree + 1, STEPS, guidance_scale=guidance_scale)[0]
    # Float rounding only: exact mode runs the [uncond, cond] halves as separate batch parts, whose GEMMs round
    # differently from diffusers' batched ones (observed 7e-7 of latents of magnitude ~600 here).
    assert rel_max(out, serial(guidance_scale)) <= 2e-6


@pytest.mark.parametrize("warmup", [0, 1])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("degree", [2, 3, 4])
def test_pipelined_equals_the_oracle(world4, degree, placement, warmup):
    """DPM-Solver++ 2M (state kept per patch) with M = 1, 2 and N + 1 (uneven bands)."""
    for num_patches in sorted({1, 2, degree + 1}):
        out = world4.run_ok(run_engine, degree, placement, num_patches, warmup)[0]
        assert rel_max(out, oracle(num_patches, warmup)) <= 1e-5, (num_patches, warmup)
    assert rel_max(oracle(2, warmup), serial()) > 1e-4  # stale K/V matter here: the oracle is not serial


def test_balanced_on_a_family_without_long_skips(world4):
    """Balanced at degree 3 (8 blocks: totals 3/3/2, each split between the way out and the way back; at 2 and 4 it
    is folded's plan): exact mode equals diffusers, pipelined (M = 4) equals the oracle."""
    exact = world4.run_ok(run_engine, 3, "balanced", 4, STEPS)[0]
    assert rel_max(exact, serial()) <= 2e-6  # float rounding of the batch parts, as in exact mode above
    piped = world4.run_ok(run_engine, 3, "balanced", 4, 1)[0]
    assert rel_max(piped, oracle(4, 1)) <= 1e-5


def test_oracle_catches_recomputed_positions_and_unrefreshed_kv(monkeypatch):
    """Injected bugs: a band embedded by diffusers' ``PatchEmbed.forward`` (grid rescaled to the band), and patch
    K/V never written after warm-up."""
    pipe = tiny_pixart()
    the_plan, grid = plan(1, "linear"), patch_grid(HEIGHT // 8, WIDTH // 8, 2, 2)

    def run():
        inputs = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS)  # also resets the scheduler
        stages = {0: PixArtStage(copy.deepcopy(pipe.transformer), the_plan, 0)}
        return engine_latents(stages, the_plan, inputs, copy.deepcopy(pipe.scheduler), grid, warmup=1)

    assert rel_max(run(), oracle(2, 1)) <= 1e-5
    monkeypatch.setattr(PixArtStage, "embed", lambda self, rows, band: self.transformer.pos_embed(rows))
    assert rel_max(run(), oracle(2, 1)) > 1e-3  # observed 1.7e-3; the oracle is 2.9e-4 from serial here
    monkeypatch.undo()
    inject_unrefreshed_kv(monkeypatch)
    assert rel_max(run(), oracle(2, 1)) > 1e-4  # observed 6.3e-4


# --- the pipeline class against diffusers.PixArtSigmaPipeline -------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preset_pipeline(tmp_path_factory.mktemp("pixart") / "PixArt-Sigma-tiny")


@pytest.fixture(scope="module")
def reference(folder):
    return reference_runner(PixArtSigmaPipeline.from_pretrained(folder, local_files_only=True))


def honoured_calls(reference):
    """Every ``PixArtSigmaPipeline.__call__`` argument, each in a call diffusers runs too."""
    with torch.no_grad():
        emb, mask, neg, neg_mask = reference.pipe.encode_prompt("a red house by a lake", True, negative_prompt="ugly")
    return {
        "base": {},
        "no_guidance": dict(guidance_scale=1.0),
        "batch_and_images": dict(prompt=["a red house", "a cat"], num_images_per_prompt=2, negative_prompt="dark"),
        "size_and_steps": dict(height=96, width=128, num_inference_steps=2),
        "custom_timesteps": dict(timesteps=[999, 500, 100]),
        "latents": dict(latents=torch.randn(1, 4, 16, 12, generator=torch.Generator().manual_seed(7))),
        "prompt_embeds": dict(
            prompt=None,
            negative_prompt=None,
            prompt_embeds=emb,
            prompt_attention_mask=mask,
            negative_prompt_embeds=neg,
            negative_prompt_attention_mask=neg_mask,
        ),
        "max_sequence_length": dict(max_sequence_length=20),
        "callback": dict(callback=legacy_callback, callback_steps=2),
        "output_pil_binned": dict(output_type="pil", use_resolution_binning=True, height=200, width=260),
        "output_latent": dict(output_type="latent"),
        "return_tuple": dict(return_dict=False),
        "seed": dict(seed=3),
    }


def check_against_diffusers(per_rank, calls, reference):
    check(per_rank, calls, reference, BASE, output_class="ImagePipelineOutput", callback_steps=[0, 2])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_argument_honoured_at_pp4(world4, folder, reference, placement):
    calls = honoured_calls(reference)
    parallel = {"pipefusion_degree": 4, "num_patches": 3, "placement": placement, **EXACT}
    results = world4.run_ok(
        run_calls, folder, parallel, [{**BASE, **c} for c in calls.values()], family="pixart-sigma", timeout=600
    )
    check_against_diffusers(results, calls, reference)


@pytest.fixture(scope="module")
def world3():
    with World(3, start_timeout=240) as w:
        yield w


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_pp3_from_the_folder(world3, folder, reference, placement):
    """An odd degree: 8 blocks as 3 + 3 + 2 (linear) or chunks 2, 1, 1 and their mirrors (folded); M = 4 on 8 rows."""
    calls = {k: v for k, v in honoured_calls(reference).items() if k in ("base", "no_guidance", "batch_and_images")}
    parallel = {"pipefusion_degree": 3, "num_patches": 4, "placement": placement, **EXACT}
    results = world3.run_ok(
        run_calls, folder, parallel, [{**BASE, **c} for c in calls.values()], family="pixart-sigma", timeout=600
    )
    check_against_diffusers(results, calls, reference)


def test_cfg_parallel_calls(world4, folder, reference):
    calls = {k: v for k, v in honoured_calls(reference).items() if k in ("base", "batch_and_images", "callback")}
    parallel = {"pipefusion_degree": 2, "cfg_degree": 2, **EXACT}
    results = world4.run_ok(
        run_calls, folder, parallel, [{**BASE, **c} for c in calls.values()], family="pixart-sigma", timeout=600
    )
    check_against_diffusers(results, calls, reference)


def test_from_pipe_equals_diffusers_and_refuses_another_family(world4, reference):
    results = world4.run_ok(from_pipe_call, {"pipefusion_degree": 2, "cfg_degree": 2, **EXACT}, BASE, timeout=300)
    assert all("takes a PixArtSigmaPipeline" in refused for refused, _ in results)
    assert all(images is None for _, images in results[1:])
    assert np.abs(results[0][1] - reference(BASE)[0]).max() <= 1e-4
