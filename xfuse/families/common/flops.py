"""Floating-point operations of one transformer block on a pass of tokens, from the shapes alone.

The performance model (``xfuse.perf``) costs a task by the FLOPs of its blocks; each family's spec says how its
block spends them (``ModelSpec.block_flops``) with these terms. Counted as torch's ``FlopCounterMode`` counts
(tested against it on every family's tiny preset): matrix products only, two operations per multiply-add; norms,
activations and RoPE are left out (a few per cent of a block at the released widths).
"""

from __future__ import annotations


def linear_flops(tokens: int, fan_in: int, fan_out: int) -> float:
    """A ``nn.Linear(fan_in, fan_out)`` applied to ``tokens`` rows."""
    return 2.0 * tokens * fan_in * fan_out


def attention_flops(queries: int, keys: int, width: int) -> float:
    """Scaled dot-product attention of ``queries`` over ``keys`` across all heads (``width`` = heads x head dim):
    the scores (Q K^T) and their product with V."""
    return 4.0 * queries * keys * width


def mmdit_joint_flops(
    width: int, queries: int, keys: int, text: int, text_queries: bool, *, context_out: bool, modulations: int
) -> float:
    """One MMDiT double-stream block (SD3's ``JointTransformerBlock``, FLUX's ``FluxTransformerBlock``): image and
    text streams with their own q/k/v, output projection and 4x MLP, one softmax over [image, text] keys.

    ``text_queries``: the text stream is computed in this pass (the step's first patch; later patches reuse its
    K/V). ``context_out``: the text stream has an output projection and MLP (SD3's last block has neither).
    ``modulations``: the image stream's AdaLayerNorm chunks (6; SD3.5's dual-attention blocks 9)."""
    d, tq = width, text if text_queries else 0
    image = linear_flops(queries, d, 3 * d) + linear_flops(queries, d, d) + 2 * linear_flops(queries, d, 4 * d)
    context = linear_flops(tq, d, 3 * d)
    if context_out:
        context += linear_flops(tq, d, d) + 2 * linear_flops(tq, d, 4 * d)
    # AdaLayerNorm modulation, once per sample: the image stream's, and the text stream's when it is computed
    # (SD3's last block: AdaLayerNormContinuous, 2 chunks).
    modulation = linear_flops(1, d, modulations * d) + (linear_flops(1, d, (6 if context_out else 2) * d) if tq else 0)
    return image + context + modulation + attention_flops(queries + tq, keys + text, d)


def cross_attention_block_flops(width: int, queries: int, keys: int, text: int, *, text_width: int, ffn: int) -> float:
    """One block of self-attention, cross-attention to a static text and an MLP (PixArt-Σ's ``BasicTransformerBlock``,
    Wan's and LTX-Video's blocks): self q/k/v and output, cross q and output on the image tokens, cross k/v on the
    ``text`` tokens (``text_width`` wide), an MLP of ``ffn`` hidden units; the modulation is a table, no linear."""
    d = width
    flops = linear_flops(queries, d, 4 * d) + attention_flops(queries, keys, d)  # self: q, k, v, out
    flops += linear_flops(queries, d, 2 * d) + linear_flops(text, text_width, 2 * d) + attention_flops(queries, text, d)
    return flops + linear_flops(queries, d, ffn) + linear_flops(queries, ffn, d)
