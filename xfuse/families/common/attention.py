"""The two attention processors PipeFusion puts into a diffusers DiT, for every family whose attention module is a
diffusers ``Attention`` with ``AttnProcessor2_0`` (PixArt-Σ) or ``HunyuanAttnProcessor2_0`` (HunyuanDiT).

Both mirror ``diffusers.models.attention_processor.AttnProcessor2_0.__call__`` and
``diffusers.models.attention_processor.HunyuanAttnProcessor2_0.__call__`` (project, split heads, optional per-head q/k
norm, optional RoPE, SDPA, merge heads, output projection); ``check_attention`` asserts the options they leave out are
off.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor2_0, HunyuanAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb

from xfuse.families.common.layers import attend, project_heads
from xfuse.parallel.pass_attention import PassAttention

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

    The cache is keyed on the text tensor object: the engine passes the same tensor for every step and patch of a
    request, and one per batch part of a whole-image step (``ShardedStage.batch_part`` slices it once per request); a
    new tensor gets its own entry, the oldest beyond ``MAX_TEXTS`` is dropped. A text mask (PixArt: a bias of shape (B,
    1, S_text)) is expanded per head as ``diffusers.models.attention_processor.AttnProcessor2_0.__call__`` does.
    """

    MAX_TEXTS = 16  # the whole batch's text and one per batch part (at most one part per rank)
    REQUEST_STATE = ("_kv",)  # the request's text K/V (``xfuse.parallel.request_state``)

    def __init__(self) -> None:
        # id(text) -> (text, its K/V); the text is held so that its id is not reused while the entry lives
        self._kv: OrderedDict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

    def reset(self) -> None:
        self._kv.clear()

    def text_kv(self, attn: Attention, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The text's keys and values, each (B, heads, S_text, head_dim) (diffusers' ``Attention``: per-head norm)."""
        return _heads(attn, text, attn.to_k, attn.norm_k), _heads(attn, text, attn.to_v, None)

    def cached(self, attn: Attention, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``text_kv`` of ``text``, computed at its first pass of the request (see the class docstring)."""
        entry = self._kv.get(id(text))
        if entry is None:
            entry = self._kv[id(text)] = (text, self.text_kv(attn, text))
            if len(self._kv) > self.MAX_TEXTS:
                self._kv.popitem(last=False)
        return entry[1]

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
