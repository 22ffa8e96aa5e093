"""Every stage of a plan in one process, behind ``HunyuanDiT2DModel``'s forward signature.

This is the serial reference of a stage plan (what ``xfuse generate`` runs at world size 1): a diffusers
``HunyuanDiTPipeline`` can use it as its transformer, and its output equals the unsharded model's.
"""

from __future__ import annotations

import copy

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn

from xfuse.models.hunyuandit import HunyuanDiTStage, staged_forward
from xfuse.parallel.stage_plan import StagePlan


class LocalStagedTransformer(nn.Module):
    """The stages of ``plan`` built from ``transformer`` (copied per rank), run whole-image in route order."""

    def __init__(self, transformer, plan: StagePlan):
        super().__init__()
        self.config, self.plan = transformer.config, plan
        self.inner_dim, self.num_heads = transformer.inner_dim, transformer.num_heads  # read by the pipeline
        self.stages = nn.ModuleList(HunyuanDiTStage(copy.deepcopy(transformer), plan, r) for r in range(plan.degree))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, hidden_states, timestep, encoder_hidden_states=None, text_embedding_mask=None,
                encoder_hidden_states_t5=None, text_embedding_mask_t5=None, image_meta_size=None, style=None,
                image_rotary_emb=None, controlnet_block_samples=None, return_dict=True):
        if controlnet_block_samples is not None:
            raise ValueError("controlnet_block_samples: ControlNet residuals are not supported by xfuse stages")
        num_tokens = (hidden_states.shape[-2] // self.config.patch_size) * (hidden_states.shape[-1] // self.config.patch_size)
        for stage in self.stages:
            stage.begin_request(num_tokens)  # whole-image passes only: nothing stale is ever read
        out = staged_forward(
            dict(enumerate(self.stages)), hidden_states, timestep, encoder_hidden_states=encoder_hidden_states,
            text_embedding_mask=text_embedding_mask, encoder_hidden_states_t5=encoder_hidden_states_t5,
            text_embedding_mask_t5=text_embedding_mask_t5, image_meta_size=image_meta_size, style=style,
            image_rotary_emb=image_rotary_emb,
        )
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)
