"""Several calls as one stream through the pipeline (``XfusePipeline.run_stream``, ``PipeFusionEngine.
denoise_stream``) on real gloo ranks: each call's image is bitwise the one the same call gets alone in the same
processes (so each keeps its own scheduler, generator, latents and stale K/V), the calls really overlap (a later
call's tasks run on a rank before an earlier call's last one), and the calls after the stream are unchanged by it.
Linear, folded and balanced pipelines with M > N and warm-up, the exact mode, CFG parallel, step caching (each call
skips the steps it skips alone), mixed sizes, steps, seeds and prompts; a call of a stream stopped between steps on
every rank while the others run on; sequence parallelism refused before any communication. Every family:
``test_conformance``."""

import numpy as np
import pytest

from tests.support.pipeline_fns import (
    entered_in_flight,
    run_stream_with_a_stop,
    run_streamed_and_alone,
    stream_refusal,
)
from tests.support.world import World
from xfuse.families.hunyuandit.presets import save_tiny_pipeline

BASE = dict(output_type="np", use_resolution_binning=False)
CALLS = [  # mixed steps, seeds, prompts and sizes
    dict(BASE, prompt="a red house by a lake", height=128, width=96, num_inference_steps=6, seed=3),
    dict(BASE, prompt="a lighthouse at dusk", height=128, width=96, num_inference_steps=4, seed=5),
    dict(BASE, prompt="a red house by a lake", height=96, width=128, num_inference_steps=5, seed=7),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "HunyuanDiT-tiny")


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


FIRST_BLOCK = {"method": "first_block", "threshold": 0.5}  # skips steps of the tiny model's calls


@pytest.mark.parametrize(
    "parallel,cache",
    [
        ({"pipefusion_degree": 4, "placement": "linear", "num_patches": 5, "warmup_steps": 1}, None),
        ({"pipefusion_degree": 4, "placement": "folded", "num_patches": 4, "warmup_steps": 1}, None),
        ({"pipefusion_degree": 4, "placement": "balanced", "num_patches": 4, "warmup_steps": 2}, None),
        ({"pipefusion_degree": 4, "placement": "linear", "num_patches": 2, "warmup_steps": 0}, None),
        ({"pipefusion_degree": 4, "placement": "linear", "warmup_steps": 100}, None),  # exact: whole-image steps
        ({"pipefusion_degree": 2, "cfg_degree": 2, "num_patches": 3, "warmup_steps": 1}, None),
        ({"pipefusion_degree": 4, "placement": "linear", "num_patches": 4, "warmup_steps": 1}, FIRST_BLOCK),
        ({"pipefusion_degree": 4, "placement": "folded", "warmup_steps": 100}, FIRST_BLOCK),
        ({"pipefusion_degree": 4, "num_patches": 4, "warmup_steps": 1, "vae_parallel": "on"}, None),  # decoded by all
    ],
    ids=[
        "linear",
        "folded",
        "balanced",
        "no-warmup",
        "exact",
        "cfg2-pp2",
        "first-block",
        "first-block-exact",
        "vae-parallel",
    ],  # fmt: skip
)
def test_each_streamed_call_is_bitwise_the_call_alone(world4, folder, parallel, cache):
    """With step caching each call decides its own steps on its own residuals: the same steps skipped as alone."""
    results = world4.run_ok(run_streamed_and_alone, folder, parallel, CALLS, cache=cache, timeout=300)
    rank0 = results[0]
    runs = zip(rank0["alone"], rank0["streamed"], rank0["again"], strict=True)
    for index, (alone, streamed, again) in enumerate(runs):
        assert streamed.shape == alone.shape, index
        assert np.array_equal(streamed, alone), (index, float(np.abs(streamed - alone).max()))
        assert np.array_equal(again, alone), index  # the stream left nothing behind
    assert not np.array_equal(rank0["alone"][0][:, :96], rank0["alone"][2][:, :96])  # the calls differ
    for r in results[1:]:
        assert r["streamed"] == [None] * len(CALLS)
    assert all(sorted({task[0] for task in r["tasks"]}) == [0, 1, 2] for r in results)
    assert entered_in_flight(results, 1) and entered_in_flight(results, 2)
    assert rank0["decode_ranks"] == (4 if parallel.get("vae_parallel") == "on" else 1)
    if cache is not None:
        computed, skipped = (sum(steps[i] for steps in rank0["cache_steps_alone"]) for i in (0, 1))
        assert skipped > 0 and tuple(rank0["cache_steps_streamed"]) == (computed, skipped), rank0["cache_steps_alone"]


def test_a_stream_under_sequence_parallelism_is_refused_on_every_rank_before_it_communicates(world4, folder):
    parallel = {"pipefusion_degree": 2, "ulysses_degree": 2, "num_patches": 2, "warmup_steps": 1}
    results = world4.run_ok(stream_refusal, folder, parallel, CALLS[:2], timeout=300)
    for r in results:
        assert r["error"] is not None and "does not run under sequence parallelism" in r["error"], r
        assert "parallel.ulysses_degree and parallel.ring_degree 1" in r["error"]
    assert results[0]["after"] == (1, 128, 96, 3)  # the world is whole: the next call runs


@pytest.mark.parametrize(
    "parallel,stop_call,stop_before",
    [
        ({"pipefusion_degree": 4, "placement": "linear", "num_patches": 5, "warmup_steps": 1}, 0, 3),
        ({"pipefusion_degree": 4, "placement": "folded", "num_patches": 4, "warmup_steps": 1}, 1, 1),
        ({"pipefusion_degree": 4, "placement": "linear", "warmup_steps": 100}, 2, 4),  # exact: whole-image steps
        ({"pipefusion_degree": 2, "cfg_degree": 2, "num_patches": 3, "warmup_steps": 1}, 1, 2),
    ],
    ids=["linear-first", "folded-second", "exact-third", "cfg2-pp2-second"],
)
def test_a_call_of_a_stream_stops_on_every_rank_and_the_others_are_each_the_call_alone(
    world4, folder, parallel, stop_call, stop_before
):
    results = world4.run_ok(run_stream_with_a_stop, folder, parallel, CALLS, stop_call, stop_before, timeout=300)
    steps = CALLS[stop_call]["num_inference_steps"]
    for r in results:
        stopped = r["streamed"][stop_call]
        assert stopped is not None and stopped["stopped_at"] == stop_before, (r["rank"], stopped)
        assert f"cancelled before step {stop_before} of {steps}" in stopped["message"]
        assert r["computed_steps"] == list(range(stop_before)), (r["rank"], r["computed_steps"])
    rank0 = results[0]
    assert rank0["asks"] == stop_before  # asked once per step, up to the one that stops it
    for index in range(len(CALLS)):
        if index != stop_call:
            assert np.array_equal(rank0["streamed"][index], rank0["alone"][index]), index
        assert np.array_equal(rank0["again"][index], rank0["alone"][index]), index
