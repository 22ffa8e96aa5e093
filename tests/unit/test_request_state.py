"""Each request's stage state in its own slot (``xfuse/parallel/request_state.py``): a new slot starts with empty
containers and its own buffers, switching puts a slot's values back (nothing copied), slot 0 is the stage's own;
and on a real stage (the tiny HunyuanDiT's, every family's through the multirank stream tests) the holders cover the
stale K/V, the text K/V and the modulation memos."""

import torch

from xfuse.families.hunyuandit.presets import build_tiny_transformer
from xfuse.families.hunyuandit.stage import HunyuanDiTStage
from xfuse.families.registry import HUNYUANDIT
from xfuse.parallel.patch_grid import patch_grid
from xfuse.parallel.request_state import RequestStates
from xfuse.parallel.stage_plan import stage_plan
from xfuse.parallel.stale_kv import StaleKVCache


class Holder:
    REQUEST_STATE = ("buffers", "count", "tokens")

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}
        self.count = 0
        self.tokens: slice | None = None
        self.config = "shared"  # not per request: never switched


def test_a_new_slot_starts_empty_and_switching_puts_each_requests_values_back():
    holder = Holder()
    states = RequestStates([holder])
    holder.buffers[0], holder.count, holder.tokens = torch.zeros(2), 3, slice(0, 4)  # request 0's
    first = holder.buffers
    states.use(1)
    assert holder.buffers == {} and holder.buffers is not first  # its own container: request 0's is kept apart
    assert holder.count == 3  # a scalar is the request's to set (begin_request) before it is read
    holder.buffers[0], holder.count, holder.tokens = torch.ones(5), 7, None
    states.use(0)
    assert holder.buffers is first and holder.count == 3 and holder.tokens == slice(0, 4)
    states.use(1)
    assert holder.buffers[0].shape == (5,) and holder.count == 7 and holder.tokens is None
    assert states.slots == 2 and holder.config == "shared"
    states.use(1)  # the active slot: nothing changes
    assert states.active == 1 and states.slots == 2


def test_two_requests_on_one_stale_kv_cache_keep_their_own_buffers():
    """The K/V cache's declared attributes are all it keeps per request: two requests interleaved on one cache
    read back exactly what each wrote."""
    cache = StaleKVCache()
    states = RequestStates([cache])
    keys = {0: torch.randn(1, 2, 6, 4), 1: torch.randn(1, 2, 6, 4)}
    for request in (0, 1):
        states.use(request)
        cache.reset(6)
        cache.tokens = None
        cache.update(3, keys[request], keys[request] * 2)  # a whole-image pass stores its K/V
    for request in (1, 0):
        states.use(request)
        cache.tokens = slice(0, 2)  # a patch pass: attends to the stored K/V with its own first rows
        key = keys[request]
        k, v = cache.update(3, key[:, :, :2] + 1, key[:, :, :2])
        assert torch.equal(k[:, :, 2:], key[:, :, 2:]) and torch.equal(v[:, :, 2:], 2 * key[:, :, 2:])
        assert torch.equal(k[:, :, :2], key[:, :, :2] + 1)  # its own patch's rows, written now


def test_a_stage_lists_its_kv_cache_its_cross_attention_and_its_modulation_memos():
    model = build_tiny_transformer()
    num_blocks = HUNYUANDIT.num_blocks(model.config)
    stage = HunyuanDiTStage(model, stage_plan(num_blocks, 1, "linear", skips=HUNYUANDIT.skip_pairs(num_blocks)), 0)
    holders = stage.request_state_holders()
    assert holders[0] is stage and holders[1] is stage.kv_cache
    assert set(map(id, stage._cross)) <= set(map(id, holders))
    memos = [m for mod in stage.modulation for m in (mod.silu, mod.linear) if m is not None]
    assert memos and set(map(id, memos)) <= set(map(id, holders))
    for holder in holders:
        for name in type(holder).REQUEST_STATE:
            getattr(holder, name)  # every declared attribute exists
    states = RequestStates(holders)
    stage.begin_request(patch_grid(8, 8, 2, stage.patch_size))
    states.use(1)
    stage.begin_request(patch_grid(16, 8, 2, stage.patch_size))
    assert stage.num_tokens == 32
    states.use(0)
    assert stage.num_tokens == 16 and stage.kv_cache.num_tokens == 16
