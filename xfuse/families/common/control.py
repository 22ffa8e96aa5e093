"""What the MMDiT ControlNets (SD3's ``SD3ControlNetModel``, FLUX's ``FluxControlNetModel``) share under PipeFusion.

A ControlNet of these families is a transformer of the family's own blocks (``JointTransformerBlock``; FLUX's double
and single blocks) that reads the control image beside the latents. xfuse runs it on the embedding rank with the
family's stage class as a one-rank stage of its own (``ControlModel``): its own stale K/V per patch and its own text
owner, so a patch's control pass sees what the transformer's sees (patches before it fresh, after it one step old;
exact in whole-image steps). The residuals travel with the patch to the ranks that hold the blocks taking them
(``xfuse.parallel.control``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from xfuse.families.common.mmdit import JointConditioning, JointStage
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


def control_keep(num_steps: int, start: float | list[float], end: float | list[float]) -> list[float]:
    """1.0 for the steps the ControlNet acts in, else 0.0: mirrors the ``controlnet_keep`` lines of
    ``diffusers.StableDiffusion3ControlNetPipeline.__call__`` (one ControlNet: its first start and end)."""
    first_start = start[0] if isinstance(start, list) else start
    first_end = end[0] if isinstance(end, list) else end
    return [1.0 - float(i / num_steps < first_start or (i + 1) / num_steps > first_end) for i in range(num_steps)]


def first_scale(scale: float | list[float]) -> float:
    """The conditioning scale of one ControlNet: a list's first, as diffusers' pipelines read it."""
    return scale[0] if isinstance(scale, list) else scale
