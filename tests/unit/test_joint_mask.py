"""A padded text in a joint softmax (Qwen-Image: prompts of different lengths in one batch): the key mask makes every
way xfuse attends, whole-image and through the stale K/V buffers' joint slots, equal attention over each row's own
unpadded text."""

import pytest
import torch
import torch.nn.functional as F

from xfuse.parallel.joint_sdpa import TextAttention, join_text, joint_sdpa, split_text
from xfuse.parallel.pass_attention import PassAttention
from xfuse.parallel.patch_grid import patch_grid
from xfuse.parallel.stale_kv import StaleKVCache

HEADS, DIM, TEXT, IMAGE = 2, 8, 6, 12
KEPT = [4, 6]  # row 0's prompt has 4 tokens, padded to row 1's 6


def tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def draw(tokens):
        return tuple(torch.randn(2, HEADS, tokens, DIM, generator=gen) for _ in range(3))

    return draw(IMAGE), draw(TEXT)


def mask() -> torch.Tensor:
    return torch.arange(TEXT)[None, :] < torch.tensor(KEPT)[:, None]  # (B, T)


def unpadded(row, image_q, image_kv, text, text_first):
    """Row ``row`` alone with its own text (no padding): (image output, text output of its kept tokens)."""
    kept = KEPT[row]
    (tq, tk, tv), (k, v) = (x[row : row + 1, :, :kept] for x in text), (x[row : row + 1] for x in image_kv)
    query = join_text(image_q[row : row + 1], tq, text_first)
    out = F.scaled_dot_product_attention(query, join_text(k, tk, text_first), join_text(v, tv, text_first))
    return split_text(out, kept, text_first)


@pytest.mark.parametrize("text_first", [True, False], ids=["text_first", "text_last"])
def test_joint_sdpa_with_a_padded_text_equals_each_prompt_alone(text_first):
    (q, k, v), text = tensors()
    image_out, text_out = joint_sdpa(q, k, v, text, text_first, mask())
    for row, kept in enumerate(KEPT):
        image_ref, text_ref = unpadded(row, q, (k, v), text, text_first)
        assert (image_out[row : row + 1] - image_ref).abs().max() <= 1e-6
        assert (text_out[row : row + 1, :, :kept] - text_ref).abs().max() <= 1e-6
    unmasked, _ = joint_sdpa(q, k, v, text, text_first)
    assert (unmasked[0] - image_out[0]).abs().max() > 1e-3  # the padding would have mattered


@pytest.mark.parametrize("text_first", [True, False], ids=["text_first", "text_last"])
def test_a_patch_pass_over_the_joint_buffers_masks_the_padding(text_first):
    """Two patches of 6 tokens after a whole-image pass: the first owns the text (written into the buffers' text
    slots), the second reuses it; both equal each row's attention over the whole image's K/V and its own text."""
    (q, k, v), (tq, tk, tv) = tensors()
    cache = StaleKVCache()
    cache.text_first, cache.text_slots = text_first, TEXT
    attention = PassAttention(cache)
    cache.reset(attention.begin_request(patch_grid(3, 4, 2, 1)))
    recorded = {}

    def record(fresh):
        def keep(key, value, own=True):  # as JointKV.text_kv (own: copy a view; the test keeps them as given)
            if fresh:
                recorded["kv"] = (key, value)
            return recorded["kv"]

        return keep

    whole = TextAttention(tq, tk, tv, TEXT, True, text_first, record(True), mask())
    attention.attend(0, (q, k, v), whole)  # the whole-image pass stores every image token's K/V
    for patch, tokens in enumerate((slice(0, 6), slice(6, 12))):
        cache.tokens = tokens
        fresh = patch == 0
        text = TextAttention(tq if fresh else tq[:, :, :0], tk, tv, TEXT, fresh, text_first, record(fresh), mask())
        image_out, text_out = attention.attend(0, (q[:, :, tokens], k[:, :, tokens], v[:, :, tokens]), text)
        image_out = image_out.unflatten(-1, (HEADS, DIM)).transpose(1, 2)  # (B, S, heads * d) -> (B, heads, S, d)
        for row, kept in enumerate(KEPT):
            image_ref, text_ref = unpadded(row, q, (k, v), (tq, tk, tv), text_first)
            assert (image_out[row : row + 1] - image_ref[:, :, tokens]).abs().max() <= 1e-6, (patch, row)
            if fresh:
                text_row = text_out[row : row + 1, :kept].unflatten(-1, (HEADS, DIM)).transpose(1, 2)
                assert (text_row - text_ref).abs().max() <= 1e-6
    # the patches attended over the buffers' joint slots (the first wrote its text K/V there), not a fallback join
    assert torch.equal(cache.text_kv(0)[0], tk) and torch.equal(cache.text_kv(0)[1], tv)
