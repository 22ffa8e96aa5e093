"""The family contract, checked the same way for every family the registry holds, with no per-family test code.

For each family its smallest preset (``ModelSpec.presets[0]``) is saved as a diffusers folder; the diffusers pipeline
the family wraps, loaded from that folder, is the reference, and the family's xfuse class loads the same folder on real
gloo ranks (``tests.support.pipeline_fns.run_calls``):

* exact mode (warm-up = every step) equals diffusers at pp2, pp3 (an odd degree, uneven patches), cfg2 x pp2, Ring 2
  and its hybrids (pp2 x ring2, cfg2 x ring2) and, where the model's head count allows, Ulysses 2, ulysses2 x ring2 and
  pp2 x ulysses2;
* pipelined mode (warm-up 1, M = 3) gives the same latents twice, and the latents of the independent oracle
  (``tests.support.oracle_inputs``: diffusers' own transformer per patch with stale K/V, no xfuse code), which are
  not diffusers' serial ones;
* a call argument diffusers does not have is refused by name, the same on every rank, before any communication;
* LoRA where diffusers' pipeline has a loader (``load_lora_weights``): one LoRA file, made with PEFT and saved by
  diffusers, loaded on xfuse's sharded pipeline at pp2 equals diffusers' pipeline with the same file (and changes the
  image); where diffusers has no loader, neither does xfuse's class;
* the parallel VAE decode (``vae_parallel: on`` at pp2): a family's decode over both ranks (an image VAE's, or Wan's
  causal 3-D VAE's clip) equals diffusers'; a VAE the bands do not run (Qwen-Image's 3-D VAE on one frame) is refused
  by name on every rank at load.

The call comes from the spec alone: a non-square image of 8 x 6 token rows (uneven bands at M = 3 and 4), 3 steps, a
video family's shortest clip of 3 latent frames, and classifier-free guidance through the family's own knob
(``guidance_scale``; a guidance-distilled family's ``true_cfg_scale`` with a negative prompt; none where the pipeline
has no CFG batch, whose cfg2 layouts are then left out). What each family does
beyond the contract (every ``__call__`` argument, its engine-level oracle tests, its own refusals) stays in its own
test module.
"""

import inspect

import diffusers
import numpy as np
import pytest

from tests.support.lora_fns import save_lora
from tests.support.oracle_inputs import oracle_latents
from tests.support.pipeline_fns import (
    check_against_diffusers,
    entered_in_flight,
    load_error,
    reference_runner,
    run_calls,
    run_streamed_and_alone,
)
from tests.support.world import World
from xfuse.families.registry import FAMILIES, transformer_config
from xfuse.parallel.vae_decode import BAND_DECODED_VAES

EXACT = {"warmup_steps": 100}  # warm-up covers every step
STEPS = 3
LAYOUTS = {  # name -> (world size, parallel section)
    "pp2": (2, {"pipefusion_degree": 2, "num_patches": 3}),
    "pp3": (3, {"pipefusion_degree": 3, "num_patches": 4}),
    "cfg2_pp2": (4, {"pipefusion_degree": 2, "cfg_degree": 2}),
    "ulysses2": (2, {"ulysses_degree": 2}),
    "ring2": (2, {"ring_degree": 2}),
    "ulysses2_ring2": (4, {"ulysses_degree": 2, "ring_degree": 2}),
    "pp2_ulysses2": (4, {"pipefusion_degree": 2, "ulysses_degree": 2}),
    "pp2_ring2": (4, {"pipefusion_degree": 2, "ring_degree": 2}),
    "cfg2_ring2": (4, {"cfg_degree": 2, "ring_degree": 2}),
}


def base_call(spec) -> dict:
    """The family's conformance call (see the module docstring), from its spec and its smallest preset's config."""
    config = transformer_config(spec.presets[0])
    side = spec.latent_scale * spec.token_patch(config)  # pixels per token row
    call = dict(prompt="a red house by a lake", height=8 * side, width=6 * side, num_inference_steps=STEPS,
                output_type="np")  # fmt: skip
    accepted = inspect.signature(getattr(diffusers, spec.diffusers_pipeline).__call__).parameters
    if spec.video:
        call["num_frames"] = 1 + 2 * spec.vae_temporal_factor
    if "use_resolution_binning" in accepted:
        call["use_resolution_binning"] = False
    if "clean_caption" in accepted:  # PixArt's caption cleaning needs packages the tests do not install
        call["clean_caption"] = False
    if "true_cfg_scale" in accepted:
        call.update(true_cfg_scale=2.0, negative_prompt="blurry")
    elif not spec.distilled_guidance:
        call["guidance_scale"] = 4.5
    return call


def has_cfg(spec) -> bool:
    """The family's pipeline batches [uncond, cond] (true CFG for a guidance-distilled one)."""
    accepted = inspect.signature(getattr(diffusers, spec.diffusers_pipeline).__call__).parameters
    return "true_cfg_scale" in accepted or not spec.distilled_guidance


def rel_max(actual, expected) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def heads(spec) -> int:
    return spec.num_heads(transformer_config(spec.presets[0]))


CASES = [
    pytest.param(spec, layout, id=f"{spec.name}-{layout}")
    for spec in FAMILIES
    for layout in LAYOUTS
    if not ("ulysses" in layout and heads(spec) % 2) and not ("cfg" in layout and not has_cfg(spec))
]


# The generic adapter (``parallel.adapter: generic``: the model's own forward, context-parallel plan and attention
# dispatcher) on every family with a hand-written stage whose spec also has a ForwardPlan, in the pipeline layouts it
# runs, against the family's own (a family with no hand-written stage runs the generic one in every case above).
GENERIC = [spec for spec in FAMILIES if spec.forward is not None and spec.stage_name is not None]
GENERIC_CASES = [
    pytest.param(spec, layout, id=f"{spec.name}-generic-{layout}")
    for spec in GENERIC
    for layout in ("pp2", "pp3", "cfg2_pp2", "pp2_ulysses2", "pp2_ring2")
    if not ("ulysses" in layout and heads(spec) % 2) and not ("cfg" in layout and not has_cfg(spec))
]

ADAPTERS = [pytest.param(spec, "family", id=spec.name) for spec in FAMILIES] + [
    pytest.param(spec, "generic", id=f"{spec.name}-generic") for spec in GENERIC
]


@pytest.fixture(scope="module")
def worlds():
    """One world per size, started on first use and kept for the module."""
    started: dict[int, World] = {}

    def world(size: int) -> World:
        if size not in started:
            started[size] = World(size, start_timeout=240).__enter__()
        return started[size]

    yield world
    for w in started.values():
        w.__exit__(None, None, None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``spec -> (its folder, diffusers' pipeline on it as a reference runner, diffusers' output class name)``."""
    cache: dict[str, tuple] = {}

    def of(spec):
        if spec.name not in cache:
            preset = spec.presets[0]
            folder = spec.save_preset_pipeline(str(tmp_path_factory.mktemp(spec.name) / preset), preset)
            pipe = getattr(diffusers, spec.diffusers_pipeline).from_pretrained(folder, local_files_only=True)
            reference = reference_runner(pipe)
            output = type(pipe(**{**base_call(spec), "num_inference_steps": 1, "output_type": "latent"})).__name__
            cache[spec.name] = folder, reference, output
        return cache[spec.name]

    return of


@pytest.mark.parametrize("spec,layout", CASES)
def test_exact_mode_equals_diffusers(worlds, saved, spec, layout):
    size, parallel = LAYOUTS[layout]
    folder, reference, output = saved(spec)
    call = base_call(spec)
    results = worlds(size).run_ok(run_calls, folder, {**parallel, **EXACT}, [call], family=spec.name, timeout=600)
    check_against_diffusers(results, {"base": {}}, reference, call, output_class=output, callback_steps=())


@pytest.mark.parametrize("spec,layout", GENERIC_CASES)
def test_the_generic_adapter_in_exact_mode_equals_diffusers(worlds, saved, spec, layout):
    size, parallel = LAYOUTS[layout]
    folder, reference, output = saved(spec)
    call = base_call(spec)
    parallel = {**parallel, **EXACT, "adapter": "generic"}
    results = worlds(size).run_ok(run_calls, folder, parallel, [call], family=spec.name, timeout=600)
    check_against_diffusers(results, {"base": {}}, reference, call, output_class=output, callback_steps=())


@pytest.mark.parametrize("spec,layout", [case for case in GENERIC_CASES if "ulysses" in case.id or "ring" in case.id])
def test_the_generic_adapter_pipelined_equals_the_family_under_sequence_parallelism(worlds, saved, spec, layout):
    """Pipelined (warm-up 1, M = 3) with each rank's chunk of every patch, the generic adapter gives the hand-written
    family's latents (which the family's own tests hold to the oracle), and not the serial ones."""
    size, parallel = LAYOUTS[layout]
    folder, reference, _ = saved(spec)
    call = {**base_call(spec), "output_type": "latent"}
    runs = {}
    for adapter in ("family", "generic"):
        pipelined = {**parallel, "num_patches": 3, "warmup_steps": 1, "adapter": adapter}
        (result,) = worlds(size).run_ok(run_calls, folder, pipelined, [call], family=spec.name, timeout=600)[0]
        assert result["kind"] == "ok", result
        runs[adapter] = result["images"]
    assert rel_max(runs["generic"], runs["family"]) <= 1e-5
    assert rel_max(reference(call)[0], runs["family"]) > 1e-4  # stale K/V matter: the comparison can fail


@pytest.mark.parametrize("spec", GENERIC, ids=[spec.name for spec in GENERIC])
def test_the_generic_adapter_with_step_caching_equals_the_family(worlds, saved, spec):
    """First-Block caching at pp2, pipelined (warm-up 1, M = 3), 6 steps: the generic adapter decides and skips as the
    family does (the same latents), and it skips (not the uncached latents)."""
    folder, _, _ = saved(spec)
    call = {**base_call(spec), "output_type": "latent", "num_inference_steps": 6}
    parallel = {"pipefusion_degree": 2, "num_patches": 3, "warmup_steps": 1}
    cache = {"method": "first_block", "threshold": 1.0}
    runs = {}
    for name, adapter, with_cache in (("family", "family", cache), ("generic", "generic", cache),
                                      ("uncached", "generic", None)):  # fmt: skip
        (result,) = worlds(2).run_ok(run_calls, folder, {**parallel, "adapter": adapter}, [call], family=spec.name,
                                     cache=with_cache, timeout=600)[0]  # fmt: skip
        assert result["kind"] == "ok", result
        runs[name] = result["images"]
    assert rel_max(runs["generic"], runs["family"]) <= 1e-5
    assert rel_max(runs["uncached"], runs["family"]) > 1e-4  # steps were skipped


@pytest.mark.parametrize("spec,adapter", ADAPTERS)
def test_pipelined_is_deterministic_and_equals_the_oracle(worlds, saved, spec, adapter):
    folder, reference, _ = saved(spec)
    call = {**base_call(spec), "output_type": "latent"}
    parallel = {"pipefusion_degree": 2, "num_patches": 3, "warmup_steps": 1, "adapter": adapter}
    first, second = worlds(2).run_ok(run_calls, folder, parallel, [call, call], family=spec.name, timeout=600)[0]
    assert first["kind"] == second["kind"] == "ok", (first, second)
    assert np.array_equal(first["images"], second["images"])
    expected = oracle_latents(reference.pipe, call, num_patches=3, warmup=1).numpy()
    assert rel_max(first["images"], expected) <= 1e-5
    assert rel_max(reference(call)[0], expected) > 1e-4  # stale K/V matter here: the oracle is not serial


@pytest.mark.parametrize("spec", FAMILIES, ids=[spec.name for spec in FAMILIES])
def test_an_unknown_argument_is_refused_by_name_on_every_rank(worlds, saved, spec):
    folder, _, _ = saved(spec)
    call = {**base_call(spec), "unknown_argument": 1}
    per_rank = worlds(2).run_ok(run_calls, folder, {"pipefusion_degree": 2}, [call], family=spec.name, timeout=600)
    for results in per_rank:
        assert results[0]["kind"] == "error" and results[0]["type"] == "TypeError", results
        assert "unknown_argument" in results[0]["message"]


@pytest.mark.parametrize("spec,adapter", ADAPTERS)
def test_lora_where_diffusers_has_a_loader(worlds, saved, spec, adapter, tmp_path_factory):
    loader = getattr(getattr(diffusers, spec.diffusers_pipeline), "load_lora_weights", None)
    if loader is None:  # nothing promised that diffusers' own pipeline does not have
        assert not hasattr(spec.pipeline_class(), "load_lora_weights"), spec.name
        return
    folder, reference, output = saved(spec)
    lora = save_lora(reference.pipe, tmp_path_factory.mktemp(f"{spec.name}-{adapter}-lora"), seed=1, rank=4, alpha=8)
    with_lora = getattr(diffusers, spec.diffusers_pipeline).from_pretrained(folder, local_files_only=True)
    with_lora.load_lora_weights(lora)
    call = base_call(spec)
    parallel = {"pipefusion_degree": 2, **EXACT, "adapter": adapter}
    results = worlds(2).run_ok(run_calls, folder, parallel, [call], family=spec.name, lora=lora, timeout=600)
    check_against_diffusers(results, {"base": {}}, reference_runner(with_lora), call, output_class=output,
                            callback_steps=())  # fmt: skip
    assert np.abs(results[0][0]["images"] - reference(call)[0]).max() > 1e-3  # the LoRA changed the image


@pytest.mark.parametrize("spec", FAMILIES, ids=[spec.name for spec in FAMILIES])
def test_the_parallel_vae_decode(worlds, saved, spec):
    folder, reference, output = saved(spec)
    parallel = {"pipefusion_degree": 2, "vae_parallel": "on", **EXACT}
    if type(reference.pipe.vae).__name__ not in BAND_DECODED_VAES:  # Qwen-Image's 3-D VAE: rank 0 decodes it
        errors = worlds(2).run_ok(load_error, folder, parallel, spec.name, timeout=600)
        assert len(set(errors)) == 1, errors  # the same on every rank
        kind, message = errors[0]
        assert kind == "ConfigError" and "parallel.vae_parallel" in message, errors[0]
        return
    call = base_call(spec)
    results = worlds(2).run_ok(run_calls, folder, parallel, [call], family=spec.name, timeout=600)
    check_against_diffusers(results, {"base": {}}, reference, call, output_class=output, callback_steps=())
    assert results[0][0]["decode_ranks"] == 2


@pytest.mark.parametrize("warmup_steps", [1, 0])
@pytest.mark.parametrize("spec,adapter", ADAPTERS)
def test_each_call_of_a_stream_is_bitwise_the_call_alone(worlds, saved, spec, adapter, warmup_steps):
    """Two calls of different seeds, prompts and step counts as one stream (``run_stream``) at pp2, pipelined
    (without warm-up the first step's patches attend to what their call wrote so far, and an MMDiT's text K/V come
    from the step's first patch): each image is the call's alone, bit for bit, and the second call's tasks ran
    before the first's last."""
    folder, _, _ = saved(spec)
    call = base_call(spec)
    calls = [dict(call, seed=1), dict(call, seed=2, prompt="a lighthouse at dusk", num_inference_steps=STEPS - 1)]
    parallel = {"pipefusion_degree": 2, "num_patches": 3, "warmup_steps": warmup_steps, "adapter": adapter}
    results = worlds(2).run_ok(run_streamed_and_alone, folder, parallel, calls, family=spec.name, timeout=600)
    rank0 = results[0]
    for index in range(len(calls)):
        assert np.array_equal(rank0["streamed"][index], rank0["alone"][index]), index
        assert np.array_equal(rank0["again"][index], rank0["alone"][index]), index
    assert not np.array_equal(rank0["alone"][0], rank0["alone"][1])
    assert all(sorted({task[0] for task in r["tasks"]}) == [0, 1] for r in results)
    assert entered_in_flight(results, 1)  # the second call's first task ran before the first call's last ended
