"""The generic family's parts in one process: its plan's checks, the dispatcher left as diffusers' outside a pass,
and the refusals a model it cannot run gets, each naming what is missing."""

import copy
from dataclasses import replace

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from tests.support import REPO
from tests.support.mmdit_fns import grid_of, prepare_inputs, request_of, tiny
from xfuse.config import ParallelConfig
from xfuse.families.common.joint import JointKV
from xfuse.families.flux.spec import FLUX
from xfuse.families.generic.dispatch import AttentionCall, current_call, route_dispatcher
from xfuse.families.generic.forward_plan import ForwardPlan
from xfuse.families.pixart.spec import PIXART_SIGMA
from xfuse.families.registry import FAMILIES, load_pipeline
from xfuse.parallel.engine import PipeFusionEngine

PLAN = dict(blocks=("blocks",), block_returns=("hidden_states",), latent_layout="video")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"latent_layout": "planar"}, "latent_layout must be one of packed, video (got 'planar')"),
        ({"hidden": "x"}, "'x' is not among the block's returns ('hidden_states',)"),
        ({"text_stream": "encoder_hidden_states"}, "'encoder_hidden_states' is not among the block's returns"),
        ({"context": ("encoder_hidden_states",)}, "context entry 'encoder_hidden_states' must be 'module:input'"),
        ({"joined": ("blocks",)}, "joined block lists need the text stream they join (text_stream)"),
        ({"joined": ("singles",), "block_returns": ("encoder_hidden_states", "hidden_states"),
          "text_stream": "encoder_hidden_states"}, "joined block list 'singles' is not among the blocks ('blocks',)"),
    ],
)  # fmt: skip
def test_a_forward_plan_names_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ForwardPlan(**(PLAN | change))


def flux_inputs(batch=1, tokens=48, text=16):
    config = tiny("flux-tiny").transformer.config
    gen = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(batch, tokens, config.in_channels, generator=gen),
        encoder_hidden_states=torch.randn(batch, text, config.joint_attention_dim, generator=gen),
        pooled_projections=torch.randn(batch, config.pooled_projection_dim, generator=gen),
        timestep=torch.full((batch,), 0.5),
        guidance=torch.full((batch,), 3.5),
        txt_ids=torch.zeros(text, 3),
        img_ids=torch.randn(tokens, 3, generator=gen),
        return_dict=False,
    )


def test_outside_a_pass_the_dispatcher_is_diffusers_own():
    """Building a stage routes the model module's dispatcher through xfuse: an untouched transformer of the same
    class, called outside any PipeFusion pass, gives the same bits as before."""
    transformer = tiny("flux-tiny").transformer
    inputs = flux_inputs()
    import diffusers.models.transformers.transformer_flux as flux_module

    with torch.no_grad():
        before = transformer(**inputs)[0]
        plan = FLUX.plan(5, ParallelConfig(pipefusion_degree=1))
        FLUX.forward_stage_class()(copy.deepcopy(transformer), plan, 0)
        assert hasattr(flux_module.dispatch_attention_fn, "__wrapped__")  # the FLUX module's calls are routed now
        after = transformer(**inputs)[0]
    assert torch.equal(before, after)


def test_a_processor_that_does_not_call_the_dispatcher_is_refused():
    with pytest.raises(TypeError, match="AttnProcessor2_0 does not call diffusers' dispatch_attention_fn"):
        route_dispatcher(AttnProcessor2_0())


def test_a_model_without_a_context_parallel_plan_is_refused():
    spec = replace(PIXART_SIGMA, forward=ForwardPlan(**(PLAN | {"blocks": ("transformer_blocks",)})))
    transformer = load_pipeline("pixart-tiny").transformer
    plan = spec.plan(spec.num_blocks(transformer.config), ParallelConfig(pipefusion_degree=1))
    with pytest.raises(ValueError, match="PixArtTransformer2DModel has no context-parallel plan"):
        spec.forward_stage_class()(transformer, plan, 0)


def test_a_family_without_a_forward_plan_has_no_generic_stage():
    with pytest.raises(ValueError, match="the pixart-sigma family has no ForwardPlan"):
        PIXART_SIGMA.forward_stage_class()


def test_a_masked_attention_inside_a_pass_is_refused_by_name():
    import diffusers.models.transformers.transformer_flux as flux_module

    route_dispatcher(flux_module.FluxAttnProcessor())
    q = torch.zeros(1, 4, 2, 8)
    call = AttentionCall((3, "attn"), "self", JointKV())
    with current_call(call), pytest.raises(ValueError, match=r"attention \(3, 'attn'\).* takes no attn_mask, scale"):
        flux_module.dispatch_attention_fn(q, q, q, attn_mask=torch.ones(1, 4, dtype=torch.bool), scale=0.5)


def test_a_split_input_that_is_neither_the_image_nor_named_context_is_refused():
    """FLUX's plan splits its text too: a ForwardPlan that does not name it as context fails at the first patch pass
    with the plan's entry and both lengths, not with a wrong image."""
    spec = replace(FLUX, forward=replace(FLUX.forward, context=(":txt_ids",)))
    pipe = tiny("flux-tiny")
    plan = spec.plan(5, ParallelConfig(pipefusion_degree=1))
    stage = spec.forward_stage_class()(copy.deepcopy(pipe.transformer), plan, 0)
    grid = grid_of(spec, pipe, 128, 96, 2)
    request, _ = request_of(stage, prepare_inputs(pipe, height=128, width=96, steps=2, cfg=1.0),
                              copy.deepcopy(pipe.scheduler), grid)  # fmt: skip
    engine = PipeFusionEngine(stage, plan, None, pipe_rank=0, group_ranks=[0], warmup_steps=1)
    message = r"plan's ':encoder_hidden_states': 16 tokens along dim 1, but the image has 48"
    with pytest.raises(ValueError, match=message):
        engine.denoise(request, grid)


@pytest.mark.parametrize(
    "spec,sections,controlnet,why",
    [
        (PIXART_SIGMA, {}, False, "the pixart-sigma family has no ForwardPlan"),
        (FLUX, {"compile": {"mode": "regional"}}, False, "runs its passes eagerly"),
        (FLUX, {}, True, "adds no ControlNet residuals"),
    ],
)
def test_the_generic_adapter_is_refused_by_name_where_it_cannot_run(spec, sections, controlnet, why):
    from xfuse.config import config_from_dict
    from xfuse.errors import ConfigError

    parallel = {"adapter": "generic", **sections.pop("parallel", {})}
    config = config_from_dict({"model": spec.presets[0], "parallel": parallel, **sections})
    with pytest.raises(ConfigError, match=f"parallel.adapter: must be 'family' here: .*{why}"):
        spec.check_adapter(config, controlnet=controlnet)
    spec.check_adapter(config_from_dict({"model": spec.presets[0]}), controlnet=controlnet)  # the family's own: runs


def test_the_plan_counts_the_non_block_modules_the_generic_adapter_keeps_on_every_rank():
    """``xfuse plan``'s weights per rank come from the adapter's own sharding of a weightless model: with the generic
    adapter every rank keeps the embedding and the output layer, which the family keeps on one rank each."""
    from xfuse.perf.memory import stage_parameter_bytes

    transformer = tiny("flux-tiny").transformer
    config, plan = dict(transformer.config), FLUX.plan(5, ParallelConfig(pipefusion_degree=2))
    family = stage_parameter_bytes(FLUX, config, plan, torch.float32)
    generic = stage_parameter_bytes(FLUX, config, plan, torch.float32, adapter="generic")

    def size(*names):
        return 4 * sum(p.numel() for name in names for p in getattr(transformer, name).parameters())

    assert generic[0] - family[0] == size("norm_out", "proj_out")  # rank 0 embeds; rank 1 has the output layer
    assert generic[1] - family[1] == size(*FLUX.stage_class().embed_modules)


def test_a_family_with_only_the_generic_stage_refuses_compiling_it_by_its_compile_key():
    from xfuse.config import config_from_dict
    from xfuse.errors import ConfigError
    from xfuse.families.ltx.spec import LTX

    assert not LTX.compiles and FLUX.compiles
    config = config_from_dict({"model": "ltx-tiny", "compile": {"mode": "regional"}})  # parallel.adapter: family
    message = "compile.mode: must be 'off' for the ltx family: its only stage is the generic one, whose passes run "
    with pytest.raises(ConfigError, match=message + r"eagerly \(got 'regional'\)"):
        LTX.check_adapter(config)


HAND_WRITTEN = [spec for spec in FAMILIES if spec.stage_name is not None]


@pytest.mark.parametrize("spec", HAND_WRITTEN, ids=lambda spec: spec.name)
def test_each_hand_written_stage_says_why_and_the_reason_holds(spec):
    """Every hand-written family says in one line why the generic family does not run it alone, the line is the one
    ``docs/models.md`` lists, and what it says of diffusers holds for the installed version: a family whose line says
    diffusers declares no ``_cp_plan`` has none (a diffusers that adds one makes this fail: time to try the generic
    family on it), and one whose transformer has a plan does not claim otherwise."""
    import diffusers

    why = spec.hand_written
    assert why and "\n" not in why and len(why) <= 160, why
    assert f"| {spec.name} | {why} |" in (REPO / "docs/models.md").read_text(), why
    has_plan = getattr(getattr(diffusers, spec.diffusers_transformer), "_cp_plan", None) is not None
    assert ("no _cp_plan" in why) == (not has_plan), (spec.diffusers_transformer, has_plan, why)


def test_qwen_images_reason_holds_diffusers_rotary_cannot_take_zero_text_tokens():
    """Qwen-Image's line: a later patch carries no text tokens, and diffusers' rotary embedding of the text cannot
    rotate none (when it can, the generic family may run Qwen-Image: this fails to say so)."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    heads, head_dim = 2, 8
    freqs = torch.polar(torch.ones(0, head_dim // 2), torch.zeros(0, head_dim // 2))  # 0 tokens' rotations
    with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements"):
        apply_rotary_emb_qwen(torch.zeros(1, 0, heads, head_dim), freqs, use_real=False)
    assert "zero text tokens" in next(s for s in FAMILIES if s.name == "qwen-image").hand_written


def test_a_hand_written_stage_without_its_reason_is_refused():
    with pytest.raises(ValueError, match=r"the flux family's hand-written stage needs its reason \(hand_written\)"):
        replace(FLUX, hand_written=None)
    ltx = next(spec for spec in FAMILIES if spec.stage_name is None)
    with pytest.raises(ValueError, match="only a hand-written stage has one"):
        replace(ltx, hand_written="a reason for a stage it does not have")
