"""Joint text–image attention under PipeFusion (the MMDiT families: SD3/SD3.5 and FLUX.1).

In an MMDiT block the text tokens sit in the same softmax as the image tokens, so a block's text update depends on
the whole image. xfuse gives that update to one owner per step, the step's first patch (patch 0; a whole-image pass
owns it too):

* patch 0 runs every block on (its image rows, the text): its text queries see patch 0 fresh and the other
  patches' K/V of the previous step, its text output goes on to the next block and, with patch 0's hand-off, to
  the next rank; each attention module records the text K/V it computed;
* every later patch runs the same untouched diffusers block with a text stream of **zero tokens**: the block's text
  path (norm, projections, feed-forward) costs nothing, and the processor attends the patch's image queries to the
  image buffer plus the text K/V patch 0 recorded. Those K/V are exactly what recomputing the block on patch 0's
  text input would give (xDiT's SD3 scheme), without the recomputation: no text crosses ranks after patch 0.

Warm-up (whole-image) steps are exact. Image K/V go through the stage's ``StaleKVCache`` (post q/k-norm; FLUX:
post-RoPE, so stale rows keep their own positions); text K/V never go stale within a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttention

from xfuse.families.common.layers import project_heads
from xfuse.parallel.joint_sdpa import TextAttention
from xfuse.parallel.pass_attention import PassAttention
from xfuse.parallel.stale_kv import StaleKVCache


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself where it is all of its storage, else a copy: a recorded text K/V that is a view of a fused
    projection's output (FLUX.2's single blocks: q, k, v and the MLP input of every token in one tensor) would keep
    that whole output alive until the record is replaced — for every block of the rank through a whole-image step,
    and between requests. Inside a compiled region (``xfuse.parallel.regional_compile``) always a copy: its storage
    is not the program's to inspect, and asking would split the region."""
    compiling = torch.compiler.is_compiling()
    if not compiling and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


@dataclass
class JointKV:
    """The K/V state every joint-attention processor of one stage shares.

    ``image`` holds the whole-image buffers (stale between patches); ``text`` the text K/V per attention module,
    recorded by the owner of the text update. ``reuse_text``: the current pass is a later patch (its text stream
    has zero tokens; attend to the recorded text K/V). ``text_tokens``: text tokens at the front of the sequence
    a FLUX single-stream block's attention sees (its processor cannot tell text from image by itself).
    ``text_total``: the whole text's tokens (a rank under sequence parallelism holds a chunk of them).
    """

    REQUEST_STATE: ClassVar[tuple[str, ...]] = ("text", "reuse_text", "text_tokens", "text_total")  # beside image's

    image: StaleKVCache = field(default_factory=StaleKVCache)
    text: dict = field(default_factory=dict)
    reuse_text: bool = False
    text_tokens: int = 0
    text_total: int = 0  # the text stream's tokens over every rank (under sequence parallelism a rank holds a chunk)
    attention: PassAttention = field(init=False)  # the image buffers' attention (module xfuse.parallel.pass_attention)

    def __post_init__(self) -> None:
        self.attention = PassAttention(self.image)

    def text_kv(self, key, text_k: torch.Tensor, text_v: torch.Tensor, own: bool = True):
        """(B, heads, T, head_dim) text K/V of this pass: recorded by the owner, replaced by the owner's for a
        later patch (whose own text has zero tokens). ``own``: record a copy where they are a view of a larger
        tensor (``_own``); ``False``: they are the stale K/V buffers' text slots, held there anyway."""
        if not self.reuse_text:
            self.text[key] = (_own(text_k), _own(text_v)) if own else (text_k, text_v)
            return text_k, text_v
        if text_k.shape[2] != 0:
            raise RuntimeError(f"joint attention {key}: a later patch must carry no text tokens")
        if key not in self.text:
            raise RuntimeError(f"joint attention {key}: no text K/V recorded by this step's first patch")
        return self.text[key]

    def begin_request(self, num_tokens: int) -> None:
        self.image.reset(num_tokens)
        self.text.clear()
        self.reuse_text, self.text_tokens, self.text_total = False, 0, 0

    def text_attention(self, key, query, text_k, text_v, text_first: bool, key_mask=None) -> TextAttention:
        """The text part of attention module ``key``'s pass: this rank's text queries, keys and values
        (B, heads, T, head_dim), recorded as the owner's or replaced by them (``text_kv``). ``key_mask``: (B, the
        whole text's tokens) bool, False at padding no query attends to (``TextAttention.key_mask``)."""
        return TextAttention(query, text_k, text_v, self.text_total, not self.reuse_text, text_first,
                             partial(self.text_kv, key), key_mask)  # fmt: skip


def _norm(norm, x):
    return x if norm is None else norm(x)


class JointAttention:
    """What every joint-attention processor shares: ``state`` (the stage's ``JointKV``), ``key`` (its attention
    module's) and ``attend``, the eager region of a compiled block."""

    text_first: bool  # the processor's sequence order: [text, image] (FLUX, Qwen-Image) or [image, text]

    def __init__(self, state: JointKV, key):
        self.state, self.key = state, key

    def attend(self, image: tuple, text: tuple | None, key_mask=None):
        """This pass's joint attention: the text's q/k/v (B, heads, T, d) recorded or reused (``JointKV.
        text_attention``; ``None``: image-only), the image's through the K/V buffers (``PassAttention.attend``).
        Compiled (``xfuse.parallel.regional_compile``), this stays eager: the bookkeeping keyed by the block would
        make a graph per block."""
        attention = None if text is None else self.state.text_attention(self.key, *text, self.text_first, key_mask)
        return self.state.attention.attend(self.key, image, attention)


class StaleJointAttnProcessor(JointAttention):
    """Mirrors ``diffusers.models.attention_processor.JointAttnProcessor2_0.__call__`` (SD3/SD3.5: [image, text] order,
    optional per-head RMSNorm, ``context_pre_only`` last block, and SD3.5's image-only ``attn2``) with PipeFusion's
    K/V."""

    text_first = False  # the joint sequence is [image, text]

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if attention_mask is not None or kwargs:
            raise ValueError(f"StaleJointAttnProcessor: no attention mask or extra arguments (got {sorted(kwargs)})")
        query = _norm(attn.norm_q, project_heads(attn, hidden_states, attn.to_q))  # (B, heads, S, d)
        key = _norm(attn.norm_k, project_heads(attn, hidden_states, attn.to_k))
        value = project_heads(attn, hidden_states, attn.to_v)
        text = None
        if encoder_hidden_states is not None:
            text_q = _norm(attn.norm_added_q, project_heads(attn, encoder_hidden_states, attn.add_q_proj))
            text_k = _norm(attn.norm_added_k, project_heads(attn, encoder_hidden_states, attn.add_k_proj))
            text_v = project_heads(attn, encoder_hidden_states, attn.add_v_proj)
            text = (text_q, text_k, text_v)
        # the band's K/V fresh, the rest stale; [image, text] order; (B, S, D) each
        image, text_out = self.attend((query, key, value), text)
        image = attn.to_out[1](attn.to_out[0](image))
        if text_out is None:
            return image
        return image, (text_out if attn.context_pre_only else attn.to_add_out(text_out))


class StaleFluxAttnProcessor(JointAttention):
    """Mirrors ``diffusers.models.transformers.transformer_flux.FluxAttnProcessor.__call__`` (FLUX: [text, image] order,
    per-head RMSNorm, RoPE on every token) with PipeFusion's K/V. In a single-stream block the sequence is [text, image]
    already concatenated; the stage says how many text tokens lead it (``JointKV.text_tokens``)."""

    text_first = True  # the joint sequence is [text, image]

    def __call__(
        self, attn: FluxAttention, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
    ):
        if attention_mask is not None:
            raise ValueError("StaleFluxAttnProcessor: no attention mask")

        def heads(x, proj, norm):  # (B, S, heads * d) -> (B, S, heads, d), normed per head
            out = proj(x).unflatten(-1, (-1, attn.head_dim))
            return out if norm is None else norm(out)

        query = heads(hidden_states, attn.to_q, attn.norm_q)
        key = heads(hidden_states, attn.to_k, attn.norm_k)
        value = heads(hidden_states, attn.to_v, None)
        if encoder_hidden_states is not None:  # double-stream block: the text comes separately
            text_len = encoder_hidden_states.shape[1]
            text_q = heads(encoder_hidden_states, attn.add_q_proj, attn.norm_added_q)
            text_k = heads(encoder_hidden_states, attn.add_k_proj, attn.norm_added_k)
            text_v = heads(encoder_hidden_states, attn.add_v_proj, None)
        else:  # single-stream block: the block put its text in front
            text_len = self.state.text_tokens
            (text_q, query), (text_k, key), (text_v, value) = split_text((query, key, value), text_len)
        image, text_out = attend_text_first(self, (query, key, value), (text_q, text_k, text_v), image_rotary_emb)
        if encoder_hidden_states is None:
            return torch.cat((text_out, image), dim=1)  # (B, text_len + band, D): the block's MLP branch follows
        return attn.to_out[1](attn.to_out[0](image)), attn.to_add_out(text_out)


def split_text(qkv: tuple[torch.Tensor, ...], text_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(B, S, heads, d) q/k/v of a [text, image] sequence -> (text, image) pairs, the first ``text_len`` tokens text."""
    return [x.split((text_len, x.shape[1] - text_len), dim=1) for x in qkv]


def attend_text_first(processor: JointAttention, image: tuple, text: tuple, image_rotary_emb) -> tuple:
    """The FLUX families' joint attention of one pass: RoPE on the image and text q/k (``image_rotary_emb``: the rows
    [text, image] of this pass's sequence; FLUX's real form), then the text's attention recorded or reused and the
    image's over its buffers. ``image``, ``text``: (B, S, heads, d) q/k/v (a later patch's text: zero tokens);
    returns the (image, text) outputs, (B, S, heads * d) each."""
    (query, key_, value), (text_q, text_k, text_v) = image, text
    text_len = text_q.shape[1]
    if image_rotary_emb is not None:
        text_rope, image_rope = zip(*(x.split((text_len, x.shape[0] - text_len)) for x in image_rotary_emb),
                                    strict=True)  # fmt: skip
        query, key_ = (apply_rotary_emb(x, image_rope, sequence_dim=1) for x in (query, key_))
        if text_len:  # a later patch has none (diffusers' rotation cannot reshape zero tokens)
            text_q, text_k = (apply_rotary_emb(x, text_rope, sequence_dim=1) for x in (text_q, text_k))
    # (B, S, heads, d) -> (B, heads, S, d)
    query, key_, value, text_q, text_k, text_v = (x.transpose(1, 2) for x in (query, key_, value, text_q, text_k,
                                                                              text_v))  # fmt: skip
    return processor.attend((query, key_, value), (text_q, text_k, text_v))


def check_joint_attention(attn, expected: type) -> None:
    """The processor diffusers installed is the one the processors above mirror, with nothing they leave out."""
    if type(attn.processor) is not expected:
        raise TypeError(f"expected {expected.__name__}, found {type(attn.processor).__name__}")
    if getattr(attn, "fused_projections", False):
        raise ValueError("fused QKV projections are not supported (call unfuse_qkv_projections() first)")
