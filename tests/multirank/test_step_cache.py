"""Step caching on PipeFusion (``xfuse/parallel/step_cache.py``): the engine on real ranks against the independent
oracle with the same semantics (``tests.support.pipefusion_oracle.FirstBlockCache``), threshold 0 against no
caching, injected bugs (a skipped step that refreshes K/V; a rank that takes another decision: named, not hung), and
the pipelines against diffusers' own First-Block Cache (``diffusers.hooks.apply_first_block_cache``): at degree 1 for
four families, and at pp2 in exact mode.

The tiny HunyuanDiT (16 blocks with long skips, 8 x 6 tokens) at 10 DDIM steps; thresholds chosen so that some steps
are skipped and some computed (each test asserts both).
"""

import numpy as np
import pytest
import torch
from diffusers import HunyuanDiTPipeline

from tests.support.diffusers_cache import with_first_block_cache
from tests.support.engine_fns import (
    calls_with_a_flipped_decision,
    run_engine,
    run_engine_refreshing_skipped_kv,
    tiny_pipe,
)
from tests.support.pipefusion_oracle import pipefusion_reference
from tests.support.pipeline_fns import as_array, run_calls
from tests.support.sequence_fns import inputs_of, run_sequence
from tests.support.world import World
from xfuse.families.hunyuandit.presets import save_tiny_pipeline
from xfuse.families.hunyuandit.reference import prepare_inputs
from xfuse.families.registry import load_pipeline, model_spec

HEIGHT, WIDTH, STEPS = 128, 96, 10
ENGINE = dict(height=HEIGHT, width=WIDTH, steps=STEPS, scheduler="DDIMScheduler")


def rel_max(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


_ORACLE = {}


def oracle(num_patches, warmup, cache):
    key = (num_patches, warmup, tuple(sorted(cache.items())))
    if key not in _ORACLE:
        pipe = tiny_pipe("DDIMScheduler")
        inputs = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS)
        latents, decisions = pipefusion_reference(
            pipe, inputs, height=HEIGHT, width=WIDTH, num_patches=num_patches, warmup=warmup, cache=cache
        )
        _ORACLE[key] = latents, [decisions[step] for step in range(STEPS)]
    return _ORACLE[key]


def test_threshold_0_is_the_uncached_run(world4):
    """Nothing is skipped at threshold 0 and the latents are bitwise those of the engine without caching (block 0
    run as a segment of its own computes the same numbers). Warm-up 0: with caching a whole-image step runs its
    [uncond, cond] batch as one (the uncached engine streams it in two parts, whose GEMMs round otherwise)."""
    plain = world4.run_ok(run_engine, 4, "balanced", 5, 0, **ENGINE)
    cached = world4.run_ok(run_engine, 4, "balanced", 5, 0, **ENGINE, cache={"method": "first_block", "threshold": 0})
    assert torch.equal(cached[0]["latents"], plain[0]["latents"])
    assert all(r["cache_decisions"] == [True] * STEPS for r in cached)


@pytest.mark.parametrize("method", ["first_block", "taylor"])
@pytest.mark.parametrize("degree,placement", [(2, "linear"), (3, "folded"), (4, "balanced")])
def test_pipelined_with_caching_equals_the_oracle(world4, degree, placement, method):
    """M = N + 1 (uneven bands), warm-up 1, two cached warm-up steps: every rank takes the oracle's decisions and
    the latents equal the oracle's (the engine adds per-segment residuals, the oracle the whole tail's)."""
    cache = {"method": method, "threshold": 0.2, "warmup_steps": 2}
    results = world4.run_ok(run_engine, degree, placement, degree + 1, 1, **ENGINE, cache=cache)
    expected, decisions = oracle(degree + 1, 1, cache)
    assert 2 <= decisions.count(False) <= STEPS - 4, decisions  # skipped and computed steps both
    assert all(r["cache_decisions"] == decisions for r in results[:degree])
    assert rel_max(results[0]["latents"], expected) <= 1e-5
    uncached, _ = oracle(degree + 1, 1, {**cache, "threshold": 0.0})
    assert rel_max(expected, uncached) > 1e-3  # the skips change the result: the comparison above means something


def test_max_skips_bounds_a_run_of_skips(world4):
    cache = {"method": "first_block", "threshold": 0.6, "warmup_steps": 1, "max_skips": 2}
    results = world4.run_ok(run_engine, 2, "linear", 3, 1, **ENGINE, cache=cache)
    expected, decisions = oracle(3, 1, cache)
    assert decisions == results[0]["cache_decisions"] and "FFF" not in "".join("TF"[not d] for d in decisions)
    assert decisions.count(False) >= 4, decisions
    assert rel_max(results[0]["latents"], expected) <= 1e-5


def test_a_skipped_step_that_refreshes_kv_fails_the_oracle(world4):
    """The stale K/V of a skipped step's blocks stay as of the last computed step: running them anyway (writing
    K/V the other patches then read) changes the result beyond the oracle's tolerance."""
    cache = {"method": "first_block", "threshold": 0.2, "warmup_steps": 2}
    expected, _ = oracle(3, 1, cache)
    broken = world4.run_ok(run_engine_refreshing_skipped_kv, 2, "linear", 3, 1, **ENGINE, cache=cache)
    assert rel_max(broken[0]["latents"], expected) > 1e-3


SP_CASES = {
    "pp2xulysses2": (dict(pp=2, ulysses=2), {"method": "first_block", "threshold": 0.5}),
    "pp2xring2": (dict(pp=2, ring=2), {"method": "taylor", "threshold": 1.0, "max_skips": 3}),
}


@pytest.mark.parametrize("layout", SP_CASES)
def test_sequence_parallel_stages_with_caching_equal_the_oracle(world4, layout):
    """PipeFusion x Ulysses / Ring (M = 3, warm-up 1, DDPM with CFG): each SP group sums block 0's change over its
    ranks' chunks, so its ranks take one decision on the whole patch, the oracle's. Residuals are kept at their
    positions in the image: a rank's chunks of the patches are not its chunk of the whole image, which is why the
    first pipelined step is always computed (ring: threshold 1.0 would skip it). A skipped task's output layer
    gathers its own patch's chunks (not those of the last pass the rank made)."""
    parallel, cache = SP_CASES[layout]
    results = world4.run_ok(run_sequence, "tiny", num_patches=3, warmup=1, height=HEIGHT, width=WIDTH, steps=STEPS,
                            cfg=5.0, cache=cache, **parallel)  # fmt: skip
    pipe, inputs = inputs_of("tiny", height=HEIGHT, width=WIDTH, steps=STEPS, cfg=5.0)
    expected, by_step = pipefusion_reference(pipe, inputs, height=HEIGHT, width=WIDTH, num_patches=3, warmup=1,
                                             cache=cache)  # fmt: skip
    decisions = [by_step[step] for step in range(STEPS)]
    assert decisions[:2] == [True, True] and 2 <= decisions.count(False) <= STEPS - 3, decisions
    assert all(r[1] == decisions for r in results)  # every rank of both SP groups
    assert rel_max(results[0][0], expected) <= 1e-5


# --- the pipelines ------------------------------------------------------------------------------------------------

# use_resolution_binning off: HunyuanDiT's pipeline would draw 128 x 96 px at 1,024 x 768
CALL = dict(prompt="a red house by a lake", height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
            output_type="latent", seed=0, use_resolution_binning=False)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "HunyuanDiT-tiny")


def diffusers_first_block_cache(pipe, threshold, call):
    call = dict(call)
    generator = torch.Generator().manual_seed(call.pop("seed"))
    pipe.set_progress_bar_config(disable=True)
    return as_array(with_first_block_cache(pipe, threshold)(**call, generator=generator))


@pytest.mark.parametrize("layout", [{"pipefusion_degree": 4}, {"pipefusion_degree": 2, "ulysses_degree": 2}],
                         ids=["pp4", "pp2xulysses2"])  # fmt: skip
def test_exact_mode_with_caching_equals_diffusers_first_block_cache(world4, folder, layout):
    """pp4 (balanced), and pp2 x Ulysses 2, warm-up = all steps: every step a whole-image pass through the ranks, the
    decision on the whole [uncond, cond] batch, as diffusers' hook decides on the pipeline's one batched call (an SP
    group sums the change over its ranks' chunks)."""
    expected = diffusers_first_block_cache(HunyuanDiTPipeline.from_pretrained(folder), 0.3, CALL)
    parallel = {**layout, "warmup_steps": STEPS}
    cache = {"method": "first_block", "threshold": 0.3}
    results = world4.run_ok(run_calls, folder, parallel, [CALL], cache=cache)
    out = results[0][0]
    computed, skipped = out["cache_steps"]
    assert skipped >= 1 and computed + skipped == STEPS
    assert all(r[0]["cache_steps"] == (computed, skipped) for r in results)  # every rank took the same decisions
    assert np.abs(out["images"] - expected).max() <= 1e-4


def test_cfg_groups_decide_on_their_own_halves(world4, folder):
    """cfg 2 x pp 2: each CFG group decides on its half of the batch (as diffusers decides per cache context where a
    pipeline makes two calls). At this threshold the halves skip different steps (the unconditional group 8 of 10, the
    conditional 6; at 0.35-0.5, 0.65 and 0.75 the two halves skip the same steps at 128 x 96 px): one decision shared
    by both groups would give the same counts. Deterministic across calls."""
    parallel = {"cfg_degree": 2, "pipefusion_degree": 2, "num_patches": 3, "warmup_steps": 1}
    cache = {"method": "first_block", "threshold": 0.9, "warmup_steps": 2}
    per_rank = world4.run_ok(run_calls, folder, parallel, [CALL, CALL], cache=cache)
    steps = [rank_results[0]["cache_steps"] for rank_results in per_rank]  # ranks 0, 1: group 0; 2, 3: group 1
    assert steps[0] == steps[1] and steps[2] == steps[3] and steps[0] != steps[2], steps
    first, second = per_rank[0]
    assert np.array_equal(first["images"], second["images"])


@pytest.mark.parametrize(
    "preset,threshold,layout",
    [
        ("flux-tiny", 0.5, {"pipefusion_degree": 4}),
        ("flux-tiny", 0.5, {"pipefusion_degree": 2, "ulysses_degree": 2}),
        ("wan-tiny", 0.1, {"pipefusion_degree": 4}),
        ("qwen-image-tiny", 0.5, {"pipefusion_degree": 2, "ring_degree": 2}),
    ],
    ids=["flux-pp4", "flux-pp2xulysses2", "wan-pp4", "qwen-image-pp2xring2"],
)
def test_exact_mode_with_caching_equals_diffusers_on_mmdit_and_video(world4, tmp_path, preset, threshold, layout):
    """Exact mode: FLUX (the text stream's residual handed on with the step's first patch; under Ulysses each rank
    keeps its chunk of the text's), Wan (pp4, 4 blocks: rank 0's segment is block 0 alone) and Qwen-Image (pp2 x Ring 2:
    each ring rank's chunk of the text) equal diffusers' hook on the same model."""
    folder = model_spec(preset).save_preset_pipeline(tmp_path / preset, preset)
    call = {**_preset_call(preset), "seed": 0}
    parallel = {**layout, "warmup_steps": call["num_inference_steps"]}
    cache = {"method": "first_block", "threshold": threshold}
    family = model_spec(preset).name
    out = world4.run_ok(run_calls, folder, parallel, [call], family=family, cache=cache)[0][0]
    expected = diffusers_first_block_cache(load_pipeline(preset), threshold, call)
    assert out["cache_steps"][1] >= 1, out["cache_steps"]
    assert np.abs(out["images"] - expected).max() <= 1e-5 * max(1.0, float(np.abs(expected).max()))


# --- degree 1: diffusers' own hook on the same model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def world1():
    with World(1, start_timeout=240) as w:
        yield w


def degree1_call(preset, threshold):
    """Rank function: ``preset``'s xfuse pipeline at degree 1 with First-Block Cache; (latents, decisions)."""
    pipe = (
        model_spec(preset)
        .pipeline_class()
        .from_pipe(load_pipeline(preset), cache={"method": "first_block", "threshold": threshold})
    )
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**_preset_call(preset), generator=torch.Generator().manual_seed(0))
    return as_array(out), pipe.engine.cache_decisions


@pytest.mark.parametrize("preset,threshold", [("sd3-tiny", 0.3), ("flux2-tiny", 0.8), ("z-image-tiny", 0.8)])
def test_pipelined_with_caching_runs_the_same_decisions_on_every_rank(world4, world1, tmp_path, preset, threshold):
    """SD3, FLUX.2 and Z-Image (no diffusers reference: its hook fails on SD3's last block, which returns no text, on
    FLUX.2's single blocks, which then return one tensor, and on Z-Image's blocks, whose input is not named
    ``hidden_states``; Z-Image's cached residual starts at the noise refiner's first block, the chain's first): exact
    mode at pp4 equals xfuse's own degree-1 run with the same cache (the same decisions on the whole batch), and a
    pipelined run (M = 5) is deterministic."""
    folder = model_spec(preset).save_preset_pipeline(tmp_path / preset, preset)
    call = {**_preset_call(preset), "seed": 0}
    cache = {"method": "first_block", "threshold": threshold}
    exact = {"pipefusion_degree": 4, "warmup_steps": call["num_inference_steps"]}
    family = model_spec(preset).name
    out = world4.run_ok(run_calls, folder, exact, [call], family=family, cache=cache)[0][0]
    (latents, decisions) = world1.run_ok(degree1_call, preset, threshold)[0]
    assert decisions.count(False) >= 1 and out["cache_steps"] == (decisions.count(True), decisions.count(False))
    assert np.abs(out["images"] - latents).max() <= 1e-5 * max(1.0, float(np.abs(latents).max()))
    piped = {"pipefusion_degree": 4, "num_patches": 5, "warmup_steps": 1}
    first, second = world4.run_ok(run_calls, folder, piped, [call, call], family=family, cache=cache)[0]
    assert np.array_equal(first["images"], second["images"]) and first["cache_steps"][1] >= 1


# The sizes of the presets whose pipelines default to 1024 px where attention is most of the cost (HunyuanDiT's
# resolution binning, Z-Image's default): 256 px keeps several patches per rank at pp4 and a sixteenth of the tokens.
_SIZE = {
    "tiny": dict(height=256, width=256, use_resolution_binning=False),
    "z-image-tiny": dict(height=256, width=256),
}


def _preset_call(preset):
    video = dict(num_frames=9, height=64, width=96) if preset.startswith("wan") else {}
    return dict(prompt="a cat", num_inference_steps=8, output_type="latent", **video, **_SIZE.get(preset, {}))


@pytest.mark.parametrize(
    "preset,threshold",
    [("tiny", 0.3), ("pixart-tiny", 0.1), ("flux-tiny", 0.5), ("wan-tiny", 0.1), ("qwen-image-tiny", 0.5)],
)
def test_degree_1_equals_diffusers_first_block_cache(world1, preset, threshold):
    """The same threshold on the same model: HunyuanDiT (its block described to diffusers' hooks), PixArt-Σ (run
    inside one cache context), FLUX, Wan and Qwen-Image (their pipelines set the contexts; Wan's CFG: diffusers decides
    per call, xfuse on the batch, and here both decide alike). SD3 is not compared: diffusers' hook fails on SD3's last
    block, which returns no text."""
    (latents, decisions) = world1.run_ok(degree1_call, preset, threshold)[0]
    expected = diffusers_first_block_cache(load_pipeline(preset), threshold, {**_preset_call(preset), "seed": 0})
    assert decisions.count(False) >= 1, decisions
    assert np.abs(latents - expected).max() <= 1e-5 * max(1.0, float(np.abs(expected).max()))


# Last: the world stops on it (a failure anywhere ends every rank), so no test of this module may follow on world4.
def test_ranks_that_decide_differently_are_named_not_hung(world4, folder):
    """Rank 1 ignores the decision its first task carries at step 5 (an injected bug): the schedule is the same either
    way, so nothing hangs, and after the loop the world stops with every rank naming the step and both decisions."""
    parallel = {"pipefusion_degree": 4, "num_patches": 4, "warmup_steps": 1}
    cache = {"method": "first_block", "threshold": 0.3, "warmup_steps": 2}
    results = world4.run_ok(calls_with_a_flipped_decision, folder, parallel, [CALL], 5, cache)
    named = "step cache: the ranks of pipeline group 0 took different decisions at step 5: rank 0 computed it, rank 1 "
    for rank_results in results:
        assert rank_results[0]["kind"] == "error", rank_results
        assert named + "skipped it" in rank_results[0]["message"], rank_results[0]["message"]
