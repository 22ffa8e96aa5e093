"""What the MMDiT adapters (SD3/SD3.5, FLUX.1) share: a stage whose blocks update a text stream beside the image.

The text stream is one of the plan's *streams* (``"text"``): the engine hands it on with a step's first patch only.
This stage gives the text update to that patch (see ``xfuse.families.common.joint``): at the first segment the text is
the request's ``context_embedder`` output, later segments take the text the previous one handed on; every later
patch runs the same blocks with zero text tokens against the text K/V the first patch recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from xfuse.families.common.guidance import cfg_batch, guidance
from xfuse.families.common.joint import JointKV, check_joint_attention
from xfuse.families.common.sharding import ShardedStage
from xfuse.parallel.patch_grid import PatchBand, PatchGrid
from xfuse.parallel.stage import BatchPart
from xfuse.parallel.stage_plan import Segment, StagePlan

TEXT = "text"  # the plan stream that carries the text hidden states


@dataclass
class JointConditioning:
    """What every block of one denoising step needs besides the hidden states."""

    temb: torch.Tensor  # (B, hidden): the per-sample AdaLN-Zero conditioning
    text: torch.Tensor  # (B, T, hidden): the first block's text input (context_embedder output), constant per request
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # FLUX: (cos, sin), each (T + image tokens, head_dim)
    part: BatchPart | None = None  # the batch rows these tensors are (ShardedStage.batch_part); None: all

    STEP_FIELDS: ClassVar = ("temb",)  # batch-indexed tensors (see batch_part)
    REQUEST_FIELDS: ClassVar = ("text",)
    MODULATION: ClassVar = "temb"  # what every block's adaptive norms take (ShardedStage.prepare_step)


class JointStage(ShardedStage):
    """Base of the MMDiT stages: the text-ownership loop over a segment's blocks. A family implements
    ``block_kwargs`` (per-pass arguments of its blocks) and the ``Stage`` methods ``embed`` and ``head``."""

    processor_class: type  # the PipeFusion processor of the family's joint attention
    mirrored_processor: type  # the diffusers processor that processor_class stands in for

    def __init__(self, transformer: nn.Module, plan: StagePlan, rank: int):
        self.joint = JointKV()
        super().__init__(transformer, plan, rank)
        self.kv_cache, self.attention = self.joint.image, self.joint.attention
        self.kv_cache.text_first = self.processor_class.text_first  # where the buffers' text slots go

    def install_processors(self, block: nn.Module, index: int) -> None:
        for name in ("attn", "attn2"):  # attn2: SD3.5's image-only self-attention in its dual-attention blocks
            attn = getattr(block, name, None)
            if attn is not None:
                check_joint_attention(attn, self.mirrored_processor)
                attn.set_processor(self.processor_class(self.joint, (index, name)))

    def begin_request(self, grid: PatchGrid) -> None:
        """Start a request: forget every image and text K/V of the previous one."""
        super().begin_request(grid)  # the batch parts' slices of the previous request's text
        self.joint.begin_request(self.attention.begin_request(grid))

    def request_state_holders(self) -> tuple[object, ...]:
        return (*super().request_state_holders(), self.joint)

    def text_tokens(self) -> slice:
        """The text tokens this rank holds of the current request's text (all of them, or its SP chunk)."""
        return self.attention.hidden_tokens(slice(0, self.joint.text_total))

    def stream_shape(self, kind: str, shape: tuple) -> tuple:
        """The shape this rank holds of the plan's stream ``kind`` (the text, (B, T, hidden)): under sequence
        parallelism its chunk of the tokens."""
        tokens = self.attention.hidden_tokens(slice(0, shape[1]))
        return (shape[0], tokens.stop - tokens.start, *shape[2:])

    def embed_text(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        """The first block's text input (B', T, joint dim) -> (B', T, hidden), once per request: the transformer's
        ``context_embedder`` (Qwen-Image: ``txt_in(txt_norm(.))``)."""
        return self.transformer.context_embedder(prompt_embeds)

    def block_kwargs(self, cond: JointConditioning, band: PatchBand | None, owner: bool) -> dict[str, Any]:
        """Extra keyword arguments of every block for this pass (FLUX: its RoPE rows)."""
        return {}

    def call_block(
        self, index: int, hidden: torch.Tensor, text: torch.Tensor, cond: JointConditioning, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``index`` on (image, text) -> (text, image), as the diffusers transformer's forward calls its blocks
        (SD3's and FLUX.1's take the step's ``temb``; FLUX.2's the shared modulation: ``Flux2Stage``)."""
        return self.blocks[index](hidden_states=hidden, encoder_hidden_states=text, temb=cond.temb, **kwargs)

    def run_segment(
        self,
        hidden: torch.Tensor,
        segment: Segment,
        cond: JointConditioning,
        band: PatchBand | None,
        skips: dict[int, torch.Tensor],
        keep_kv: bool = True,
        streams: dict[str, torch.Tensor] | None = None,
        *,
        controls: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``segment``'s blocks on (B, tokens, hidden). The first patch of a step (or a whole-image pass) owns
        the text update: it reads the text from ``streams`` (the first segment: from ``cond``) and leaves the
        updated text there; other patches carry zero text tokens and reuse the owner's text K/V. ``controls``:
        ControlNet residuals added to the image output of the blocks they name, as diffusers' transformer forward
        adds ``block_controlnet_hidden_states`` / ``controlnet_block_samples``."""
        owner = band is None or band.index == 0
        self.begin_pass(cond, band, keep_kv)  # self.kv_cache is self.joint.image
        self.joint.reuse_text, self.joint.text_total = not owner, cond.text.shape[1]
        # the K/V buffers keep the text's beside the image's (StaleKVCache.joint); under sequence parallelism the
        # group's attention joins its text chunks itself
        self.kv_cache.text_slots = cond.text.shape[1] if self.attention.sequence is None else 0
        if not owner:
            text = cond.text[:, :0]  # (B, 0, hidden): the block's text path costs nothing
        elif segment.blocks[0] == 0:
            text = cond.text[:, self.text_tokens()]  # the text, or under sequence parallelism this rank's chunk
        elif streams is not None and TEXT in streams:
            text = streams[TEXT]
        else:
            raise RuntimeError(f"segment {segment.blocks}: the first patch arrived without its text stream")
        kwargs = self.block_kwargs(cond, band, owner)
        for index in segment.blocks:
            text, hidden = self.call_block(index, hidden, text, cond, kwargs)
            if controls and index in controls:
                hidden = hidden + controls[index]
        if owner and streams is not None and text is not None:  # SD3's last block returns no text
            streams[TEXT] = text
        return hidden


def joint_request(
    stage: JointStage,
    *,
    latents,
    timesteps,
    scheduler,
    prompt_embeds: torch.Tensor,
    cfg_scale: float,
    conditioning: Callable[[torch.Tensor, torch.Tensor], JointConditioning],
    cfg_half=None,
    generator=None,
    on_step_end=None,
    keep_cond_norm: bool = False,
):
    """The engine's ``DenoiseRequest`` of an MMDiT family: the text batched [uncond, cond] when ``cfg_scale > 1``
    (or this CFG group's half with ``cfg_half``), the first block's text input (``JointStage.embed_text``) computed
    once here, the text stream's shape taken from it. ``conditioning(timestep, text)`` builds a step's conditioning
    from the step's timestep expanded to the transformer batch, as both diffusers pipelines broadcast it.
    ``keep_cond_norm``: the guided prediction is rescaled to the conditional one's norm (``guidance``)."""
    from xfuse.parallel.request import DenoiseRequest

    model_batch, model_input = cfg_batch(latents, cfg_scale, cfg_half)
    text = stage.embed_text(prompt_embeds)  # (B', T, joint dim) -> (B', T, hidden)
    return DenoiseRequest(
        latents=latents,
        timesteps=timesteps,
        scheduler=scheduler,
        conditioning=lambda step, t: conditioning(t.expand(model_batch), text),
        model_input=model_input,
        guide=guidance(cfg_scale, cfg_half, learned_sigma=False, keep_cond_norm=keep_cond_norm),
        model_batch=model_batch,
        generator=generator,
        on_step_end=on_step_end,
        stream_shapes={TEXT: tuple(text.shape)},
    )
