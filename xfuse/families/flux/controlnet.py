"""``PipeFusionFluxControlNetPipeline``: diffusers' ``FluxControlNetPipeline`` with PipeFusion.

The FLUX recipe is ``PipeFusionFluxPipeline``'s; this file adds the control image (prepared, VAE-encoded with the
user's generator and packed on rank 0 after the prompt, broadcast with the text) and the control model (a
``FluxControlNetModel`` run on each pipeline group's embedding rank by ``xfuse.families.common.control``, its residuals
sent to the ranks whose blocks take them: ``xfuse.parallel.control``).

As in diffusers, the ControlNet runs once per pass on the positive prompt and both halves of true CFG (negative and
positive) add the same residuals.
"""

from __future__ import annotations

import torch
from diffusers.models.controlnets.controlnet_flux import FluxControlNetModel
from diffusers.pipelines.flux import pipeline_flux_controlnet as diffusers_flux_controlnet

from xfuse.families.common.control import ControlCall, PerStep, check_one_controlnet
from xfuse.families.common.controlnet import ShardedControlNetMixin
from xfuse.families.common.packed import grid_to_packed, packed_to_grid
from xfuse.families.flux.pipeline import PipeFusionFluxPipeline


def check_flux_controlnet(controlnet) -> None:
    """Refuse, naming why, the control models this pipeline cannot run."""
    check_one_controlnet(controlnet, FluxControlNetModel)
    if controlnet.input_hint_block is not None:
        raise ValueError(
            "XLabs ControlNets (input_hint_block: a convolution over the control image's pixels) are not supported"
        )
    if controlnet.union:
        raise ValueError("union ControlNets (num_mode: a control-mode token in the text) are not supported")


class FluxControlCall(ControlCall):
    """One call's ControlNet arguments and what they become: the encoded control image (rank 0) and the request's
    residuals (every rank)."""

    def encode(self, pipe, height, width, batch, num_images_per_prompt, generator, token_rows):
        """Rank 0, after the prompt: the control image's packed latents as the engine's grid (B, 4 C, rows, cols).
        Mirrors ``diffusers.FluxControlNetPipeline.__call__`` (step 3): ``prepare_image``, ``retrieve_latents``
        with the user's generator, shift and scale, ``_pack_latents``."""
        diffusers_pipe = pipe.pipeline
        vae = diffusers_pipe.vae
        image = diffusers_pipe.prepare_image(
            image=self.control_image,
            width=width,
            height=height,
            batch_size=batch,
            num_images_per_prompt=num_images_per_prompt,
            device=pipe.context.device,
            dtype=vae.dtype,
        )
        if tuple(image.shape[-2:]) != (height, width):
            raise ValueError(f"control_image is {tuple(image.shape[-2:])} pixels, the call {(height, width)}")
        latents = diffusers_flux_controlnet.retrieve_latents(vae.encode(image), generator=generator)
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        channels, rows, cols = latents.shape[1:]
        packed = diffusers_pipe._pack_latents(latents, batch, channels, rows, cols)  # (B, tokens, 4 C)
        return packed_to_grid(packed, token_rows)

    def residuals(self, pipe, text: dict, image_ids, timesteps, model_batch: int, guidance_scale: float):
        """The request's ControlNet residuals: the block map on every rank; the control model's pass on the
        embedding rank, on the positive prompt (``text``: the broadcast embeddings), each residual repeated over the
        transformer batch's rows."""
        routing, model = self.routing(pipe), pipe.control_model
        if model is None:  # not the embedding rank: it receives its blocks' residuals
            return routing
        config, controlnet, stage = pipe.control_config, model.transformer, model.stage
        control_latents = text["control_latents"]  # (B, 4 C, rows, cols)
        batch = control_latents.shape[0]
        rope = stage.rotary_embedding(text["text_ids"], image_ids)
        control_text = controlnet.context_embedder(text["prompt_embeds"])  # (B, T, joint dim) -> (B, T, hidden)
        pooled = text["pooled_prompt_embeds"]
        guidance = None  # Mirrors ``diffusers.FluxControlNetPipeline.__call__``: the ControlNet's own guidance_embeds
        if config["guidance_embeds"]:
            guidance = torch.full([1], guidance_scale, device=pooled.device, dtype=torch.float32).expand(batch)
        scales = self.scales(len(timesteps))
        # the step's timestep as FluxControlNetPipeline passes it: t.expand(B).to(latents.dtype) / 1000
        conds = PerStep(lambda step: stage.conditioning(timesteps[step].expand(batch).to(control_latents.dtype) / 1000,
                                                        guidance, pooled, control_text, rope))  # fmt: skip

        def compute(step, model_input, band, part, keep_kv):
            rows = control_latents if band is None else control_latents[:, :, band.latent_rows]
            added = controlnet.controlnet_x_embedder(grid_to_packed(rows))  # (B, covering tokens, hidden)
            # Every row of the transformer input is the latents (true CFG doubles them): the ControlNet's are B of them.
            # Mirrors ``diffusers.FluxControlNetModel.forward``: x_embedder, + controlnet_x_embedder(controlnet_cond)
            hidden = stage.embed(model_input[:batch], band) + (added if band is None else band.trim(added))
            samples = model.residuals(hidden, conds(step), band, keep_kv, scales[step])
            repeat = (model_batch if part is None else part.size) // batch  # both halves of true CFG take them
            return [sample.repeat(repeat, 1, 1) if repeat > 1 else sample for sample in samples]

        routing.compute, routing.begin_request = compute, model.begin_request
        return routing


class PipeFusionFluxControlNetPipeline(ShardedControlNetMixin, PipeFusionFluxPipeline):
    r"""
    Text-to-image with FLUX.1 and one ControlNet on ``cfg_degree x pipefusion_degree`` ranks, called with the
    arguments of diffusers' [`~diffusers.FluxControlNetPipeline.__call__`]; global rank 0 returns what diffusers
    returns, the others `None`.

    The control model (the pipeline's `controlnet`, a `FluxControlNetModel`) runs on each pipeline group's
    embedding rank, once per patch and step on the positive prompt, with stale K/V of its own like the
    transformer's; each rank whose blocks take its residuals receives them with the patch. Other ranks drop it after
    reading its config. Refused by name: several ControlNets, union ControlNets (`control_mode`), XLabs ControlNets,
    sequence parallelism and step caching, and what [`~xfuse.PipeFusionFluxPipeline`] refuses.
    """

    diffusers_pipeline = "FluxControlNetPipeline"
    check_controlnet = staticmethod(check_flux_controlnet)

    @staticmethod
    def control_heads(controlnet):
        return [*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks]

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        prompt_2: str | list[str] | None = None,
        negative_prompt: str | list[str] = None,
        negative_prompt_2: str | list[str] | None = None,
        true_cfg_scale: float = 1.0,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 28,
        sigmas: list[float] | None = None,
        guidance_scale: float = 7.0,
        control_guidance_start: float | list[float] = 0.0,
        control_guidance_end: float | list[float] = 1.0,
        control_image=None,
        control_mode: int | list[int] | None = None,
        controlnet_conditioning_scale: float | list[float] = 1.0,
        num_images_per_prompt: int | None = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.FloatTensor | None = None,
        prompt_embeds: torch.FloatTensor | None = None,
        pooled_prompt_embeds: torch.FloatTensor | None = None,
        ip_adapter_image=None,
        ip_adapter_image_embeds: list[torch.Tensor] | None = None,
        negative_ip_adapter_image=None,
        negative_ip_adapter_image_embeds: list[torch.Tensor] | None = None,
        negative_prompt_embeds: torch.FloatTensor | None = None,
        negative_pooled_prompt_embeds: torch.FloatTensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = 512,
    ):
        self._refuse(control_mode=(control_mode, None, "union ControlNets are not supported"))
        control = FluxControlCall(control_image, controlnet_conditioning_scale, control_guidance_start,
                                  control_guidance_end)  # fmt: skip
        return self._flux_call(
            control,
            prompt=prompt,
            prompt_2=prompt_2,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            true_cfg_scale=true_cfg_scale,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            sigmas=sigmas,
            guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt,
            generator=generator,
            latents=latents,
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            ip_adapter_image=ip_adapter_image,
            ip_adapter_image_embeds=ip_adapter_image_embeds,
            negative_ip_adapter_image=negative_ip_adapter_image,
            negative_ip_adapter_image_embeds=negative_ip_adapter_image_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            output_type=output_type,
            return_dict=return_dict,
            joint_attention_kwargs=joint_attention_kwargs,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length,
        )
