"""Tensor helpers the family adapters share: lines diffusers repeats in every DiT (each helper names where)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from torch import nn

from xfuse.parallel.patch_grid import PatchBand


def project_heads(attn: Attention, x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """``proj(x)`` split into heads, as ``diffusers.models.attention_processor.AttnProcessor2_0.__call__`` does before
    attending."""
    # unflatten, not view(B, S, heads, -1): a later MMDiT patch projects a text stream of zero tokens
    return proj(x).unflatten(-1, (attn.heads, -1)).transpose(1, 2)  # (B, S, D) -> (B, heads, S, head_dim)


def attend(attn: Attention, query, key, value, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA, heads merged, output projection and dropout: the end of
    ``diffusers.models.attention_processor.AttnProcessor2_0.__call__``."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)  # (B, heads, S, head_dim)
    out = out.transpose(1, 2).flatten(2).to(query.dtype)  # -> (B, S, heads * head_dim)
    return attn.to_out[1](attn.to_out[0](out))


def unpatchify(
    out: torch.Tensor, token_cols: int, patch_size: int, channels: int, band: PatchBand | None = None
) -> torch.Tensor:
    """(B, tokens, p*p*C) of ``band`` (``None``: whole token rows) -> (B, C, rows*p, cols*p) of the rows covering it;
    mirrors the unpatchify at the end of ``diffusers.HunyuanDiT2DModel.forward`` and
    ``diffusers.PixArtTransformer2DModel.forward``, for a band as for the image."""
    out = out if band is None else band.pad(out)  # (B, band tokens, p*p*C) -> (B, covering rows' tokens, p*p*C)
    p = patch_size
    batch, tokens = out.shape[:2]
    rows = tokens // token_cols
    out = out.reshape(batch, rows, token_cols, p, p, channels)  # (B, h, w, p, q, C)
    out = torch.einsum("nhwpqc->nchpwq", out)  # (B, C, h, p, w, q)
    return out.reshape(batch, channels, rows * p, token_cols * p)  # (B, C, h*p, w*q)
