"""The arithmetic under sequence parallelism, in one process: token chunks, attention with its log-sum-exp, and the
exact merge of partial attention over key blocks (Ring)."""

import pytest
import torch
import torch.nn.functional as F

from xfuse.parallel.lse_attention import attention_with_lse, merge_partials
from xfuse.parallel.sequence import token_chunks


@pytest.mark.parametrize("start,stop,parts", [(0, 42, 4), (24, 42, 2), (0, 7, 7), (5, 6, 1), (0, 48, 3)])
def test_token_chunks_cover_the_range_like_tensor_split(start, stop, parts):
    chunks = token_chunks(slice(start, stop), parts)
    expected = torch.arange(start, stop).tensor_split(parts)
    assert [list(range(c.start, c.stop)) for c in chunks] == [e.tolist() for e in expected]


def qkv(batch=2, heads=3, queries=10, keys=13, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, n, dim, generator=gen) for n in (queries, keys, keys))


def test_attention_with_lse_is_sdpa_and_its_log_sum_exp():
    query, key, value = qkv()
    out, lse = attention_with_lse(query, key, value)
    assert torch.equal(out, F.scaled_dot_product_attention(query, key, value))
    scores = query @ key.transpose(-1, -2) / 8**0.5  # (B, heads, S_q, S_kv)
    assert torch.allclose(lse, scores.logsumexp(-1), atol=1e-5)
    with pytest.raises(ValueError, match="empty"):  # the CPU kernel would die of a division by zero
        attention_with_lse(query[:, :, :0], key, value)


@pytest.mark.parametrize("cuts", [[13], [6, 7], [1, 5, 7], [4, 4, 4, 1]])
def test_merging_key_blocks_equals_attention_over_all_keys(cuts):
    query, key, value = qkv()
    partials = [attention_with_lse(query, k, v) for k, v in zip(key.split(cuts, 2), value.split(cuts, 2), strict=True)]
    whole = F.scaled_dot_product_attention(query, key, value)
    assert (merge_partials(partials) - whole).abs().max().item() <= 1e-6
    if len(cuts) > 1:  # a lost block is not hidden by the merge
        assert (merge_partials(partials[1:]) - whole).abs().max().item() > 1e-3


def test_merge_in_bfloat16_keeps_float32_weights():
    query, key, value = (x.bfloat16() for x in qkv())
    partials = [attention_with_lse(query, k, v) for k, v in zip(key.split(7, 2), value.split(7, 2), strict=True)]
    merged = merge_partials(partials)
    assert merged.dtype == torch.bfloat16
    whole = F.scaled_dot_product_attention(query.float(), key.float(), value.float())
    assert (merged.float() - whole).abs().max().item() <= 2e-2


def padding_mask(batch: int, keys: int, kept: list[int]) -> torch.Tensor:
    """(batch, keys) bool: row b attends to its first ``kept[b]`` keys (the rest: a shorter prompt's padding)."""
    return torch.arange(keys)[None, :] < torch.tensor(kept)[:, None]


@pytest.mark.parametrize("cuts", [[13], [6, 7], [3, 4, 6], [2, 11]])
def test_masked_key_blocks_merge_to_attention_over_the_kept_keys(cuts):
    """Row 0 keeps 5 of 13 keys, row 1 all: merged blocks equal each row's attention over its kept keys alone (a
    shorter prompt unpadded), with blocks whose keys are all masked for row 0 (lse -inf, weight 0)."""
    query, key, value = qkv()
    mask = padding_mask(2, 13, [5, 13])
    blocks = zip(key.split(cuts, 2), value.split(cuts, 2), mask.split(cuts, 1), strict=True)
    merged = merge_partials([attention_with_lse(query, k, v, m) for k, v, m in blocks])
    for row, kept in enumerate((5, 13)):
        alone = F.scaled_dot_product_attention(query[row:row + 1], key[row:row + 1, :, :kept],
                                               value[row:row + 1, :, :kept])  # fmt: skip
        assert (merged[row : row + 1] - alone).abs().max().item() <= 1e-6, (cuts, row)
    assert torch.isfinite(merged).all()
    unmasked = merge_partials(
        [attention_with_lse(query, k, v) for k, v in zip(key.split(cuts, 2), value.split(cuts, 2), strict=True)]
    )
    assert (unmasked[0] - merged[0]).abs().max().item() > 1e-3  # the padding would have mattered


def test_a_block_with_every_key_masked_weighs_nothing():
    query, key, value = qkv(keys=4)
    out, lse = attention_with_lse(query, key, value, padding_mask(2, 4, [0, 4]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool(torch.isneginf(lse[0]).all())
    assert torch.isfinite(lse[1]).all()
