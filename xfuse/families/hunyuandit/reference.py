"""HunyuanDiT's references: the inputs of a denoising loop prepared the way ``HunyuanDiTPipeline.__call__`` prepares
them, the serial diffusers loop on them, and ``staged_forward`` (the model's forward rebuilt from stages in one
process). Shared by the engine tests and the benchmarks (every rank rebuilds the same inputs from a seed)."""

from __future__ import annotations

import torch

from xfuse.families.hunyuandit.spec import HUNYUANDIT
from xfuse.families.hunyuandit.stage import HunyuanDiTStage, denoise_request, text_states

SCHEDULERS = ("DDPMScheduler", "DDIMScheduler", "EulerDiscreteScheduler", "DPMSolverMultistepScheduler")


def swap_scheduler(pipe, name: str):
    import diffusers

    if name not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS} (got {name!r})")
    pipe.scheduler = getattr(diffusers, name).from_config(pipe.scheduler.config)
    return pipe


def prepare_inputs(
    pipe,
    *,
    prompt="a red house by a lake",
    negative_prompt=None,
    height=64,
    width=64,
    num_inference_steps=4,
    guidance_scale=5.0,
    seed=0,
    eta=0.0,
    batch=1,
):
    """Everything the denoising loop of ``pipe`` needs, built as the diffusers pipeline builds it.

    Returns a dict with ``latents`` (after ``init_noise_sigma``), ``timesteps``, the text tensors batched
    [uncond, cond], ``image_meta_size``, ``style``, ``guidance_scale``, ``extra_step_kwargs`` and the generator
    (already advanced past the initial noise, like the pipeline's).
    """
    device, dtype = torch.device("cpu"), pipe.transformer.dtype
    do_cfg = guidance_scale > 1
    prompts = [prompt] * batch
    negatives = None if negative_prompt is None else [negative_prompt] * batch
    enc = {}
    for index, (length, suffix) in enumerate(zip(HUNYUANDIT.text_lengths, ("", "_2"), strict=True)):
        emb, neg, mask, neg_mask = pipe.encode_prompt(
            prompt=prompts,
            device=device,
            dtype=dtype,
            num_images_per_prompt=1,
            do_classifier_free_guidance=do_cfg,
            negative_prompt=negatives,
            max_sequence_length=length,
            text_encoder_index=index,
        )
        if do_cfg:
            emb, mask = torch.cat([neg, emb]), torch.cat([neg_mask, mask])
        enc[f"prompt_embeds{suffix}"], enc[f"prompt_attention_mask{suffix}"] = emb, mask
    pipe.scheduler.set_timesteps(num_inference_steps, device=device)
    generator = torch.Generator().manual_seed(seed)
    latents = pipe.prepare_latents(
        batch, pipe.transformer.config.in_channels, height, width, dtype, device, generator, None
    )
    noise = latents / pipe.scheduler.init_noise_sigma  # what a user passes as `latents=` (the pipeline rescales)
    copies = 2 if do_cfg else 1
    meta = torch.tensor([[1024, 1024, height, width, 0, 0]] * copies, dtype=dtype).repeat(batch, 1)
    return dict(
        latents=latents,
        noise=noise,
        timesteps=pipe.scheduler.timesteps,
        **enc,
        image_meta_size=meta,
        style=torch.tensor([0] * copies).repeat(batch),
        guidance_scale=guidance_scale,
        extra_step_kwargs=pipe.prepare_extra_step_kwargs(generator, eta),
        generator=generator,
    )


def serial_latents(pipe, inputs: dict, height: int, width: int) -> torch.Tensor:
    """The diffusers pipeline's own denoising loop on ``inputs``' latents and text: the reference output."""
    n = inputs["latents"].shape[0]
    embeds = {}
    for suffix in ("", "_2"):
        emb, mask = inputs[f"prompt_embeds{suffix}"], inputs[f"prompt_attention_mask{suffix}"]
        if inputs["guidance_scale"] > 1:  # the pipeline takes the halves separately and concatenates them again
            embeds[f"negative_prompt_embeds{suffix}"], embeds[f"prompt_embeds{suffix}"] = emb[:n], emb[n:]
            embeds[f"negative_prompt_attention_mask{suffix}"], embeds[f"prompt_attention_mask{suffix}"] = (
                mask[:n],
                mask[n:],
            )
        else:
            embeds[f"prompt_embeds{suffix}"], embeds[f"prompt_attention_mask{suffix}"] = emb, mask
    generator = inputs["extra_step_kwargs"].get("generator")
    return pipe(
        height=height,
        width=width,
        num_inference_steps=len(inputs["timesteps"]),
        guidance_scale=inputs["guidance_scale"],
        latents=inputs["noise"].clone(),
        generator=generator,
        eta=inputs["extra_step_kwargs"].get("eta", 0.0),
        output_type="latent",
        use_resolution_binning=False,
        **embeds,
    ).images


REQUEST_KEYS = (
    "prompt_embeds",
    "prompt_attention_mask",
    "prompt_embeds_2",
    "prompt_attention_mask_2",
    "image_meta_size",
    "style",
    "guidance_scale",
    "extra_step_kwargs",
    "generator",
)


def request_from_inputs(stage, inputs: dict, scheduler):
    """The engine request for ``stage`` from ``prepare_inputs``' output, with its own ``scheduler`` copy."""
    return denoise_request(
        stage,
        latents=inputs["latents"],
        timesteps=inputs["timesteps"],
        scheduler=scheduler,
        **{k: inputs[k] for k in REQUEST_KEYS},
    )


def staged_forward(
    stages: dict[int, HunyuanDiTStage],
    latents: torch.Tensor,
    timestep: torch.Tensor,
    *,
    encoder_hidden_states,
    text_embedding_mask,
    encoder_hidden_states_t5,
    text_embedding_mask_t5,
    image_meta_size,
    style,
    image_rotary_emb,
    grid=None,
) -> torch.Tensor:
    """Run every rank's stage in one process, in route order: ``HunyuanDiT2DModel.forward`` rebuilt from stages.

    With ``grid`` the image goes through the route patch by patch (patches in order, each through every stage),
    attending to the K/V buffers as they are; without, the whole image goes at once and refills them. The stage-level
    reference of the tests (whole-image and patchwise forwards); the multi-rank engine runs the same stage methods on
    separate ranks.
    """
    plan = next(iter(stages.values())).plan
    any_stage = next(iter(stages.values()))
    text = text_states(
        any_stage.transformer,
        encoder_hidden_states,
        text_embedding_mask,
        encoder_hidden_states_t5,
        text_embedding_mask_t5,
    )
    cond = any_stage.conditioning(timestep, text, encoder_hidden_states_t5, image_meta_size, style, image_rotary_emb)
    token_cols = latents.shape[-1] // any_stage.config.patch_size
    bands = [None] if grid is None else list(grid)
    outputs = []
    for band in bands:
        rows = slice(None) if band is None else band.latent_rows
        hidden = stages[plan.embed_rank].embed(latents[:, :, rows], band)  # (B, C, rows, W) -> (B, tokens, hidden)
        skips: dict[int, torch.Tensor] = {}
        for segment in plan.route:
            hidden = stages[segment.rank].run_segment(hidden, segment, cond, band, skips)
        outputs.append(stages[plan.output_rank].head(hidden, cond, token_cols))
    return torch.cat(outputs, dim=2)  # bands stacked along latent rows: (B, C_out, H, W)
