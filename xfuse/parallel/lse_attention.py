"""Attention over K/V blocks merged exactly by their log-sum-exp (the arithmetic of Ring attention).

``softmax(q kᵀ) v`` over the union of key blocks equals the blocks' partial results weighted by
``exp(lse_block - lse_all)``, where ``lse`` is each query's log-sum-exp of its scaled scores: so K/V may arrive one
block at a time and the result is exact up to rounding. On a CPU
``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` returns the log-sum-exp with the output (diffusers'
native backend cannot, which is why its Ring does not run on a CPU); on CUDA the memory-efficient kernel does;
elsewhere the plain formula.
"""

from __future__ import annotations

import math

import torch


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       key_mask: torch.Tensor | None = None):  # fmt: skip
    """(B, heads, S_q, d) x (B, heads, S_kv, d) -> (output (B, heads, S_q, d) in the query's dtype, lse (B, heads,
    S_q) float32). Neither side may be empty (the CPU kernel divides by the token count). ``key_mask``: (B, S_kv)
    bool, the keys attended to (``None``: all); a batch row with none attended gives output 0 and lse ``-inf``, which
    ``merge_partials`` weighs by 0."""
    if query.shape[2] == 0 or key.shape[2] == 0:
        raise ValueError(f"attention_with_lse: empty queries or keys ({tuple(query.shape)}, {tuple(key.shape)})")
    bias = None
    if key_mask is not None:  # additive: 0 where attended, -inf at a masked key, in the query's dtype
        bias = torch.zeros(key_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~key_mask, -math.inf)
        bias = bias[:, None, None, :]  # (B, S_kv) -> (B, 1, 1, S_kv): every head and query
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False,
                                                                              attn_mask=bias)  # fmt: skip
        lse = lse.float()
    elif query.device.type == "cuda":
        if bias is not None:  # the kernel reads a full (B, heads, S_q, S_kv) bias, its rows 16-element aligned
            padded = -(-key.shape[2] // 16) * 16
            full = bias.new_zeros((*query.shape[:3], padded))
            full[..., : key.shape[2]] = bias
            bias = full[..., : key.shape[2]]
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True)[:2]
        lse = lse[..., : query.shape[2]].float()  # the kernel pads lse's token axis to a multiple of 32
    else:
        scores = (query.float() @ key.float().transpose(-1, -2)) / math.sqrt(query.shape[-1])  # (B, heads, S_q, S_kv)
        if bias is not None:
            scores = scores + bias.float()
        lse = scores.logsumexp(dim=-1)
        out = (torch.softmax(scores, dim=-1) @ value.float()).to(query.dtype)
    if key_mask is not None:
        empty = ~key_mask.any(dim=1)  # (B,): rows whose block holds no attended key (no host sync to ask)
        lse = lse.masked_fill(empty[:, None, None], -math.inf)
        out = out.masked_fill(empty[:, None, None, None], 0.0)
    return out, lse


def merge_partials(partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The attention over every block from each block's ``(output, lse)``, merged in list order (the same order on
    every rank gives the same bits on every rank)."""
    if len(partials) == 1:
        return partials[0][0]
    lse = torch.stack([lse for _, lse in partials]).logsumexp(dim=0)  # (B, heads, S_q)
    merged = torch.zeros_like(partials[0][0], dtype=torch.float32)
    for out, block_lse in partials:
        merged += out.float() * torch.exp(block_lse - lse).unsqueeze(-1)  # (B, heads, S_q, 1) weights
    return merged.to(partials[0][0].dtype)
