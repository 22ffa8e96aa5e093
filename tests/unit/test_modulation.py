"""Per-pass work a pipelined step no longer repeats: adaptive-norm products once per step (memoised, prefetched by
the engine after a step's last task), and the joint K/V read from buffers that keep the text's beside the image's.
Both change where work happens, never a number: the engine's latents are compared bitwise with the work done per
pass."""

import copy

import pytest
import torch
from diffusers.models.normalization import AdaLayerNormZero
from torch import nn

from tests.support.mmdit_fns import engine_latents, grid_of, prepare_inputs, tiny
from xfuse.config import ParallelConfig
from xfuse.families.common.modulation import MemoLinear, MemoSiLU, memoize_modulation, prefetch_modulation
from xfuse.families.registry import model_spec
from xfuse.parallel.stale_kv import StaleKVCache

STEPS = 4


def _norm() -> AdaLayerNormZero:
    torch.manual_seed(0)
    norm = AdaLayerNormZero(8)
    assert len(memoize_modulation(norm)) == 1
    return norm


class _Count:
    """Counts the products ``nn.Linear.forward`` really computes for ``linears`` (a memo hit never reaches it)."""

    def __init__(self, monkeypatch, linears):
        self.calls = 0
        forward = nn.Linear.forward

        def counted(module, x):
            self.calls += any(module is linear for linear in linears)
            return forward(module, x)

        monkeypatch.setattr(nn.Linear, "forward", counted)


def _modulation(norm, emb):
    return norm(torch.ones(1, 3, 8), emb=emb)[1]  # gate_msa: a chunk of linear(silu(emb))


@pytest.mark.parametrize(
    "second_input, expect_recompute",
    [
        ("same tensor", False),
        ("equal values, new tensor", True),  # identity, not value: no comparison that waits for a device
        ("same tensor changed in place", True),
        ("output chunk changed in place", True),
        ("under autograd", True),
    ],
)
def test_memo_recomputes_exactly_when_its_input_or_output_may_differ(monkeypatch, second_input, expect_recompute):
    norm = _norm()
    count = _Count(monkeypatch, [norm.linear])
    emb = torch.randn(1, 8)
    with torch.no_grad():
        first = _modulation(norm, emb)
        if second_input == "equal values, new tensor":
            emb = emb.clone()
        elif second_input == "same tensor changed in place":
            emb.mul_(2.0)
        elif second_input == "output chunk changed in place":
            first.add_(1.0)
    if second_input == "under autograd":
        with torch.enable_grad():
            _modulation(norm, emb)
            _modulation(norm, emb)
        assert count.calls == 3
        return
    with torch.no_grad():
        second = _modulation(norm, emb)
    assert count.calls == (2 if expect_recompute else 1)
    with torch.no_grad():
        torch.testing.assert_close(second, _modulation(copy.deepcopy(norm), emb.clone()), rtol=0, atol=0)


def test_no_memo_for_inference_tensors(monkeypatch):
    norm = _norm()
    count = _Count(monkeypatch, [norm.linear])
    with torch.inference_mode():
        emb = torch.randn(1, 8)
        _modulation(norm, emb)
        _modulation(norm, emb)
    assert count.calls == 2


def test_memo_keeps_module_types_and_state_dict_names():
    norm = _norm()
    assert isinstance(norm.linear, nn.Linear) and isinstance(norm.silu, nn.SiLU)
    assert type(norm.linear) is MemoLinear and type(norm.silu) is MemoSiLU
    assert sorted(norm.state_dict()) == sorted(AdaLayerNormZero(8).state_dict())
    assert memoize_modulation(norm) == []  # already memoised: nothing to do twice


def test_a_norm_that_embeds_its_own_timestep_gets_no_memo():
    # AdaLayerNormZero(num_embeddings=...) embeds (timestep, class labels) itself: its silu never sees a tensor twice
    norm = AdaLayerNormZero(8, num_embeddings=10)
    assert memoize_modulation(norm) == []
    assert type(norm.silu) is nn.SiLU and type(norm.linear) is nn.Linear


def _engine_run(preset, *, prefetch=True, memo=True, slots=True):
    """The engine on one rank (the whole model, M = 2 patches, warm-up 1): its latents, the products computed in
    all, those computed inside the passes (not in ``prepare_step``), the number of memoised norms, and the stage."""
    pipe, spec = tiny(preset), model_spec(preset)
    plan = spec.plan(spec.num_blocks(pipe.transformer.config), ParallelConfig(pipefusion_degree=1))
    stage = spec.stage_class()(copy.deepcopy(pipe.transformer), plan, 0)
    linears = [module for module in stage.modules() if isinstance(module, MemoLinear)]
    norms = len(linears)
    if not memo:  # every pass computes its products, as before the memo
        for module in stage.modules():
            if isinstance(module, (MemoLinear, MemoSiLU)):
                module.__class__ = nn.Linear if isinstance(module, MemoLinear) else nn.SiLU
    inputs = prepare_inputs(pipe, height=32, width=32, steps=STEPS, cfg=1.0 if preset.startswith("flux") else 7.0)
    grid = grid_of(spec, pipe, 32, 32, 2, inputs["prompt_embeds"].shape[1])
    with pytest.MonkeyPatch.context() as patch:
        count, prepared = _Count(patch, linears), []
        prepare = type(stage).prepare_step

        def counted_prepare(self, cond):
            before = count.calls
            if prefetch:
                prepare(self, cond)
            prepared.append(count.calls - before)

        patch.setattr(type(stage), "prepare_step", counted_prepare)
        if not slots:
            patch.setattr(StaleKVCache, "joint", lambda self, *args: None)
        latents = engine_latents(stage, plan, inputs, copy.deepcopy(pipe.scheduler), grid, 1)
    return latents, count.calls, count.calls - sum(prepared), norms, stage


@pytest.mark.parametrize("preset", ["flux-tiny", "sd3-tiny"])
def test_every_adaptive_norm_computes_once_per_step_and_the_latents_do_not_change(preset):
    latents, calls, in_passes, norms, _ = _engine_run(preset)
    assert norms > 0
    assert calls == norms * STEPS  # the warm-up step's whole-image pass, then one product per norm and step
    # every pipelined step's products were prepared after the step before: none is left to its first patch
    assert in_passes == norms
    reference, reference_calls, *_ = _engine_run(preset, memo=False, slots=False, prefetch=False)
    assert reference_calls == norms * (1 + 2 * (STEPS - 1))  # per pass: two patches a pipelined step
    torch.testing.assert_close(latents, reference, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["flux-tiny", "sd3-tiny"])
def test_without_the_prefetch_the_passes_compute_the_products(preset):
    latents, calls, in_passes, norms, _ = _engine_run(preset, prefetch=False)
    assert calls == in_passes == norms * STEPS
    torch.testing.assert_close(latents, _engine_run(preset)[0], rtol=0, atol=0)


def test_text_slots_serve_every_patch_pass_of_a_joint_family(monkeypatch):
    served = []
    joint = StaleKVCache.joint

    def counted(self, *args):
        out = joint(self, *args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(StaleKVCache, "joint", counted)
    pipe = tiny("flux-tiny")
    layers = model_spec("flux-tiny").num_blocks(pipe.transformer.config)
    stage = _engine_run("flux-tiny")[-1]
    # every attention layer of every pipelined pass (2 patches, STEPS - 1 steps) attends to its joint buffers, and
    # the warm-up step's whole-image pass joins its text itself
    assert served == [False] * layers + [True] * (layers * 2 * (STEPS - 1))
    # the step's recorded text K/V are the slots themselves: held once, not beside a copy
    joint = stage.joint
    assert len(joint.text) == layers
    for key, value in joint.text.values():
        assert key.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
        assert any(
            key.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() for k in joint.image._joint_k.values()
        )


def test_a_lora_on_a_memoised_linear_adds_its_own_path_every_call(monkeypatch):
    """PEFT wraps the memoised linear as any ``nn.Linear``: the base product is memoised, the adapter's path is
    not, and the result equals the same adapter on an unmemoised norm; set to another scale, the next call shows it."""
    from peft import LoraConfig, inject_adapter_in_model

    plain = AdaLayerNormZero(8)
    torch.manual_seed(0)
    plain.load_state_dict(_norm().state_dict())
    memoised = copy.deepcopy(plain)
    modulations = memoize_modulation(memoised)
    config = LoraConfig(r=2, target_modules=["linear"], init_lora_weights=False)
    for norm in (plain, memoised):
        torch.manual_seed(1)
        inject_adapter_in_model(config, norm)
    base = memoised.linear.base_layer
    assert type(base) is MemoLinear
    count = _Count(monkeypatch, [base])
    emb = torch.randn(1, 8)
    with torch.no_grad():
        prefetch_modulation(modulations, emb)  # the memo module itself, under the PEFT layer that wraps it
        for scale in (1.0, 1.0, 0.5):
            for norm in (plain, memoised):
                norm.linear.scaling["default"] = scale
            torch.testing.assert_close(_modulation(memoised, emb), _modulation(plain, emb), rtol=0, atol=0)
    assert count.calls == 1  # the base product once, prefetched; the adapter's path on every call
