"""The two attention processors PipeFusion puts into a diffusers DiT, for every family whose attention module is a
diffusers ``Attention`` with ``AttnProcessor2_0`` (PixArt-Σ) or ``HunyuanAttnProcessor2_0`` (HunyuanDiT).

Both mirror ``diffusers.models.attention_processor.AttnProcessor2_0.__call__`` and
``diffusers.models.attention_processor.HunyuanAttnProcessor2_0.__call__`` (project, split heads, optional per-head q/k
norm, optional RoPE, SDPA, merge heads, output projection); ``check_attention`` asserts the options they leave out are
off.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor2_0, HunyuanAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb

from xfuse.families.common.layers import attend, project_heads
from xfuse.parallel.pass_attention import PassAttention
from xfuse.parallel.stale_kv import StaleKVCache, static_slot

MIRRORED_PROCESSORS = (AttnProcessor2_0, HunyuanAttnProcessor2_0)


def check_attention(attn: Attention, cross: bool) -> None:
    """The assumptions the processors below make about ``attn`` (diffusers 0.42)."""
    if type(attn.processor) not in MIRRORED_PROCESSORS:
        raise TypeError(f"expected one of {[p.__name__ for p in MIRRORED_PROCESSORS]}, found {type(attn.processor)}")
    if attn.spatial_norm is not None or attn.group_norm is not None or attn.norm_cross or attn.residual_connection:
        raise ValueError("attention with spatial/group/cross norm or a residual connection is not supported")
    if attn.rescale_output_factor != 1.0:
        raise ValueError(f"attention with rescale_output_factor {attn.rescale_output_factor} is not supported")
    if attn.is_cross_attention != cross:
        raise ValueError(f"expected {'cross' if cross else 'self'}-attention")


def _heads(attn: Attention, x: torch.Tensor, proj, norm) -> torch.Tensor:
    out = project_heads(attn, x, proj)  # (B, heads, S, head_dim)
    return out if norm is None else norm(out)


class StaleKVSelfAttnProcessor:
    """Self-attention whose K/V go through the stage's ``PassAttention`` (PipeFusion's stale K/V, and sequence
    parallelism where the stage has it).

    ``image_rotary_emb`` (HunyuanDiT) holds the RoPE rows of exactly the tokens being computed, so K is rotated with
    its global positions before it is stored.
    """

    def __init__(self, attention: PassAttention, layer: int):
        self.attention, self.layer = attention, layer

    def __call__(
        self,
        attn: Attention,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        image_rotary_emb=None,
    ):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("StaleKVSelfAttnProcessor is for unmasked self-attention only")
        query = _heads(attn, hidden_states, attn.to_q, attn.norm_q)
        key = _heads(attn, hidden_states, attn.to_k, attn.norm_k)
        value = _heads(attn, hidden_states, attn.to_v, None)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb)
            key = apply_rotary_emb(key, image_rotary_emb)
        out, _ = self.attend((query, key, value))  # (B, S, heads * head_dim)
        return attn.to_out[1](attn.to_out[0](out))

    def attend(self, qkv):
        """This pass's attention through the stage's K/V (``PassAttention.attend``): the eager region of a compiled
        block (``xfuse.parallel.regional_compile``: the bookkeeping keyed by the block stays out of the graph)."""
        return self.attention.attend(self.layer, qkv)


class CachedCrossAttnProcessor:
    """Cross-attention to the text with its K/V computed once per request (RoPE, if any, on the image queries).

    The text K/V live in one slot per batch part (the whole batch, or part ``i`` of a whole-image step, as the
    stage's K/V cache says: ``StaleKVCache.part``): the engine passes the same text for every step and patch of a
    request part, so the slot is written at the part's first pass of the request and read by every later one. A slot
    is a buffer written in place (allocated once per text shape, kept between requests): a pass that reads it is the
    same code on the same tensors in every step and request, so a compiled or captured stage pass
    (``xfuse.parallel.pass_graphs``) reads the request's text through it and is never made again for a new text.
    A text mask (PixArt: a bias of shape (B, 1, S_text)) is expanded per head as
    ``diffusers.models.attention_processor.AttnProcessor2_0.__call__`` does.
    """

    REQUEST_STATE = ("_slots", "_written")  # the request's text K/V (``xfuse.parallel.request_state``)

    def __init__(self, kv_cache: StaleKVCache) -> None:
        self.kv_cache = kv_cache  # whose ``part`` says which batch part a pass computes
        # batch part (None: the whole batch) -> its text K/V buffers, each (B, heads, S_text, head_dim)
        self._slots: dict[int | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self._written: set[int | None] = set()  # the slots holding this request's text K/V

    def reset(self) -> None:
        self._written.clear()

    def text_kv(self, attn: Attention, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The text's keys and values, each (B, heads, S_text, head_dim) (diffusers' ``Attention``: per-head norm)."""
        return _heads(attn, text, attn.to_k, attn.norm_k), _heads(attn, text, attn.to_v, None)

    def cached(self, attn: Attention, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``text_kv`` of ``text``, computed at its batch part's first pass of the request (the class docstring)."""
        part = self.kv_cache.part
        key = None if part is None else part.index
        if key in self._written:
            return self._slots[key]
        key_states, value_states = self.text_kv(attn, text)
        slot = self._slots.get(key)
        if slot is None or slot[0].shape != key_states.shape or slot[0].dtype != key_states.dtype:
            slot = self._slots[key] = (torch.empty_like(key_states), torch.empty_like(value_states))
            static_slot(*slot)
        slot[0].copy_(key_states)
        slot[1].copy_(value_states)
        self._written.add(key)
        return slot

    def queries(self, attn: Attention, hidden_states: torch.Tensor) -> torch.Tensor:
        """The image tokens' queries, (B, heads, S, head_dim)."""
        return _heads(attn, hidden_states, attn.to_q, attn.norm_q)

    def __call__(
        self,
        attn: Attention,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        image_rotary_emb=None,
    ):
        text_kv = self.cached(attn, encoder_hidden_states)
        query = self.queries(attn, hidden_states)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb)
        mask = None
        if attention_mask is not None:
            batch, text_len = hidden_states.shape[0], text_kv[0].shape[2]
            mask = attn.prepare_attention_mask(attention_mask, text_len, batch)  # (B * heads, 1, S_text)
            mask = mask.view(batch, attn.heads, -1, mask.shape[-1])  # -> (B, heads, 1, S_text)
        return attend(attn, query, *text_kv, mask)
