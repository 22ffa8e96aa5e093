"""``xfuse plan``'s per-rank memory against what the ranks of a real world hold, for the 2026 families' tiny presets:
each rank of global rank 0's pipeline group (what the plan's table lists) runs a request twice, and what it holds
beside its weights at its peak (``xfuse.perf.activations.call_peaks`` on real CPU tensors: what its blocks and the
loop keep between requests, its stale K/V and receive buffers among them, plus its largest transient: a text
encoder's forward, a block, the loop, the VAE decode) is the plan's stale K/V plus activations within 10 %. The
weights are exact (``tests/multirank/test_flux2.py``, ``test_qwenimage.py``, ``test_zimage.py``).

The count is of tensors; each CPU kernel's own workspace (the CPU flash attention's per-thread blocks) is not a
tensor and is not counted on either side (``tests/unit/test_activations.py``).
"""

import pytest
import torch

from tests.support.memory_fns import held_peaks, stale_kv_held
from tests.support.world import World
from xfuse.config import config_from_dict
from xfuse.families.registry import model_spec
from xfuse.perf.activations import trace_call
from xfuse.perf.memory import rank_memory
from xfuse.perf.planner import workload

SIDE, STEPS, FRAMES = 256, 4, 17


@pytest.fixture(scope="module")
def world2():
    with World(2, start_timeout=240) as w:
        yield w


CASES = [
    ("flux2-tiny", {"pipefusion_degree": 2}, False),
    ("flux2-tiny", {"pipefusion_degree": 2, "vae_parallel": "on"}, False),  # every rank decodes a band
    ("flux2-tiny", {"ulysses_degree": 2}, False),
    ("flux2-klein-tiny", {"pipefusion_degree": 2}, False),  # CFG batched on each rank, whole images in 2 parts
    ("flux2-klein-tiny", {"cfg_degree": 2}, False),
    ("qwen-image-tiny", {"pipefusion_degree": 2}, False),
    ("qwen-image-tiny", {"ulysses_degree": 2}, False),
    ("qwen-image-tiny", {"cfg_degree": 2}, True),  # true CFG: a negative prompt
    ("z-image-tiny", {"pipefusion_degree": 2}, False),
    ("z-image-tiny", {"ulysses_degree": 2}, False),
    ("z-image-tiny", {"cfg_degree": 2}, True),
    ("ltx-tiny", {"pipefusion_degree": 2}, False),  # the generic family: every rank runs the model's prologue
    ("ltx-tiny", {"ulysses_degree": 2}, False),
]


@pytest.mark.parametrize("preset,parallel,negative", CASES,
                         ids=[f"{p}-{'_'.join(f'{k}{v}' for k, v in par.items())}" for p, par, _ in CASES])  # fmt: skip
def test_the_plan_holds_what_each_rank_holds(world2, preset, parallel, negative):
    frames = FRAMES if model_spec(preset).video else None  # a clip's length, the same in the call and the plan
    call = {
        **trace_call(preset, SIDE, SIDE, frames, negative_prompt=negative),
        "output_type": "np",
        "num_inference_steps": STEPS,
    }
    generation = {"height": SIDE, "width": SIDE, "num_inference_steps": STEPS}
    if frames is not None:
        generation["num_frames"] = frames
    if negative:
        generation["negative_prompt"] = call["negative_prompt"]
    config = config_from_dict({"model": preset, "parallel": parallel, "generation": generation})
    planned = rank_memory(preset, workload(config), config.parallel, torch.float32)
    held = world2.run_ok(held_peaks, preset, parallel, call, timeout=600)
    pp, sp = config.parallel.pipefusion_degree, config.parallel.sequence_degree
    for rank, peaks in enumerate(held):
        if rank // (pp * sp) or rank % sp:  # not in global rank 0's pipeline group: the plan lists those
            continue
        plan = planned[rank // sp % pp]
        planned_bytes = plan.kv_bytes + plan.activation_bytes
        print(
            f"{preset} {parallel} rank {rank}: held {peaks.total() / 2**20:.2f} MiB, planned "
            f"{planned_bytes / 2**20:.2f} ({planned_bytes / peaks.total() - 1:+.1%})"
        )
        assert planned_bytes == pytest.approx(peaks.total(), rel=0.10), (rank, peaks, plan)


def test_with_step_caching_the_plan_holds_a_whole_image_pass_of_the_whole_batch(world2):
    """With step caching a whole-image step runs its transformer batch in one part (its decision is on the whole
    batch: ``batch_parts``), so the busiest pass is twice the parts' under CFG: FLUX.2 [klein]'s batched guidance at
    pipefusion 2, one warm-up step of four, First-Block Cache at 0 (every step computed)."""
    preset, parallel, cache = "flux2-klein-tiny", {"pipefusion_degree": 2}, {"method": "first_block", "threshold": 0}
    call = {**trace_call(preset, SIDE, SIDE), "output_type": "np", "num_inference_steps": STEPS}
    generation = {"height": SIDE, "width": SIDE, "num_inference_steps": STEPS}
    config = config_from_dict({"model": preset, "parallel": parallel, "cache": cache, "generation": generation})
    planned = rank_memory(preset, workload(config), config.parallel, torch.float32)
    held = world2.run_ok(held_peaks, preset, parallel, call, cache, timeout=600)
    for rank, peaks in enumerate(held):
        planned_bytes = planned[rank].kv_bytes + planned[rank].activation_bytes
        assert planned_bytes == pytest.approx(peaks.total(), rel=0.10), (rank, peaks, planned[rank])


@pytest.mark.parametrize("parallel", [{"pipefusion_degree": 2}, {"ulysses_degree": 2}, {"cfg_degree": 2},
                                      {"pipefusion_degree": 2, "num_patches": 1}])  # fmt: skip
def test_the_plan_counts_stale_kv_only_where_the_engine_keeps_it(world2, parallel):
    """One patch (a sequence- or CFG-parallel layout's default, or ``num_patches: 1``): every step a whole-image
    pass, nothing stale, no K/V kept, and the plan counts none (``xfuse.parallel.costs.keeps_stale_kv``); with more
    patches both hold some (Z-Image's engine 3x the plan's count here: see the plan's K/V for a single-stream model)."""
    call = {**trace_call("z-image-tiny", SIDE, SIDE), "output_type": "np", "num_inference_steps": STEPS}
    generation = {"height": SIDE, "width": SIDE, "num_inference_steps": STEPS}
    config = config_from_dict({"model": "z-image-tiny", "parallel": parallel, "generation": generation})
    planned = rank_memory("z-image-tiny", workload(config), config.parallel, torch.float32)
    held = world2.run_ok(stale_kv_held, "z-image-tiny", parallel, call, timeout=600)
    pipelined = config.parallel.resolved_num_patches > 1
    assert all((n > 0) is pipelined for n in held), held
    assert all((rank.kv_bytes > 0) is pipelined for rank in planned), planned
