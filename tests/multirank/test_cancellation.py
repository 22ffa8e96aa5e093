"""Between-step cancellation (``xfuse/parallel/cancellation.py``, ``XfusePipeline.cancel_if``) on real gloo ranks:
rank 0's condition turns true during a call; every rank raises ``RequestCancelled`` naming the same step, computed
no task of that step or a later one (its trace), and the world's next call is bitwise the call it would have been
had nothing been cancelled (run before the cancelled one, in the same processes). Layouts: linear, folded and
balanced pipelines with M > N and a warm-up step, CFG parallel, Ulysses, step caching, and the exact mode."""

import numpy as np
import pytest

from tests.support.pipeline_fns import run_with_a_cancel
from tests.support.world import World
from xfuse.families.hunyuandit.presets import save_tiny_pipeline

STEPS = 6
CALL = dict(prompt="a red house by a lake", height=128, width=96, num_inference_steps=STEPS, output_type="np",
            use_resolution_binning=False, seed=3)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "HunyuanDiT-tiny")


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


def check(results, stop_before):
    """Every rank stopped before ``stop_before`` and computed exactly the steps before it; the next call is the
    call as it was before the cancel."""
    for r in results:
        assert r["cancelled"] is not None, f"rank {r['rank']} finished the cancelled call"
        assert r["cancelled"]["stopped_at"] == stop_before, r
        assert r["computed_steps"] == list(range(stop_before)), (r["rank"], r["computed_steps"])
    message = results[0]["cancelled"]["message"]
    assert f"cancelled before step {stop_before} of {STEPS}" in message and "rank 0's cancel_if" in message
    assert results[0]["asks"] == stop_before  # asked once per step, up to the one that stops it
    assert all(r["asks"] == 0 for r in results[1:])  # only rank 0 decides
    assert np.array_equal(results[0]["again"], results[0]["whole"])
    assert all(r["whole"] is None and r["again"] is None for r in results[1:])


@pytest.mark.parametrize(
    "parallel,stop_before",
    [
        ({"pipefusion_degree": 4, "placement": "linear", "num_patches": 5, "warmup_steps": 1}, 3),
        ({"pipefusion_degree": 4, "placement": "folded", "num_patches": 5, "warmup_steps": 1}, 1),
        ({"pipefusion_degree": 4, "placement": "balanced", "num_patches": 4, "warmup_steps": 2}, STEPS - 1),
        ({"pipefusion_degree": 4, "placement": "linear", "warmup_steps": 100}, 2),  # exact: whole-image steps
        ({"pipefusion_degree": 2, "cfg_degree": 2, "num_patches": 3, "warmup_steps": 1}, 4),
        ({"pipefusion_degree": 2, "ulysses_degree": 2, "num_patches": 2, "warmup_steps": 1}, 2),
    ],
)
def test_every_rank_stops_before_the_same_step_and_the_next_call_is_unchanged(world4, folder, parallel, stop_before):
    results = world4.run_ok(run_with_a_cancel, folder, parallel, CALL, stop_before, timeout=300)
    check(results, stop_before)


def test_a_cancel_under_step_caching(world4, folder):
    """First-block caching: skipped steps are steps too (the decision rides with each step's first task)."""
    parallel = {"pipefusion_degree": 4, "placement": "linear", "num_patches": 4, "warmup_steps": 1}
    cache = {"method": "first_block", "threshold": 0.2}
    results = world4.run_ok(run_with_a_cancel, folder, parallel, CALL, 4, cache=cache, timeout=300)
    check(results, 4)


def test_a_condition_that_never_holds_changes_nothing(world4, folder):
    """Asked at every step after the first and never true: the call runs whole, its images those of a call
    without ``cancel_if``."""
    parallel = {"pipefusion_degree": 4, "placement": "folded", "num_patches": 5, "warmup_steps": 1}
    results = world4.run_ok(run_with_a_cancel, folder, parallel, CALL, STEPS + 5, timeout=300)
    for r in results:
        assert r["cancelled"] is None and r["computed_steps"] == list(range(STEPS))
    assert results[0]["asks"] == STEPS - 1  # before steps 1 .. STEPS-1
    assert np.array_equal(results[0]["again"], results[0]["whole"])


@pytest.fixture(scope="module")
def folder22(tmp_path_factory):
    from xfuse.families.wan.presets import save_preset_pipeline

    return save_preset_pipeline(tmp_path_factory.mktemp("wan22") / "Wan2.2-T2V-tiny", "wan2.2-tiny")


# Wan 2.2's two experts, 6 steps: the high-noise expert runs steps 0-3 (one engine run), the low-noise one 4-5 (a
# second run); rank 0 is asked before each run's steps after its first: steps 1, 2, 3, then 5.
EXPERTS = dict(prompt="a red ball rolls across a table", height=64, width=96, num_frames=9, num_inference_steps=6,
               guidance_scale=4.0, guidance_scale_2=3.0, output_type="np", seed=5)  # fmt: skip


@pytest.mark.parametrize("ask,stopped_at,computed", [(2, 2, [0, 1]), (4, 5, [0, 1, 2, 3])])
def test_a_two_expert_call_stops_in_either_run(world4, folder22, ask, stopped_at, computed):
    """Stopped in the first expert's run, the second never starts; stopped in the second, the step is the call's
    (5 of 6: the second run's step 1). (``computed``: the engine's steps, numbered per run.)"""
    parallel = {"pipefusion_degree": 4, "num_patches": 5, "warmup_steps": 1}
    results = world4.run_ok(run_with_a_cancel, folder22, parallel, EXPERTS, ask, family="wan", timeout=300)
    for r in results:
        assert r["cancelled"]["stopped_at"] == stopped_at and r["cancelled"]["num_steps"] == 6, r["cancelled"]
        assert r["computed_steps"] == computed, (r["rank"], r["computed_steps"])
    assert results[0]["asks"] == ask
    assert np.array_equal(results[0]["again"], results[0]["whole"])
