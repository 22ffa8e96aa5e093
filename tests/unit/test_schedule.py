"""The schedule is a pure function: checked here for every degree, placement, M and W without any process (its
programs and their proof: ``test_protocol.py``)."""

from itertools import pairwise

import pytest

from tests.support.schedule_cases import NUM_LAYERS, STEPS, cases
from xfuse.families.registry import HUNYUANDIT
from xfuse.parallel.protocol import check_protocol
from xfuse.parallel.schedule import COLLECT, Message, Task, batch_parts, build_schedule
from xfuse.parallel.stage_plan import stage_plan


@pytest.mark.parametrize("degree,placement,num_patches,warmup,parts", list(cases()))
def test_every_task_once_and_segments_see_patches_in_stream_order(degree, placement, num_patches, warmup, parts):
    plan = stage_plan(NUM_LAYERS, degree, placement, skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    schedule = build_schedule(plan, STEPS, warmup, num_patches, parts)
    tasks = [t for order in schedule.orders.values() for t in order if t.hop != COLLECT]
    expected = {
        Task(s, p, h, k)
        for s in range(STEPS)
        for p in schedule.patches_of(s)
        for k in schedule.parts_of(s)
        for h in range(len(plan.route))
    }
    assert len(tasks) == len(expected) and set(tasks) == expected
    assert all((t.part is not None) == (t.step < warmup and parts > 1) for t in tasks)
    for rank, order in schedule.orders.items():
        for hop in {t.hop for t in order if t.hop != COLLECT}:
            seq = [(t.step, -1 if t.patch is None else t.patch, t.part or 0) for t in order if t.hop == hop]
            assert seq == sorted(seq)  # stale K/V: each layer sees (step, patch) in order, a step's parts in order
            assert plan.route[hop].rank == rank


@pytest.mark.parametrize(
    "model_batch,degree,parts",
    [(2, 1, 1), (2, 2, 2), (2, 8, 2), (1, 4, 1), (3, 2, 1), (4, 3, 2), (4, 8, 4), (6, 4, 3), (8, 8, 8)],
)
def test_batch_parts_are_the_most_even_parts_up_to_one_per_rank(model_batch, degree, parts):
    assert batch_parts(model_batch, degree) == parts
    assert batch_parts(model_batch, degree, cached=True) == 1  # step caching decides on the whole batch


def test_batch_parts_overlap_the_warmup_step():
    """Folded, N = 2, 16 blocks: the route is rank 0 (blocks 0-3), rank 1 (4-7, then 8-11), rank 0 (12-15); M = 2,
    costs in blocks on one patch. The whole warm-up image costs M = 2 per block and its four segments of 4 blocks run
    one at a time: 8 each, the step ends at 32. In two parts (1 per block each): rank 0 runs both parts' first
    segment (0-4, 4-8); rank 1 part 0's first segment as it arrives (4-8), then the earliest segment of the route
    first: part 1's (8-12), part 0's second (12-16), part 1's second (16-20); rank 0 the last segment of part 0
    (16-20) and of part 1 (20-24): the step ends at 24."""
    plan = stage_plan(16, 2, "folded", skips=HUNYUANDIT.skip_pairs(16))
    whole = build_schedule(plan, 3, 1, 2)
    split = build_schedule(plan, 3, 1, 2, batch_parts=2)
    assert [whole.times[Task(0, None, hop)] for hop in range(4)] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert [split.times[Task(0, None, hop, k)] for k in (0, 1) for hop in range(4)] == [
        (0.0, 4.0), (4.0, 8.0), (12.0, 16.0), (16.0, 20.0),
        (4.0, 8.0), (8.0, 12.0), (16.0, 20.0), (20.0, 24.0),
    ]  # fmt: skip
    # the first pipelined step waits for the whole warm-up step (guidance needs both parts), then runs the same
    pipelined = [(t, e) for t, e in whole.times.items() if t.step > 0]
    assert all(split.times[t] == (start - 8, end - 8) for t, (start, end) in pipelined)


def test_batch_parts_hand_off_their_rows_and_the_last_part_returns_the_latent():
    plan = stage_plan(16, 2, "linear")  # a chain of blocks (PixArt-like): hand-offs and latents only
    schedule = build_schedule(plan, 3, 2, 2, batch_parts=2)
    assert schedule.sends(Task(0, None, 0, 0)) == [Message("hidden", 0, 1, 0, None, part=0)]
    assert schedule.sends(Task(0, None, 1, 0)) == []  # the output rank waits for part 1 before guidance
    assert schedule.sends(Task(0, None, 1, 1)) == [Message("latent", 1, 0, 0, None)]
    assert schedule.recvs(Task(1, None, 0, 0)) == [Message("latent", 1, 0, 0, None)]
    assert schedule.recvs(Task(1, None, 0, 1)) == []  # part 1 reads the latent part 0 received
    # the first pipelined step's patch 0 receives the whole latent of the last warm-up step, once
    assert schedule.recvs(Task(2, 0, 0)) == [Message("latent", 1, 0, 1, None)]
    with pytest.raises(ValueError, match="batch_parts >= 1"):
        build_schedule(plan, 3, 2, 2, batch_parts=0)


def test_folded_sends_no_skips_and_linear_returns_latents():
    folded = build_schedule(stage_plan(16, 4, "folded", skips=HUNYUANDIT.skip_pairs(16)), STEPS, 1, 4)
    kinds = {m.kind for order in folded.orders.values() for t in order for m in folded.sends(t)}
    assert kinds == {"hidden"}
    linear = build_schedule(stage_plan(16, 4, "linear", skips=HUNYUANDIT.skip_pairs(16)), STEPS, 1, 4)
    latents = [m for t in linear.orders[3] for m in linear.sends(t) if m.kind == "latent"]
    # one whole latent after the warm-up step, then one per patch for every pipelined step (the last: final latents)
    assert [(m.step, m.patch) for m in latents] == [(0, None)] + [(s, p) for s in (1, 2, 3) for p in range(4)]
    assert [t for t in linear.orders[0] if t.hop == COLLECT] == [Task(STEPS, p, COLLECT) for p in range(4)]


@pytest.mark.parametrize("num_blocks", [16, 40])
@pytest.mark.parametrize("placement", ["folded", "linear"])
@pytest.mark.parametrize("degree", range(2, 9))
def test_steady_state_keeps_the_busiest_rank_busy(num_blocks, degree, placement):
    """With M >= N, a pipelined step takes exactly the busiest rank's work (its blocks x M patches): no bubbles."""
    plan = stage_plan(num_blocks, degree, placement, skips=HUNYUANDIT.skip_pairs(num_blocks))
    last = len(plan.route) - 1
    for num_patches in (degree, degree + 1, 2 * degree):
        schedule = build_schedule(plan, 12, 1, num_patches)
        ends = [schedule.times[Task(s, num_patches - 1, last)][1] for s in range(1, 12)]
        busiest = max(len(plan.blocks_of(r)) for r in range(degree)) * num_patches
        steady = ends[3:-3]  # away from the fill and from the drain of the last steps
        assert all(b - a == busiest for a, b in pairwise(steady)), (num_patches, ends)


def balanced_cases():
    for num_blocks in (16, 40):
        for degree in range(2, 9):
            for m in (degree, degree + 1, 2 * degree):
                yield num_blocks, degree, m


@pytest.mark.parametrize("num_blocks,degree,num_patches", list(balanced_cases()))
def test_steady_state_on_balanced_routes(num_blocks, degree, num_patches):
    plan = stage_plan(num_blocks, degree, "balanced", skips=HUNYUANDIT.skip_pairs(num_blocks))
    schedule = build_schedule(plan, 12, 1, num_patches)
    last = len(plan.route) - 1
    ends = [schedule.times[Task(s, num_patches - 1, last)][1] for s in range(1, 12)]
    busiest = max(len(plan.blocks_of(r)) for r in range(degree)) * num_patches
    steady = ends[3:-3]
    assert all(b - a == busiest for a, b in pairwise(steady)), ends


def test_a_skip_into_a_lower_ranks_return_chunk_travels_with_the_return_handoff():
    """Balanced, 40 blocks, N = 8: block 2 (rank 1's outbound chunk) feeds block 37 (rank 0's return chunk). Rank 1
    sends it with its return chunk's hidden state, so rank 1 -> 0 carries one task pair's messages, in order."""
    schedule = build_schedule(stage_plan(40, 8, "balanced", skips=HUNYUANDIT.skip_pairs(40)), 3, 1, 8)
    out_hop, back_hop = 1, 14  # rank 1's two segments
    assert [m.kind for m in schedule.sends(Task(2, 3, out_hop))] == ["hidden"]
    assert [(m.kind, m.block, m.dst) for m in schedule.sends(Task(2, 3, back_hop))] == [
        ("skip", 2, 0),
        ("hidden", -1, 0),
    ]
    assert [(m.kind, m.src) for m in schedule.recvs(Task(2, 3, 15))] == [("skip", 1), ("hidden", 1)]


def uneven_cases():
    for degree in (2, 3, 4):
        for placement in ("balanced", "folded", "linear"):
            for tokens in ((605, 512), (573, 544), (300, 180, 240), (90, 100, 100, 100)):
                yield degree, placement, tokens


@pytest.mark.parametrize("degree,placement,tokens", list(uneven_cases()))
def test_patches_of_unequal_cost_keep_the_protocol_and_the_stream_order(degree, placement, tokens):
    plan = stage_plan(NUM_LAYERS, degree, placement, skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    schedule = build_schedule(plan, STEPS, 1, len(tokens), 2, tokens)
    check_protocol(schedule, 2)
    check_protocol(schedule, 2, rules="nccl")
    for order in schedule.orders.values():
        for hop in {t.hop for t in order if t.hop != COLLECT}:
            seq = [(t.step, -1 if t.patch is None else t.patch, t.part or 0) for t in order if t.hop == hop]
            assert seq == sorted(seq)


@pytest.mark.parametrize("tokens", [(512, 512), (605, 512), (573, 544), (544, 573)])
def test_the_heaviest_patch_paces_two_ranks(tokens):
    """Degree 2, M = 2: in steady state a step takes each rank's blocks on the heaviest patch twice (the other
    patch's stage waits for it), in units of a block on a mean patch."""
    plan = stage_plan(16, 2, "linear")
    schedule = build_schedule(plan, 12, 1, 2, 1, tokens)
    ends = [schedule.times[Task(s, 1, 1)][1] for s in range(1, 12)]
    heaviest = 8 * max(tokens) / (sum(tokens) / 2)
    assert all(b - a == pytest.approx(2 * heaviest) for a, b in pairwise(ends[3:-3])), ends


def test_the_speedup_ceiling_is_the_schedules_own():
    """Equal patches, degree 2, M = 2, warm-up 1 in two batch parts, 20 steps: one rank runs 20 x 16 blocks x 2
    patches = 640 block-patches; two take the warm-up step's parts (24), the fill (8) and 19 steps of 16: 336."""
    from xfuse.parallel.costs import speedup_ceiling

    plan = stage_plan(16, 2, "linear")
    assert speedup_ceiling(plan, (512, 512), num_steps=20, warmup_steps=1, batch_parts=2) == pytest.approx(640 / 336)
    even, by_cost = (605, 512), (573, 544)  # sd3-small at 512 px: 93 text tokens with patch 0, cut by rows or cost
    ceilings = [speedup_ceiling(plan, t, num_steps=20, warmup_steps=1, batch_parts=2) for t in (even, by_cost)]
    assert ceilings[0] < ceilings[1] < 640 / 336
    with pytest.raises(ValueError, match="one positive token count per patch"):
        build_schedule(plan, 20, 1, 2, 2, (512,))


@pytest.mark.parametrize("degree,placement", [(2, "linear"), (3, "folded"), (4, "balanced"), (8, "balanced")])
@pytest.mark.parametrize("warmup", [0, 1, STEPS])
def test_step_flags_ride_with_each_steps_first_task_and_keep_the_protocol(degree, placement, warmup):
    """Step caching's decision travels with every hand-off of a step's first task (patch 0, or the whole image) and
    with no other: one per inter-rank hop and step, matched send to receive, the protocol still deadlock-free."""
    plan = stage_plan(NUM_LAYERS, degree, placement, skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    plain = build_schedule(plan, STEPS, warmup, degree + 1)
    flagged = build_schedule(plan, STEPS, warmup, degree + 1, step_flags=True)
    check_protocol(flagged, 2)
    check_protocol(flagged, 2, rules="nccl")
    hops = sum(1 for a, b in pairwise(plan.route) if a.rank != b.rank)
    for rank, order in flagged.orders.items():
        assert order == plain.orders[rank]  # the same tasks in the same order: only the messages differ
        for task in order:
            flags = [m for m in flagged.sends(task) if m.kind == "cache"]
            assert [m for m in flagged.sends(task) if m.kind != "cache"] == plain.sends(task)
            assert len(flags) == (1 if task.patch in (None, 0) and task.hop != COLLECT and any(
                m.kind == "hidden" for m in plain.sends(task)) else 0)  # fmt: skip
    sent = [m for order in flagged.orders.values() for t in order for m in flagged.sends(t) if m.kind == "cache"]
    assert len(sent) == hops * STEPS and {m.patch for m in sent} <= {None, 0}


@pytest.mark.parametrize("degree,placement", [(2, "linear"), (3, "folded"), (4, "balanced"), (4, "linear")])
@pytest.mark.parametrize("warmup,parts", [(0, 1), (1, 2), (STEPS, 2)])
def test_control_residuals_go_from_hop0_to_each_ranks_first_segment_and_keep_the_protocol(
    degree, placement, warmup, parts
):
    """ControlNet residuals: every hop-0 task sends one ``control`` message to each control rank, received by that
    rank's first segment of the same (step, patch, part); no other message changes and the protocol stays
    deadlock-free for every number of receive buffers."""
    plan = stage_plan(NUM_LAYERS, degree, placement, skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    ranks = tuple(r for r in range(degree) if r != plan.embed_rank)
    plain = build_schedule(plan, STEPS, warmup, degree + 1, parts)
    controlled = build_schedule(plan, STEPS, warmup, degree + 1, parts, control_ranks=ranks)
    for max_inflight in (1, 2, 3):
        for rules in ("gloo", "nccl"):
            check_protocol(controlled, max_inflight, rules=rules)
    units = 0
    for rank, order in controlled.orders.items():
        assert order == plain.orders[rank]
        for task in order:
            sends = [m for m in controlled.sends(task) if m.kind == "control"]
            recvs = [m for m in controlled.recvs(task) if m.kind == "control"]
            assert [m for m in controlled.sends(task) if m.kind != "control"] == plain.sends(task)
            assert [m for m in controlled.recvs(task) if m.kind != "control"] == plain.recvs(task)
            units += task.hop == 0
            assert [m.dst for m in sends] == (list(ranks) if task.hop == 0 else [])
            expected = rank in ranks and task.hop == controlled.first_hop(rank)
            assert [(m.src, m.step, m.patch, m.part) for m in recvs] == (
                [(plan.embed_rank, task.step, task.patch, task.part)] if expected else []
            )
    sent = [
        m for order in controlled.orders.values() for t in order for m in controlled.sends(t) if m.kind == "control"
    ]
    assert len(sent) == units * len(ranks)
    with pytest.raises(ValueError, match="control_ranks"):
        build_schedule(plan, STEPS, warmup, degree + 1, parts, control_ranks=(plan.embed_rank,))
