"""Joint text-image SDPA, whoever runs it: the text that shares a pass's softmax and how it joins the image tokens.

A leaf of ``xfuse.parallel``: ``PassAttention`` (one rank's attention) and ``SequenceParallel`` (an SP group's) both
use these, and neither imports the other for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # each (B, heads, tokens, head_dim)


@dataclass
class TextAttention:
    """The text that shares the image's softmax in one pass (SD3, FLUX): its queries, keys and values on this rank,
    each (B, heads, tokens, head_dim) — under sequence parallelism this rank's chunk of the text, and zero tokens for
    a patch that reuses the text K/V its step's first patch recorded."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    tokens: int  # the text's tokens (all chunks)
    fresh: bool  # this pass owns the text update: its K/V are recorded (else the recorded ones are reused)
    text_first: bool  # the family's order: FLUX [text, image], SD3 [image, text]
    record: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (k, v, own=True): record or reuse the K/V
    # (B, tokens) bool over the whole text (every chunk), False at a padding token no query may attend to (Qwen-Image:
    # prompts of different lengths in one batch); None: every text token is attended to
    key_mask: torch.Tensor | None = None


def join_text(image: torch.Tensor, text: torch.Tensor, text_first: bool) -> torch.Tensor:
    """(B, heads, tokens, head_dim) image and text tokens in the family's order: FLUX [text, image], SD3 [image,
    text]."""
    return torch.cat((text, image) if text_first else (image, text), dim=2)


def split_text(out: torch.Tensor, text_len: int, text_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The output of ``join_text``'s queries back into (image, text), each (B, heads, tokens, head_dim)."""
    if text_first:
        return out[:, :, text_len:], out[:, :, :text_len]
    return out[:, :, : out.shape[2] - text_len], out[:, :, out.shape[2] - text_len :]


def joint_key_mask(text_mask: torch.Tensor | None, image_keys: int, text_first: bool) -> torch.Tensor | None:
    """SDPA's boolean ``attn_mask`` (B, 1, 1, text + image keys) of a joint pass whose text keys are ``text_mask``
    (B, text keys; False: padding) beside ``image_keys`` image keys, every one attended, in the family's order: what
    ``QwenDoubleStreamAttnProcessor2_0`` builds from ``encoder_hidden_states_mask``. ``None`` without a text mask."""
    if text_mask is None:
        return None
    image = text_mask.new_ones((text_mask.shape[0], image_keys))
    joined = torch.cat((text_mask, image) if text_first else (image, text_mask), dim=1)  # (B, keys)
    return joined[:, None, None, :]  # -> (B, 1, 1, keys): every head and query


def joint_sdpa(query, key, value, text: QKV | None, text_first: bool, key_mask: torch.Tensor | None = None):
    """SDPA of the image queries (and the text's, where ``text`` is given) over the image K/V and the text's, in the
    family's token order; returns (image output, text output or None), each (B, heads, tokens, head_dim).
    ``key_mask``: (B, text tokens) bool, the text keys attended to (``TextAttention.key_mask``)."""
    if text is None:
        return F.scaled_dot_product_attention(query, key, value), None
    text_q, text_k, text_v = text
    mask = joint_key_mask(key_mask, key.shape[2], text_first)
    query, key, value = (join_text(*pair, text_first) for pair in ((query, text_q), (key, text_k), (value, text_v)))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)  # (B, heads, image + text queries, d)
    return split_text(out, text_q.shape[2], text_first)
