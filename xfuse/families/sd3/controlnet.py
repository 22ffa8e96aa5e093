"""``PipeFusionStableDiffusion3ControlNetPipeline``: diffusers' ``StableDiffusion3ControlNetPipeline`` with PipeFusion.

The SD3 recipe is ``PipeFusionStableDiffusion3Pipeline``'s; this file adds the control image (prepared and VAE-encoded
on rank 0 with the prompt, [uncond, cond] doubled as diffusers encodes it, broadcast with the text) and the control
model (an ``SD3ControlNetModel`` run on each pipeline group's embedding rank by ``xfuse.families.common.control``,
its residuals sent to the ranks whose blocks take them: ``xfuse.parallel.control``).
"""

from __future__ import annotations

import torch
from diffusers.models.controlnets.controlnet_sd3 import SD3ControlNetModel

from xfuse.families.common.control import ControlCall, PerStep, check_one_controlnet
from xfuse.families.common.controlnet import ShardedControlNetMixin
from xfuse.families.common.mmdit import JointConditioning
from xfuse.families.sd3.pipeline import PipeFusionStableDiffusion3Pipeline
from xfuse.parallel.control import ControlResiduals


def check_sd3_controlnet(controlnet) -> None:
    """Refuse, naming why, the control models this pipeline cannot run."""
    check_one_controlnet(controlnet, SD3ControlNetModel)
    config = controlnet.config
    if config.joint_attention_dim is None or controlnet.pos_embed is None:
        raise ValueError(
            "SD3.5's 8b ControlNets (no pos_embed, no context_embedder: they read the transformer's embedded input) "
            "are not supported"
        )
    if config.extra_conditioning_channels:
        raise ValueError("inpainting ControlNets (extra_conditioning_channels) are not supported")


class SD3ControlCall(ControlCall):
    """One call's ControlNet arguments and what they become: the encoded control image (rank 0) and the request's
    residuals (every rank)."""

    def encode(self, pipe, height, width, batch, num_images_per_prompt, do_cfg):
        """Rank 0, after the prompt: the control image's latents (B', C, h, w), [uncond, cond] with CFG. Mirrors
        ``diffusers.StableDiffusion3ControlNetPipeline.__call__`` (step 3): ``prepare_image``, the VAE's
        ``latent_dist.sample()`` (from torch's global generator, as there), shift (none for InstantX's models) and
        scale."""
        diffusers_pipe = pipe.pipeline
        vae = diffusers_pipe.vae
        shift = 0 if pipe.control_config["force_zeros_for_pooled_projection"] else vae.config.shift_factor
        image = diffusers_pipe.prepare_image(
            image=self.control_image,
            width=width,
            height=height,
            batch_size=batch,
            num_images_per_prompt=num_images_per_prompt,
            device=pipe.context.device,
            dtype=pipe.dtype,
            do_classifier_free_guidance=do_cfg,
            guess_mode=False,
        )
        if tuple(image.shape[-2:]) != (height, width):
            raise ValueError(f"control_image is {tuple(image.shape[-2:])} pixels, the call {(height, width)}")
        latents = vae.encode(image).latent_dist.sample()
        return (latents - shift) * vae.config.scaling_factor

    def residuals(self, pipe, text: dict, control_latents, timesteps) -> ControlResiduals:
        """The request's ControlNet residuals: the block map on every rank; the control model's pass on the
        embedding rank (``text``: this CFG group's prompt embeddings; ``control_latents`` its rows)."""
        routing, model = self.routing(pipe), pipe.control_model
        if model is None:  # not the embedding rank: it receives its blocks' residuals
            return routing
        config, controlnet = pipe.control_config, model.transformer
        pooled = text["pooled_prompt_embeds"]
        # Mirrors ``diffusers.StableDiffusion3ControlNetPipeline.__call__``: zero pooled projections for InstantX's.
        pooled = torch.zeros_like(pooled) if config["force_zeros_for_pooled_projection"] else pooled
        control_text = controlnet.context_embedder(text["prompt_embeds"])  # (B', T, joint dim) -> (B', T, hidden)
        model_batch, scales = control_text.shape[0], self.scales(len(timesteps))
        conds = PerStep(
            lambda step: JointConditioning(
                controlnet.time_text_embed(timesteps[step].expand(model_batch), pooled), control_text
            )  # fmt: skip
        )

        def compute(step, model_input, band, part, keep_kv):
            cond, latents = conds(step), control_latents
            if part is not None:
                cond, latents = model.stage.batch_part(cond, part), latents[part.rows]
            rows = latents if band is None else latents[:, :, band.latent_rows]  # (B, C, covering rows, W)
            # Mirrors ``diffusers.SD3ControlNetModel.forward``: pos_embed (with positions), + pos_embed_input(cond)
            added = controlnet.pos_embed_input(rows)  # (B, C, h, W) -> (B, covering tokens, D)
            hidden = model.stage.embed(model_input, band) + (added if band is None else band.trim(added))
            return model.residuals(hidden, cond, band, keep_kv, scales[step])

        routing.compute, routing.begin_request = compute, model.begin_request
        return routing


class PipeFusionStableDiffusion3ControlNetPipeline(ShardedControlNetMixin, PipeFusionStableDiffusion3Pipeline):
    r"""
    Text-to-image with SD3 / SD3.5 and one ControlNet on ``cfg_degree x pipefusion_degree`` ranks, called with the
    arguments of diffusers' [`~diffusers.StableDiffusion3ControlNetPipeline.__call__`]; global rank 0 returns what
    diffusers returns, the others `None`.

    The control model (the pipeline's `controlnet`, an `SD3ControlNetModel`) runs on each pipeline group's
    embedding rank, once per patch and step, with stale K/V of its own like the transformer's; each rank whose blocks
    take its residuals receives them with the patch. Other ranks drop it after reading its config. Refused by name:
    several ControlNets, SD3.5's 8b ControlNets, inpainting ControlNets, `controlnet_pooled_projections`, sequence
    parallelism and step caching, and what [`~xfuse.PipeFusionStableDiffusion3Pipeline`] refuses.
    """

    diffusers_pipeline = "StableDiffusion3ControlNetPipeline"
    check_controlnet = staticmethod(check_sd3_controlnet)

    @staticmethod
    def control_heads(controlnet):
        return controlnet.controlnet_blocks

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        prompt_2: str | list[str] | None = None,
        prompt_3: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 28,
        sigmas: list[float] | None = None,
        guidance_scale: float = 7.0,
        control_guidance_start: float | list[float] = 0.0,
        control_guidance_end: float | list[float] = 1.0,
        control_image=None,
        controlnet_conditioning_scale: float | list[float] = 1.0,
        controlnet_pooled_projections: torch.FloatTensor | None = None,
        negative_prompt: str | list[str] | None = None,
        negative_prompt_2: str | list[str] | None = None,
        negative_prompt_3: str | list[str] | None = None,
        num_images_per_prompt: int | None = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.FloatTensor | None = None,
        prompt_embeds: torch.FloatTensor | None = None,
        negative_prompt_embeds: torch.FloatTensor | None = None,
        pooled_prompt_embeds: torch.FloatTensor | None = None,
        negative_pooled_prompt_embeds: torch.FloatTensor | None = None,
        ip_adapter_image=None,
        ip_adapter_image_embeds: torch.Tensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: dict | None = None,
        clip_skip: int | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = 256,
    ):
        self._refuse(
            controlnet_pooled_projections=(
                controlnet_pooled_projections,
                None,
                "diffusers' pipeline reads it as `controlnet_pooled_projections or pooled_prompt_embeds`, which a "
                "tensor of more than one element cannot be",
            ),
        )
        control = SD3ControlCall(control_image, controlnet_conditioning_scale, control_guidance_start,
                                 control_guidance_end)  # fmt: skip
        return self._sd3_call(
            control,
            prompt=prompt,
            prompt_2=prompt_2,
            prompt_3=prompt_3,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            sigmas=sigmas,
            guidance_scale=guidance_scale,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            negative_prompt_3=negative_prompt_3,
            num_images_per_prompt=num_images_per_prompt,
            generator=generator,
            latents=latents,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            ip_adapter_image=ip_adapter_image,
            ip_adapter_image_embeds=ip_adapter_image_embeds,
            output_type=output_type,
            return_dict=return_dict,
            joint_attention_kwargs=joint_attention_kwargs,
            clip_skip=clip_skip,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length,
        )
