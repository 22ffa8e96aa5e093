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


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """(B, heads, S_q, d) x (B, heads, S_kv, d) -> (output (B, heads, S_q, d) in the query's dtype, lse (B, heads,
    S_q) float32). Neither side may be empty (the CPU kernel divides by the token count)."""
    if query.shape[2] == 0 or key.shape[2] == 0:
        raise ValueError(f"attention_with_lse: empty queries or keys ({tuple(query.shape)}, {tuple(key.shape)})")
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False)
        return out, lse.float()
    if query.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, True)[:2]
        return out, lse[..., : query.shape[2]].float()  # the kernel pads lse's token axis to a multiple of 32
    scores = (query.float() @ key.float().transpose(-1, -2)) / math.sqrt(query.shape[-1])  # (B, heads, S_q, S_kv)
    lse = scores.logsumexp(dim=-1)
    return (torch.softmax(scores, dim=-1) @ value.float()).to(query.dtype), lse


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
