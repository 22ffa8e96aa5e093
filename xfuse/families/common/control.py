"""What the MMDiT ControlNets (SD3's ``SD3ControlNetModel``, FLUX's ``FluxControlNetModel``) share under PipeFusion.

A ControlNet of these families is a transformer of the family's own blocks (``JointTransformerBlock``; FLUX's double
and single blocks) that reads the control image beside the latents. xfuse runs it on the embedding rank with the
family's stage class as a one-rank stage of its own (``ControlModel``): its own stale K/V per patch and its own text
owner, so a patch's control pass sees what the transformer's sees (patches before it fresh, after it one step old;
exact in whole-image steps). The residuals travel with the patch to the ranks that hold the blocks taking them
(``xfuse.parallel.control``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from xfuse.families.common.mmdit import JointConditioning, JointStage
from xfuse.parallel.control import ControlResiduals
from xfuse.parallel.patch_grid import PatchBand, PatchGrid
from xfuse.parallel.stage_plan import Segment, stage_plan


class ControlModel:
    """A diffusers ControlNet run by its family's ``stage_class`` on one rank: every block, one pass per hop-0 task,
    and each block's residual (its ``controlnet_blocks`` layer, in ``heads``) scaled."""

    def __init__(self, stage_class: type[JointStage], controlnet: nn.Module, heads: Sequence[nn.Module]):
        spec = stage_class.spec
        num_blocks = spec.num_blocks(controlnet.config)
        if len(heads) != num_blocks:
            raise ValueError(f"the ControlNet has {num_blocks} blocks but {len(heads)} residual layers")
        plan = stage_plan(num_blocks, 1, "linear", streams=spec.streams)
        self.stage = stage_class(controlnet, plan, 0)
        self.heads = tuple(heads)
        self.passes = tuple(Segment(0, 0, (block,)) for block in range(num_blocks))

    @property
    def transformer(self) -> nn.Module:
        return self.stage.transformer

    def begin_request(self, grid: PatchGrid) -> None:
        self.stage.begin_request(grid)

    def residuals(
        self, hidden: torch.Tensor, cond: JointConditioning, band: PatchBand | None, keep_kv: bool, scale: float
    ) -> list[torch.Tensor]:
        """(B, band tokens, hidden) embedded control input -> every residual (B, band tokens, hidden): mirrors the
        block loop and residual layers of ``diffusers.SD3ControlNetModel.forward`` (FLUX: double then single blocks),
        the text stream owned by the step's first patch as in the transformer (``JointStage.run_segment``)."""
        streams: dict[str, torch.Tensor] = {}
        samples = []
        for segment, head in zip(self.passes, self.heads, strict=True):
            hidden = self.stage.run_segment(hidden, segment, cond, band, {}, keep_kv, streams)
            samples.append(head(hidden))
        return [sample * scale for sample in samples]  # as diffusers scales them, after every layer


def check_one_controlnet(controlnet, model_class: type) -> None:
    """A ControlNet pipeline's first refusals: none given, or not one ``model_class`` (several ControlNets)."""
    name = model_class.__name__
    if controlnet is None:
        raise ValueError(f"controlnet is required (a {name})")
    if not isinstance(controlnet, model_class):
        raise ValueError(
            f"controlnet must be one {name} (got {type(controlnet).__name__}; several ControlNets "
            f"({name.replace('ControlNet', 'MultiControlNet')}) are not supported)"
        )


class PerStep:
    """``make(step)`` once per denoising step, the two steps in flight kept (a step's conditioning)."""

    def __init__(self, make: Callable[[int], Any]):
        self.make, self.values = make, {}

    def __call__(self, step: int):
        if step not in self.values:
            self.values.pop(step - 2, None)
            self.values[step] = self.make(step)
        return self.values[step]


@dataclass
class ControlCall:
    """One call's ControlNet arguments (diffusers' names: ``control_image``, ``controlnet_conditioning_scale``,
    ``control_guidance_start`` / ``control_guidance_end``); a family's subclass encodes the image on rank 0 and
    builds the request's residuals."""

    control_image: Any
    conditioning_scale: float | list[float]
    guidance_start: float | list[float]
    guidance_end: float | list[float]

    def __post_init__(self) -> None:
        if self.control_image is None:
            raise ValueError("control_image is required")

    def scales(self, num_steps: int) -> list[float]:
        """Each step's conditioning scale: mirrors the ``controlnet_keep`` and ``cond_scale`` lines of
        ``diffusers.StableDiffusion3ControlNetPipeline.__call__`` (one ControlNet: a list's first scale, start and
        end; 0 outside the steps it acts in)."""
        first = [x[0] if isinstance(x, list) else x for x in (self.conditioning_scale, self.guidance_start,
                                                               self.guidance_end)]  # fmt: skip
        scale, start, end = first
        return [scale * (1.0 - float(i / num_steps < start or (i + 1) / num_steps > end)) for i in range(num_steps)]

    def routing(self, pipe) -> ControlResiduals:
        """Which residual each of the transformer's blocks adds (every rank; ``pipe``: the xfuse ControlNet
        pipeline); the embedding rank then sets ``compute`` and ``begin_request``."""
        config = pipe.control_config
        return ControlResiduals(
            pipe.spec.control_samples(dict(pipe.stage.config), config), pipe.spec.num_blocks(config)
        )
