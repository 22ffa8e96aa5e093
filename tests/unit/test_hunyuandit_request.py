"""HunyuanDiT's ``denoise_request``: the per-step conditioning gets diffusers' timestep batch, bit for bit, from a table
made once per request (no per-step tensor from host data, copy or cast: each was a host/device synchronisation)."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xfuse.families.hunyuandit.presets import build_tiny_pipeline
from xfuse.families.hunyuandit.reference import prepare_inputs, request_from_inputs, swap_scheduler
from xfuse.families.hunyuandit.stage import HunyuanDiTStage
from xfuse.families.registry import HUNYUANDIT
from xfuse.parallel.stage_plan import stage_plan

STEPS = 20  # gpu.md's loop: 60 synchronisations in 20 steps at the old per-step ``torch.tensor([t] * B)``


class OpLog(TorchDispatchMode):
    """The aten ops run under it, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def tiny_pipeline():
    return build_tiny_pipeline("tiny", seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheduler", ["DDPMScheduler", "EulerDiscreteScheduler"])  # int64 and float32 timesteps
@pytest.mark.parametrize("guidance_scale", [5.0, 1.0])  # model batch 2 ([uncond, cond]) and 1
def test_conditioning_timesteps_are_diffusers_t_expand_with_no_per_step_copy(
    tiny_pipeline, dtype, scheduler, guidance_scale, monkeypatch
):
    pipe = swap_scheduler(copy.deepcopy(tiny_pipeline), scheduler).to(dtype)
    inputs = prepare_inputs(pipe, num_inference_steps=STEPS, guidance_scale=guidance_scale)
    latents, timesteps = inputs["latents"], inputs["timesteps"]
    assert latents.dtype == dtype and len(timesteps) == STEPS
    layers = pipe.transformer.config.num_layers
    plan = stage_plan(layers, 1, "folded", skips=HUNYUANDIT.skip_pairs(layers))
    stage = HunyuanDiTStage(pipe.transformer, plan, 0)

    log, calls = OpLog(), []
    real_conditioning = stage.conditioning

    def spy(timestep, *args):  # the real conditioning, noting its timestep and how many ops the step ran before it
        calls.append((timestep, len(log.ops)))
        return real_conditioning(timestep, *args)

    monkeypatch.setattr(stage, "conditioning", spy)
    request = request_from_inputs(stage, inputs, pipe.scheduler)
    batch = latents.shape[0] * (2 if guidance_scale > 1 else 1)  # diffusers' latent_model_input.shape[0]
    assert request.model_batch == batch
    for step in range(STEPS):
        t = request.timesteps[step]  # as the engine passes it
        log.ops.clear()
        with log:
            cond = request.conditioning(step, t)
        timestep, before = calls[-1]
        # Before the model's embedding, the step only takes a view of the request's table: no copy or cast, and no
        # tensor from host data (``torch.tensor``'s ``lift_fresh``, declared a view of the new host tensor; on a GPU
        # it follows reading t to the host and precedes the host-to-device copy).
        prepare = log.ops[:before]
        assert all(op.is_view and op != torch.ops.aten.lift_fresh.default for op in prepare), list(map(str, prepare))
        # HunyuanDiTPipeline.__call__'s t_expand, verbatim: same dtype, shape and bits.
        expected = torch.tensor([t] * batch, device=latents.device).to(dtype=latents.dtype)
        assert timestep.dtype == expected.dtype == dtype and timestep.shape == expected.shape == (batch,)
        assert torch.equal(timestep, expected)
        temb = stage.transformer.time_extra_emb(
            expected, inputs["prompt_embeds_2"], inputs["image_meta_size"], inputs["style"], hidden_dtype=dtype
        )  # (B, hidden), as HunyuanDiT2DModel.forward builds it from t_expand
        assert torch.equal(cond.temb, temb)
    if dtype == torch.bfloat16 and scheduler == "DDPMScheduler":
        assert calls[0][0][0].item() == 952.0 != timesteps[0].item()  # 951 rounds in bfloat16, as in diffusers
