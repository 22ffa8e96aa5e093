"""Tiny random ControlNets built offline on the tiny presets (saved as diffusers saves them), the control image, and
the calls the ControlNet tests run on xfuse's pipelines and on diffusers' alike."""

import hashlib

import numpy as np
import torch
from PIL import Image

from tests.support.pipeline_fns import as_array

# Two calls: the ControlNet at full scale over every step, then at 0.7 for the first half of the steps only.
CONTROL_CALLS = (
    {},
    {"controlnet_conditioning_scale": 0.7, "control_guidance_start": 0.0, "control_guidance_end": 0.5},
)
GLOBAL_SEED = 5  # torch's global generator: SD3's pipeline draws the control image's VAE sample from it


def save_controlnet(pipe, folder, *, seed: int, num_layers: int, num_single_layers: int = 0) -> str:
    """A ControlNet of ``pipe``'s family (``SD3ControlNetModel``; FLUX's with ``num_single_layers`` too) made from its
    transformer as diffusers' ``from_transformer`` makes one, its zero-initialised input embedding and residual
    layers then drawn at random (as after training: the control acts), saved with ``save_pretrained``; returns
    ``folder``."""
    from diffusers import FluxControlNetModel, SD3ControlNetModel

    transformer = pipe.transformer
    if type(transformer).__name__ == "FluxTransformer2DModel":
        config = transformer.config
        controlnet = FluxControlNetModel.from_transformer(
            transformer, num_layers=num_layers, num_single_layers=num_single_layers,
            attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads,
        )  # fmt: skip
        zeroed = (*controlnet.controlnet_blocks, *controlnet.controlnet_single_blocks, controlnet.controlnet_x_embedder)
    else:
        controlnet = SD3ControlNetModel.from_transformer(transformer, num_layers=num_layers,
                                                         num_extra_conditioning_channels=0)  # fmt: skip
        zeroed = (*controlnet.controlnet_blocks, controlnet.pos_embed_input)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in zeroed:
            for param in module.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    controlnet.save_pretrained(str(folder))
    return str(folder)


def control_image(height: int, width: int) -> Image.Image:
    """A deterministic RGB image with edges and gradients (what a depth or edge map gives a ControlNet)."""
    rows, cols = np.mgrid[0:height, 0:width]
    image = np.stack([(rows * 255 // height), (cols * 255 // width), ((rows // 16 + cols // 16) % 2) * 255], axis=-1)
    return Image.fromarray(image.astype(np.uint8))


def control_steps(pipe, call: dict, image) -> list:
    """``pipe(**call, **extra)`` for each of ``CONTROL_CALLS`` with the same seeds (the user's generator, and torch's
    global one for SD3's VAE sample); the outputs as arrays (``None`` on ranks that return nothing), then a digest of
    the last call's generator state after it."""
    call = dict(call)
    seed = call.pop("seed")
    out = []
    for extra in CONTROL_CALLS:
        torch.manual_seed(GLOBAL_SEED)
        generator = torch.Generator().manual_seed(seed)
        images = pipe(**call, **extra, control_image=image, generator=generator)
        out.append(None if images is None else as_array(images))
    # where the last call left the generator (FLUX draws the control image's VAE sample from it on rank 0 only)
    out.append(hashlib.sha1(generator.get_state().numpy().tobytes()).hexdigest())
    return out


def load_controlnet(family: str, controlnet_folder: str):
    import diffusers

    return getattr(diffusers, CONTROLNETS[family]).from_pretrained(controlnet_folder)


CONTROLNETS = {"sd3": "SD3ControlNetModel", "flux": "FluxControlNetModel"}


def xfuse_pipeline(family: str, folder: str, controlnet_folder: str, **kwargs):
    """The family's xfuse ControlNet pipeline from ``folder`` with the ControlNet of ``controlnet_folder``."""
    from xfuse.families.registry import MODEL_SPECS

    spec = MODEL_SPECS[family]
    cls = spec.pipeline_class_named(f"PipeFusion{spec.controlnet}")
    return cls.from_pretrained(folder, controlnet=load_controlnet(family, controlnet_folder), **kwargs)


def xfuse_control_steps(family, folder, controlnet_folder, parallel, call, height, width, counters=False, lora=None):
    """Rank function: ``control_steps`` on the family's xfuse ControlNet pipeline loaded from ``folder`` with the
    ControlNet of ``controlnet_folder`` (and the LoRA file ``lora`` loaded as adapter ``a``); with ``counters`` also
    this rank's bytes sent by kind in the last call, and what the rank is."""
    pipe = xfuse_pipeline(family, folder, controlnet_folder, parallel=parallel, comm={"timeout_s": 60})
    if lora is not None:
        pipe.load_lora_weights(lora, adapter_name="a")
    pipe.set_progress_bar_config(disable=True)
    steps = control_steps(pipe, call, control_image(height, width))
    if not counters:
        return steps
    context = pipe.context
    sent = context.channels.counters.as_dict()["sent_bytes"] if context.channels is not None else {}
    return dict(steps=steps, sent=sent, pipe_rank=context.pipe_rank, cfg_rank=context.cfg_rank,
                holds_controlnet=pipe.control_model is not None,
                blocks=[len(pipe.plan.blocks_of(r)) for r in range(pipe.plan.degree)])  # fmt: skip


def refused_controlnet_layout(family, folder, controlnet_folder, parallel, cache=None, torch_dtype=None):
    """Rank function: build the ControlNet pipeline with ``parallel`` / ``cache`` (the transformer in ``torch_dtype``,
    the ControlNet as saved); its refusal (type, message)."""
    try:
        xfuse_pipeline(family, folder, controlnet_folder, parallel=parallel, cache=cache, comm={"timeout_s": 60},
                       torch_dtype=torch_dtype)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the test compares every rank's refusal
        return type(err).__name__, str(err)
    return "built", ""
