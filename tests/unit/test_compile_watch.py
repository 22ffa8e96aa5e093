"""``CompileWatch`` (what a rank compiles, for how long, and the bound) against dynamo's real compiles of a small
function (backend ``eager``: dynamo's capture, no code generation), a compile slowed by a start callback as the
``slow_compile`` fault slows one; and the activity a rank publishes for the others (``RankState``)."""

import time

import pytest
import torch
from torch._dynamo.callback import callback_handler

from xfuse.comm.stats import WaitState
from xfuse.errors import CompileTimeout
from xfuse.runtime.compile_watch import CompileWatch
from xfuse.runtime.monitor import RankState


@pytest.fixture
def slowed():
    """Every dynamo compile of the test 0.3 s slower (as the ``slow_compile`` fault's callback makes it)."""
    torch._dynamo.reset()

    def slow(args):
        time.sleep(0.3)

    callback_handler.register_start_callback(slow)
    yield
    torch._dynamo.reset()  # drops the callbacks and the compiled frames


def _compile_one():
    @torch.compile(backend="eager")
    def double(x):
        return x * 2

    return double(torch.ones(3))


def test_a_compiling_request_counts_the_compile_and_says_what_it_compiles(slowed):
    errors = []
    watch = CompileWatch(rank=2, timeout_s=30.0, on_timeout=errors.append)
    assert watch.activity() is None
    with watch.request("shape 3 of 4 (1024x768)"):
        assert watch.activity() == "compiling shape 3 of 4 (1024x768) for 0.0 s"
        _compile_one()
        spent = watch.compiling_s()
        assert 0.3 <= spent < 5.0
        time.sleep(0.2)  # running, not compiling: the clock stands
        assert watch.compiling_s() == spent
        assert watch.activity() == f"compiling shape 3 of 4 (1024x768) for {spent:.1f} s"
    assert watch.activity() is None and errors == []


def test_past_the_bound_the_watch_names_the_rank_the_shape_and_the_bound(slowed):
    errors = []
    watch = CompileWatch(rank=1, timeout_s=0.1, on_timeout=errors.append, poll_s=0.02)
    with watch.request("shape 1 of 2 (64x64)"):
        _compile_one()  # 0.3 s inside the compiler: the thread sees the bound pass while it runs
    assert len(errors) == 1 and isinstance(errors[0], CompileTimeout)
    message = str(errors[0])
    assert message.startswith("rank 1: compiling shape 1 of 2 (64x64) took more than compile.timeout_s = 0.1 s (")
    assert message.endswith("the world stops. Restart with a longer compile.timeout_s, a warm compile.cache_dir, or "
                            "compile.mode: off")  # fmt: skip


@pytest.mark.parametrize(
    "state,sentence",
    [
        (RankState((), 3.0, "compiling shape 1 of 2 (64x64) for 41.0 s"), "compiling shape 1 of 2 (64x64) for 41.0 s"),
        (RankState((), 3.0), "not communicating for 3.0 s (computing, or stalled)"),
        (
            RankState((WaitState("recv", "hidden", 1, 0, None, None, 2.5),), 0.0, "compiling x for 1.0 s"),
            "waiting 2.5 s: recv of hidden from rank 1 at step 0, whole image",  # its wait says more: where it is
        ),
    ],
)
def test_a_published_state_carries_the_activity(state, sentence):
    back = RankState.from_json(state.to_json())
    assert back == state and back.sentence() == sentence


@pytest.mark.parametrize(
    "spec,parsed",
    [
        ("slow_compile:1:8", ("slow_compile", 1, 8)),
        ("kill:0:decode", ("kill", 0, "decode")),
        ("stall:2:3", ("stall", 2, 3)),
        ("slow_compile:1:decode", None),  # its third field is seconds
        ("nap:0:1", None),
    ],
)
def test_the_slow_compile_fault_takes_seconds(spec, parsed):
    from xfuse.runtime.faults import parse

    if parsed is not None:
        assert parse(spec) == parsed
        return
    with pytest.raises(ValueError, match=r"or slow_compile:RANK:SECONDS \(got"):
        parse(spec)
