"""The attention of one pass, where every PipeFusion processor hands its queries, keys and values.

A processor projects its tokens (a patch's or the whole image's, and the text where the text shares the softmax) and
calls ``PassAttention.attend``: the image K/V go through the stage's ``StaleKVCache`` (fresh for the pass's tokens,
stale for the rest), the text K/V join them, and the result comes back split into image and text outputs with heads
merged. Without sequence parallelism this is one SDPA call on this rank; with it (``sequence`` set from outside by
``xfuse.parallel.sequence_stage``) the rank holds only its chunk of the pass's tokens and
``xfuse.parallel.sequence.SequenceParallel`` computes the same attention over its group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from xfuse.parallel.joint_sdpa import QKV, TextAttention, join_text, joint_key_mask, joint_sdpa, split_text
from xfuse.parallel.patch_grid import PatchGrid
from xfuse.parallel.stale_kv import StaleKVCache

if TYPE_CHECKING:
    from xfuse.parallel.sequence import SequenceParallel


def merge_heads(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, heads, S, head_dim) -> (B, S, heads * head_dim), as diffusers' processors merge heads after SDPA."""
    return out.transpose(1, 2).flatten(2).to(dtype)


class PassAttention:
    """The attention every PipeFusion processor of one stage calls (see the module docstring)."""

    def __init__(self, cache: StaleKVCache):
        self.cache = cache
        self.sequence: SequenceParallel | None = None  # set by xfuse.parallel.sequence_stage

    def attend(self, layer, image: QKV, text: TextAttention | None = None):
        """Attention of this pass's image queries (and text queries) over the image K/V of ``layer`` and the text
        K/V; returns (image output (B, S, heads * head_dim), text output or None) with heads merged."""
        query, key, value = image
        if self.sequence is None:
            key, value = self.cache.update(layer, key, value)
            if text is None:
                image_out, text_out = F.scaled_dot_product_attention(query, key, value), None
            else:
                image_out, text_out = self._joint_attention(layer, query, key, value, text)
        else:
            image_out, text_out = self.sequence.attend(self.cache, layer, image, text)
        dtype = query.dtype
        return merge_heads(image_out, dtype), None if text_out is None else merge_heads(text_out, dtype)

    def _joint_attention(self, layer, query, key, value, text: TextAttention):
        """This rank's whole joint attention (no sequence parallelism): over the cache's joint buffers where they
        hold the text K/V beside the image's (a patch pass; ``StaleKVCache.joint``), else over the image K/V and
        the text's joined here."""
        text_kv = text.record(text.key, text.value)
        joint = self.cache.joint(layer, *text_kv, text.fresh)
        if joint is None:
            return joint_sdpa(query, key, value, (text.query, *text_kv), text.text_first, text.key_mask)
        if text.fresh:  # the step's record is the slots themselves: the text K/V are held once
            text.record(*self.cache.text_kv(layer), own=False)
        text_len = text.query.shape[2]  # zero for a patch that reuses its step's text K/V
        joint_query = join_text(query, text.query, text.text_first) if text_len else query
        mask = joint_key_mask(text.key_mask, key.shape[2], text.text_first)
        out = F.scaled_dot_product_attention(joint_query, *joint, attn_mask=mask)  # (B, heads, image + text q, d)
        return split_text(out, text_len, text.text_first)

    # --- where this rank's tokens sit ------------------------------------------------------------------------
    def hidden_tokens(self, tokens: slice) -> slice:
        """Positions (in the image) of the hidden states this rank holds for a pass over ``tokens``."""
        return tokens if self.sequence is None else self.sequence.local(tokens)

    def begin_request(self, grid: PatchGrid) -> int:
        """Start a request on ``grid``; returns the tokens the K/V buffers hold: every token of the image, or under
        Ring this rank's ring chunk of every patch (``SequenceParallel.begin_request``)."""
        return grid.num_tokens if self.sequence is None else self.sequence.begin_request(grid)

    def cache_range(self, tokens: slice) -> slice:
        """The range of the K/V buffers a patch pass over ``tokens`` writes."""
        return tokens if self.sequence is None else self.sequence.cache_range(tokens)
