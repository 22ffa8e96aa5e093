"""Regional compile of a rank's blocks (``xfuse.parallel.regional_compile``): the compiled pipeline computes what the
eager one does, and no block's graph depends on which block it is (the guards name shapes, never a block's key), so
a rank compiles a few graphs per block class, not one per block. ``aot_eager``: dynamo's capture and AOT autograd
without code generation (what the guards and graph breaks depend on), in seconds; Inductor's own numerics are the
benchmark's business."""

import copy
import inspect

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from tests.support.compile_fns import cached_graph_passes, compile_counts_over_requests, graph_passes_over_requests
from tests.support.world import World
from xfuse.families.registry import load_pipeline, model_spec
from xfuse.parallel.regional_compile import compile_blocks

CALL = dict(prompt="a red house", num_inference_steps=2, height=128, width=128, output_type="latent")


def _latents(pipe, preset):
    extra = {"num_frames": 5} if preset.startswith("wan") else {}
    if "use_resolution_binning" in inspect.signature(pipe.__call__).parameters:  # HunyuanDiT's: 128 px -> 1,024
        extra["use_resolution_binning"] = False
    out = pipe(**CALL, **extra, generator=torch.Generator().manual_seed(0))
    return out.frames if hasattr(out, "frames") else out.images


@pytest.mark.parametrize("preset", ["tiny", "pixart-tiny", "sd3-tiny", "flux-tiny", "flux2-tiny", "qwen-image-tiny",
                                    "z-image-tiny", "wan-tiny"])  # fmt: skip
def test_compiled_blocks_equal_eager_and_no_graph_is_a_blocks_own(preset):
    base = load_pipeline(preset)
    pipes = []
    for compiled in (False, True):
        pipe = model_spec(preset).pipeline_class().from_pipe(copy.deepcopy(base), parallel={"pipefusion_degree": 1})
        pipe.set_progress_bar_config(disable=True)
        if compiled:
            torch._dynamo.reset()
            dynamo_utils.counters.clear()
            dynamo_utils.guard_failures.clear()
            compile_blocks(pipe.stage, backend="aot_eager")
            kept = [pipe.stage.blocks[i] for i in pipe.stage.block_ids]
            assert kept and all(block._compiled_call_impl is not None for block in kept)
        pipes.append(pipe)
    eager, compiled = (_latents(pipe, preset) for pipe in pipes)
    scale = eager.abs().max().item()
    assert (compiled - eager).abs().max().item() <= 1e-5 * max(scale, 1.0)
    assert dynamo_utils.counters["stats"]["unique_graphs"] > 0  # the blocks did compile
    breaks = dict(dynamo_utils.counters["graph_break"])
    assert all("torch.compiler.disable" in reason for reason in breaks), breaks  # only the eager regions
    reasons = [reason for failures in dynamo_utils.guard_failures.values() for reason in failures]
    per_block = [r for r in map(str, reasons) if ".key ==" in r or ".layer ==" in r or "_kv" in r]
    assert per_block == [], per_block[:3]


def test_from_pipe_takes_the_compile_section_and_compiles_only_what_the_rank_keeps():
    """``compile=`` as diffusers-style sections go (``from_pipe`` / ``from_pretrained``), refused beside ``config=``;
    a bad value names its key."""
    from xfuse.config import XfuseConfig
    from xfuse.errors import ConfigError

    spec = model_spec("flux-tiny")
    pipe = spec.pipeline_class().from_pipe(load_pipeline("flux-tiny"), parallel={"pipefusion_degree": 1},
                                           compile={"mode": "regional", "backend": "aot_eager"})  # fmt: skip
    assert pipe.config.compile.mode == "regional" and pipe.config.compile.backend == "aot_eager"
    kept = [pipe.stage.blocks[i] for i in pipe.stage.block_ids]
    assert kept and all(block._compiled_call_impl is not None for block in kept)
    with pytest.raises(ValueError, match="pass either config= or the parallel= / comm= / cache= / compile= sections"):
        spec.pipeline_class().from_pipe(load_pipeline("flux-tiny"), config=XfuseConfig(model="flux-tiny"),
                                        compile={"mode": "regional"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"compile.mode"):
        spec.pipeline_class().from_pipe(load_pipeline("flux-tiny"), compile={"mode": "full"})


@pytest.fixture(scope="module")
def world2():
    with World(2) as world:
        yield world


def test_compiles_are_bounded_by_the_shapes_a_served_life_meets(world2):
    """A 2-stage pipelined world (2 patches, one warm-up step), ``max_shapes`` 2, torch's own counters per rank: the
    warm-up of a size compiles every graph a 20-step request of that size needs (the whole image, then the patches:
    nothing compiles after it); ten requests over two sizes compile the second size once and nothing after it; a
    third size compiles nothing, runs eagerly, is counted, and still answers. A request of a compiled shape waits
    ``comm.timeout_s``, not the compile bound (read at every step of the 20-step request)."""
    parallel = {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 1, "placement": "linear"}
    sizes, third = [(128, 128), (128, 96)], (96, 96)
    results = world2.run_ok(compile_counts_over_requests, "tiny", parallel, sizes, third, timeout=300)
    bounds_seen = set().union(*(seen for *_, (seen, _) in results))
    assert bounds_seen == {results[0][5][1]}, bounds_seen  # a compiled shape's request waits comm.timeout_s, no more
    for rank, (graphs, compiled, eager, frames, _, _) in enumerate(results):
        assert graphs["warm-up"] > graphs["start"], (rank, graphs)  # it compiled
        assert graphs["20 steps"] == graphs["warm-up"], (rank, graphs)  # a request of the warmed size: nothing new
        assert graphs["each size once"] > graphs["20 steps"], (rank, graphs)  # the second size compiled
        assert graphs["10 requests"] == graphs["each size once"], (rank, graphs)  # and neither again
        assert graphs["third size"] == graphs["10 requests"], (rank, graphs)  # past max_shapes: nothing compiled
        assert list(compiled.values()) == [2] and eager == 1, (rank, compiled, eager)
        assert frames["total"] >= frames["ok"] > 0, frames
    assert results[0][4] is not None and results[1][4] is None  # rank 0 answered the eager request


def test_graph_passes_equal_eager_over_two_stages_and_past_max_shapes_run_eagerly(world2):
    """``compile.mode: graphs`` on a 2-stage pipelined world (2 patches, three warm-up steps, guidance's batch streamed
    in two parts through the warm-up; ``aot_eager`` on this CPU, where nothing is captured: the same graphs as on a
    GPU, run as traced): the warm-up of a size makes its graphs, its line says so; two 5-step requests of it with
    other prompts make none and run every pass after its kind's first as a graph (a kind per batch part and per
    patch), latents equal to the eager pipeline's bit for bit; a request of a second size, past ``max_shapes`` 1, runs
    eagerly, is said once, and equals eager too."""
    parallel = {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 3, "placement": "linear"}
    results = world2.run_ok(graph_passes_over_requests, "sd3-tiny", parallel, (128, 128), (128, 96), timeout=300)
    for rank, (rows, eager_requests, stderr) in enumerate(results):
        assert "compile.mode graphs: shape 1 of 1 (128x128): " in stderr, stderr
        assert "compile.max_shapes = 1 shapes compiled; latents 1x16x12x16 runs eagerly on every rank" in stderr, stderr
        first, second, past = rows
        # eager: step 0's two batch parts, step 2's (the last warm-up step keeps its K/V: another kind) and step 3's
        # two patches; graphs: step 1's batch parts and step 4's patches
        assert first["graphs"] == second["graphs"] == 0 and first["passes"] == second["passes"] == (6, 4), rows
        assert past["graphs"] == 0 and eager_requests == 1, (rows, eager_requests)
        if rank == 0:
            assert first["equal"] and second["equal"] and past["equal"], rows


def test_graph_passes_with_step_caching_take_the_eager_decisions_and_equal_its_latents(world2):
    """Step caching under ``compile.mode: graphs`` (issue 79): a skipped step's passes (block 0 alone on the embedding
    rank; none elsewhere) are kinds of their own, so a cached request runs the computed and the skipped steps' passes
    as graphs. Pipelined on 2 stages (2 patches, one warm-up step), First-Block Cache at 0.3 skips steps of SD3's tiny
    preset: the graphs build takes the eager build's decisions step by step and its latents equal the eager ones bit
    for bit, for a second prompt too, which makes no graph."""
    parallel = {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 1}
    cache = {"method": "first_block", "threshold": 0.3}
    results = world2.run_ok(cached_graph_passes, "sd3-tiny", parallel, cache, ("a red house", "a blue boat"), 8,
                            timeout=300)  # fmt: skip
    for rank, rows in enumerate(results):
        first, second = rows
        assert first["graphs"] > 0 and second["graphs"] == 0, (rank, rows)
        for row in rows:
            eager, graphs = row["decisions"]
            assert eager == graphs and False in eager and eager[:2] == [True, True], (rank, row)
        if rank == 0:
            assert first["equal"] and second["equal"], rows
