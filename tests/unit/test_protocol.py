"""Every rank's program (``xfuse/parallel/protocol.py``) is checked against the others' without any process: matched
pair by pair, within its receive buffers, and deadlock-free under gloo's rendezvous and under NCCL's rules, for every
degree, placement, M, W and batch parts; the order xfuse issued before (receives posted a fixed number of tasks
ahead) is shown to deadlock under NCCL's rules where the one order of messages does not."""

import pytest

from tests.support.schedule_cases import NUM_LAYERS, STEPS, cases
from xfuse.families.registry import HUNYUANDIT
from xfuse.parallel import protocol as protocol_module
from xfuse.parallel.protocol import (
    Action,
    ScheduleDeadlock,
    check_protocol,
    message_order,
    protocol,
    served_step,
    stop_points,
)
from xfuse.parallel.schedule import Message, Task, build_schedule
from xfuse.parallel.stage_plan import stage_plan


def direction(m: Message) -> bool:
    """The communicator of a message under xfuse's direction groups (``xfuse.comm.groups``): "up" or "down"."""
    return m.src < m.dst


@pytest.mark.parametrize("degree,placement,num_patches,warmup,parts", list(cases()))
@pytest.mark.parametrize("max_inflight", [1, 2])
def test_programs_match_and_cannot_deadlock_on_gloo_or_under_nccls_rules(
    degree, placement, num_patches, warmup, parts, max_inflight
):
    plan = stage_plan(NUM_LAYERS, degree, placement, skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    schedule = build_schedule(plan, STEPS, warmup, num_patches, parts)
    check_protocol(schedule, max_inflight)  # asserts pairwise order and the buffers; raises on a deadlock
    check_protocol(schedule, max_inflight, rules="nccl")  # every operation of a device in one issue order
    if degree <= 3:  # and each direction group on its own stream, as xfuse's NCCL worlds run (a relaxation of the
        # one stream: kept for a few degrees, as evidence)
        check_protocol(schedule, max_inflight, rules="nccl", communicator=direction)


@pytest.mark.parametrize("degree,placement", [(2, "linear"), (3, "folded"), (4, "balanced"), (5, "linear")])
@pytest.mark.parametrize("max_inflight", [1, 2])
def test_every_rank_issues_in_the_one_order_of_messages(degree, placement, max_inflight):
    """A rank's sends and posts ascend in the one order (a message's key is the same on both its ends), a task is
    computed after the posts of its receives and before its sends, and each send is waited for after it is issued."""
    plan = stage_plan(NUM_LAYERS, degree, placement, skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    schedule = build_schedule(plan, STEPS, 1, degree + 1, 2)
    order = message_order(schedule, max_inflight)
    for rank in range(degree):
        program = protocol(schedule, rank, max_inflight)
        at = {(action, item): i for i, (action, item) in enumerate(program)}
        keys = [order.keys[item] for action, item in program if action in (Action.SEND, Action.POST)]
        assert keys == sorted(keys)
        for task in schedule.orders[rank]:
            computed = at[(Action.COMPUTE, task)]
            assert all(at[(Action.POST, m)] < computed for m in schedule.recvs(task))
            assert all(computed < at[(Action.SEND, m)] < at[(Action.WAIT_SEND, m)] for m in schedule.sends(task))


def lookahead_program(schedule, rank: int, lookahead: int) -> list:
    """The program xfuse ran before the one order (kept here as the case the NCCL rules must catch): each task's
    receives posted ``lookahead`` tasks ahead, its sends issued right after it, and each task's sends waited for
    once the timeline says their receivers have posted them."""
    posted_at = {}
    for order in schedule.orders.values():
        for i, task in enumerate(order):
            for m in schedule.recvs(task):
                posted_at[m] = 0.0 if i < lookahead else schedule.times[order[i - lookahead]][1]
    order = schedule.orders[rank]
    program = [(Action.POST, task) for task in order[:lookahead]]
    pending: list[Task] = []
    for i, task in enumerate(order):
        now = schedule.times[task][0]
        ready = [t for t in pending if all(posted_at[m] <= now for m in schedule.sends(t))]
        program += [(Action.WAIT_SEND, t) for t in ready]
        pending = [t for t in pending if t not in ready]
        program += [(Action.WAIT_RECV, task), (Action.COMPUTE, task), (Action.SEND, task)]
        if i + lookahead < len(order):
            program.append((Action.POST, order[i + lookahead]))
        if schedule.sends(task):
            pending.append(task)
    return program + [(Action.WAIT_SEND, t) for t in pending]


def direction_batches(ops, communicator):
    """How ``P2PChannels.exchange`` cut a call before the one order: receives first, the "up" group's operations
    before the "down" group's, and within a group batch k held each peer's k-th operation."""
    ordered = [op for op in ops if op[1] == "recv"] + [op for op in ops if op[1] == "send"]
    batches = []
    for up in (True, False):
        group: list[list] = []
        count: dict[int, int] = {}
        for m, side in (op for op in ordered if direction(op[0]) == up):
            peer = m.dst if side == "send" else m.src
            count[peer] = count.get(peer, 0) + 1
            if count[peer] > len(group):
                group.append([])
            group[count[peer] - 1].append((m, side))
        batches += group
    return batches


def test_the_lookahead_order_deadlocks_under_nccls_rules_and_the_one_order_does_not():
    """FLUX.2 [klein] at degree 2 (linear, M = 2, every step whole in two batch parts) stopped at its first exchange
    on one H100: under NCCL's rules with xfuse's two direction groups, its old programs deadlock (a launch waits for
    the peer's matching operation while the peer's own launch waits for this rank's next one). With the launches
    never blocking, the streams alone still deadlock the old order on linear routes of degree >= 3 (a receive posted
    ahead holds the sends behind it on its stream). Gloo's rendezvous runs the old order; the one order passes all."""
    klein = build_schedule(stage_plan(8, 2, "linear"), 8, 8, 2, batch_parts=2)
    deep = build_schedule(stage_plan(NUM_LAYERS, 4, "linear", skips=HUNYUANDIT.skip_pairs(NUM_LAYERS)), STEPS, 1, 4)
    for schedule, launch_blocks in ((klein, True), (deep, False)):
        old = {rank: lookahead_program(schedule, rank, 2) for rank in schedule.orders}
        check_protocol(schedule, 2, programs=old)
        with pytest.raises(ScheduleDeadlock, match="waits for Message"):
            check_protocol(
                schedule,
                2,
                rules="nccl",
                communicator=direction,
                programs=old,
                batches=direction_batches,
                launch_blocks=launch_blocks,
            )
        check_protocol(schedule, 2, rules="nccl", communicator=direction, launch_blocks=launch_blocks)
        check_protocol(schedule, 2, rules="nccl")


def test_a_pair_that_disagrees_is_caught():
    """Rank 1 posting its first two receives swapped: the pair's messages disagree."""
    schedule = build_schedule(stage_plan(8, 2, "linear", skips=HUNYUANDIT.skip_pairs(8)), 2, 0, 2)
    programs = {rank: protocol(schedule, rank, 2) for rank in (0, 1)}
    posts = [i for i, (action, _) in enumerate(programs[1]) if action == Action.POST]
    first, second = posts[0], posts[1]
    programs[1][first], programs[1][second] = programs[1][second], programs[1][first]
    with pytest.raises(AssertionError, match="disagree"):
        check_protocol(schedule, 2, programs=programs)


def test_a_program_that_waits_on_its_own_return_is_caught():
    """Folded, N = 2, M = 1: rank 0 computing its return segment before it sends the outbound hand-off waits for
    rank 1, which waits for that hand-off: reported under both rules."""
    schedule = build_schedule(stage_plan(8, 2, "folded", skips=HUNYUANDIT.skip_pairs(8)), 1, 1, 1)
    outbound, back = schedule.orders[0]
    assert (outbound.hop, back.hop) == (0, 3)
    programs = {rank: protocol(schedule, rank, 2) for rank in (0, 1)}
    hand_off = next(i for i, (action, _) in enumerate(programs[0]) if action == Action.SEND)
    programs[0].insert(hand_off, (Action.WAIT_RECV, back))
    for rules in ("gloo", "nccl"):
        with pytest.raises(ScheduleDeadlock, match="rank 0 at its wait"):
            check_protocol(schedule, 2, rules=rules, programs=programs)  # type: ignore[arg-type]


def test_a_schedule_whose_rank_runs_out_of_its_timeline_is_refused():
    schedule = build_schedule(stage_plan(8, 2, "folded", skips=HUNYUANDIT.skip_pairs(8)), 1, 1, 1)
    broken = type(schedule)(**{**schedule.__dict__, "orders": {**schedule.orders, 0: schedule.orders[0][::-1]}})
    with pytest.raises(ValueError, match="rank 0 runs .* before .*, which starts earlier"):
        check_protocol(broken, 2)


def test_receives_past_the_buffers_are_caught():
    """Posting three tasks ahead takes three buffers of a channel that has two: the checker says which receive."""
    schedule = build_schedule(stage_plan(NUM_LAYERS, 2, "linear"), 4, 0, 4)
    programs = {rank: lookahead_program(schedule, rank, 3) for rank in (0, 1)}
    check_protocol(schedule, 3, programs=programs)
    with pytest.raises(AssertionError, match="posts the receive of .* with 2 of its channel outstanding"):
        check_protocol(schedule, 2, programs=programs)


def stop_cases():
    for degree in (2, 3, 4, 8):
        for placement in ("balanced", "folded", "linear"):
            for m in sorted({degree + 1, 2 * degree}):
                for warmup, parts in ((0, 1), (1, 1), (1, 2), (STEPS, 2)):
                    yield degree, placement, m, warmup, parts


@pytest.mark.parametrize("degree,placement,num_patches,warmup,parts", list(stop_cases()))
@pytest.mark.parametrize("flags", [False, True])
def test_a_request_stopped_before_any_step_keeps_the_protocol(degree, placement, num_patches, warmup, parts, flags):
    """Between-step cancellation: every rank waits at each stop point for rank 0's decision, taken one step ahead,
    and a request stopped before step S runs the tasks of steps < S and the messages they need: deadlock-free and
    matched for every S, and for the request that runs to the end under the same waits, on gloo and under NCCL's
    rules."""
    plan = stage_plan(NUM_LAYERS, degree, placement, skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    schedule = build_schedule(plan, STEPS, warmup, num_patches, parts, step_flags=flags)
    for stop in (None, *range(1, STEPS)):
        check_protocol(schedule, 2, decider=plan.embed_rank, stop_at=stop)
        if degree <= 4:  # (degree 8 under gloo's rules only: the slowest cases)
            check_protocol(schedule, 2, rules="nccl", decider=plan.embed_rank, stop_at=stop)


@pytest.mark.parametrize("degree,placement", [(2, "linear"), (3, "folded"), (4, "balanced")])
def test_stop_points_are_where_a_rank_first_serves_a_step(degree, placement):
    """Every action before a rank's stop point for S serves steps < S only (so a rank that learns of the stop there
    has done nothing a stopped request would not do); the action at it serves S or later; the points ascend."""
    plan = stage_plan(NUM_LAYERS, degree, placement, skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    schedule = build_schedule(plan, STEPS, 1, degree + 1, 2)
    for rank in range(degree):
        program = protocol(schedule, rank, 2)
        points = stop_points(schedule, program)
        assert sorted(points) == list(range(1, STEPS)) and list(points.values()) == sorted(points.values())
        for stop, point in points.items():
            assert all(served_step(item) < stop for _, item in program[:point])
            assert served_step(program[point][1]) >= stop


def test_a_decision_taken_at_the_deciders_own_stop_point_can_deadlock(monkeypatch):
    """The checker is not vacuous about the decision: rank 0 deciding at its stop point for S (instead of S - 1)
    makes rank 0's launch wait for a latent that rank 1 sends only after it learned the decision (NCCL's rules,
    2 ranks, linear, M = 2, no warm-up)."""
    plan = stage_plan(NUM_LAYERS, 2, "linear", skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    schedule = build_schedule(plan, STEPS, 0, 2)
    check_protocol(schedule, 2, rules="nccl", decider=0)
    monkeypatch.setattr(protocol_module, "decision_points", stop_points)
    with pytest.raises(ScheduleDeadlock, match="the decision of rank 0"):
        check_protocol(schedule, 2, rules="nccl", decider=0)
