"""``Cancellation`` on a real c10d store in one process (``torch.distributed.HashStore``): the decider's answers as
every other rank reads them, a call's keys gone in the next call, two pipelines' keys apart, and a reader that
hears nothing within ``comm.timeout_s`` named, not hung. The world-level behaviour (every rank stops before the same
step) is in ``tests/multirank/test_cancellation.py``."""

import time

import pytest
import torch.distributed as dist

from xfuse.comm.errors import CommTimeout
from xfuse.parallel.cancellation import Cancellation


def pair(store, timeout_s=5.0, space="p"):
    """Rank 0's and rank 1's cancellation of one pipeline (in a world, each process's n-th: one namespace)."""
    return (Cancellation(rank=0, world_size=2, store=store, timeout_s=timeout_s, space=space),
            Cancellation(rank=1, world_size=2, store=store, timeout_s=timeout_s, space=space))  # fmt: skip


def test_the_deciders_answers_are_what_every_other_rank_reads_and_a_calls_keys_go_in_the_next():
    store = dist.HashStore()
    decider, reader = pair(store)
    flags = iter([False, False, True])
    decider.condition = lambda: next(flags)
    for c in (decider, reader):
        c.begin_call()
        c.begin_run()
    assert [decider.decide(s) for s in (1, 2, 3)] == [False, False, True]
    assert [reader.read(s) for s in (1, 2, 3)] == [False, False, True]
    first_call = store.num_keys()
    assert first_call == 3
    for c in (decider, reader):  # the next call: its first decision deletes the last call's keys
        c.begin_call()
        c.begin_run()
    decider.condition = None
    assert decider.decide(1) is False and reader.read(1) is False
    assert store.num_keys() == 1


def test_two_pipelines_in_one_world_never_read_each_others_answers():
    store = dist.HashStore()
    first, first_reader = pair(store, space="0")
    second, second_reader = pair(store, space="1")
    for c in (first, first_reader, second, second_reader):
        c.begin_call()
        c.begin_run()
    first.condition, second.condition = (lambda: True), (lambda: False)
    assert first.decide(1) is True and second.decide(1) is False
    assert first_reader.read(1) is True and second_reader.read(1) is False


def test_a_reader_that_hears_nothing_is_named_within_the_timeout():
    _, reader = pair(dist.HashStore(), timeout_s=0.3)
    reader.begin_call()
    reader.begin_run()
    start = time.monotonic()
    with pytest.raises(CommTimeout) as caught:
        reader.read(4)
    assert time.monotonic() - start < 2.0
    message = str(caught.value)
    assert message.startswith("rank 1: no word from rank 0 within 0.3 s (comm.timeout_s) on whether the request stops "
                              "before step 4")  # fmt: skip
    assert caught.value.peer == 0 and caught.value.step == 4


def test_each_request_of_a_stream_has_its_own_condition_and_answers():
    """In a stream each request's condition is asked for that request's steps, and its answers are read apart."""
    store = dist.HashStore()
    decider, reader = pair(store)
    asked = []
    decider.conditions = [lambda: asked.append(0) or False, None, lambda: asked.append(2) or True]
    for c in (decider, reader):
        c.begin_call()
        c.begin_run()
    assert [decider.decide(1, request) for request in (0, 1, 2)] == [False, False, True]
    assert [reader.read(1, request) for request in (2, 1, 0)] == [True, False, False]
    assert asked == [0, 2]  # request 1 has no condition: never stopped, nothing asked


def test_each_cancellation_made_has_its_own_namespace():
    made = [Cancellation(rank=0, world_size=1, store=None, timeout_s=1.0) for _ in range(2)]
    for c in made:
        c.begin_call()
        c.begin_run()
    assert made[0]._key(1, 0) != made[1]._key(1, 0)


def test_a_world_of_ranks_needs_its_store():
    with pytest.raises(ValueError, match="needs the world's store"):
        Cancellation(rank=0, world_size=2, store=None, timeout_s=1.0)
    alone = Cancellation(rank=0, world_size=1, store=None, timeout_s=1.0)
    alone.begin_call()
    alone.begin_run()
    alone.condition = lambda: True
    assert alone.decide(1) is True  # one rank decides for itself, without a store
