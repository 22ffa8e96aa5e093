"""Every registered family's stage pass is one graph that reads nothing back to the host, and ``compile.mode: graphs``
runs it so: for each kind of pass a degree-1 engine runs (the whole image, the step's first patch with the plan's
streams, a later patch), the pipeline's ``CapturedStage`` (``xfuse.parallel.pass_graphs``) runs every pass after a
request's first of its kind through ``torch.compile(fullgraph=True)`` of ``Stage.run_segment``: no graph break, no
host read in its graph, the eager pass issues no operation whose result the host reads (counted at the dispatcher),
the latents equal the eager pipeline's bit for bit, and a second request with another prompt makes no graph again
(its text K/V go into the same slots), and every input a graph pass writes in place has a static address. What
capturing a stage's passes as CUDA graphs needs (``docs/performance.md``).
Since torch 2.13 a traced ``.item()`` is no graph break (it becomes a graph's scalar output), so the graph's nodes
are read for host reads.

Each family's smallest preset (HunyuanDiT's and PixArt-Sigma's at 4 blocks: ``TRACED_LAYERS``) at 4 x 4 tokens
(``benchmarks/bench_host.py``'s call), three whole-image steps (the first two keep no K/V, the last keeps them) and
two pipelined steps of two patches: the graph passes are the second step's whole image and the last step's patches.
Each graph is recorded as dynamo traced it, then run by the graphs mode's own backend (``EagerKernelGraphs``, the
capture left out on a CPU). A batch part's pass (degree >= 2 under guidance; ``test_regional_compile.py`` runs them
at pipefusion 2) is a whole-image pass on some of the batch's rows: the same code with other row slices. Degree 1 in
this process, but the product's error for a pass that is not one graph, which ends the world it happens in, on a
one-rank world of its own. The module sits in this tier for its cost (a trace is seconds per pass, like
``test_regional_compile.py``'s)."""

import collections

import pytest
import torch
import torch._dynamo

from benchmarks.bench_host import HOST_SYNCS, counting_ops, family_call, run
from tests.support.compile_fns import a_pass_that_is_not_one_graph
from tests.support.world import World
from xfuse.families.common.presets import seeded
from xfuse.families.registry import FAMILIES
from xfuse.parallel.pass_graphs import EagerKernelGraphs

PASS_KINDS = ("whole image", "first patch", "later patch")
# The families whose stage compile.mode compiles (``ModelSpec.compiles``): the generic family's passes run eagerly,
# and loading one with a compile mode is refused by name (``tests/unit/test_generic_family.py``).
COMPILED = [spec for spec in FAMILIES if spec.compiles]
# What a traced graph calls that reads a tensor's value on the host (the dispatcher's ``HOST_SYNCS``, as dynamo names
# them: methods of a tensor, or functions).
GRAPH_HOST_READS = {"item", "tolist", "nonzero", "_local_scalar_dense", "equal", "is_nonzero", "__bool__"}
PARALLEL = {"pipefusion_degree": 1, "num_patches": 2, "warmup_steps": 3}
STEPS = 5  # warm-up steps 0-2 (a whole-image graph pass at step 1), pipelined steps 3-4 (patch graph passes at 4)
OTHER_PROMPT = "a lighthouse on a cliff at dusk"  # the second request's


def pass_kind(band) -> str:
    return "whole image" if band is None else "first patch" if band.index == 0 else "later patch"


# Blocks traced where a family's smallest preset has more: HunyuanDiT's tiny preset has 16 (other tests split it up to
# degree 8) and PixArt-Sigma's 8; at 4 every block's code is still traced (HunyuanDiT's block 3 takes block 0's long
# skip, and its degree-1 route still has two segments) in a third of dynamo's time (HunyuanDiT: 23 s -> 8 s).
TRACED_LAYERS = {"hunyuandit": 4, "pixart-sigma": 4}


def _pipeline(spec, **sections):
    base = spec.build_preset_pipeline(spec.presets[0])
    if spec.name in TRACED_LAYERS:
        transformer = base.transformer
        with seeded(0, "transformer"):
            config = {**transformer.config, "num_layers": TRACED_LAYERS[spec.name]}
            base.transformer = type(transformer).from_config(config).eval()
    pipe = spec.pipeline_class().from_pipe(base, parallel=PARALLEL, **sections)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(output) -> torch.Tensor:
    return output.frames if hasattr(output, "frames") else output.images


def stage_passes(spec, break_in=None) -> dict:
    """For each pass kind of ``spec``'s smallest preset: ``graph_break`` (None, or what stopped the one-graph trace of
    its graph passes), ``graph_host_reads`` (the traced graphs' calls that read a value on the host) and
    ``host_syncs`` (the ops, by name, whose result the host reads, over every eager pass of the kind); and
    ``"requests"``: per request, the graphs it made and whether its latents equal the eager pipeline's.
    ``break_in``: a function every pass calls on its hidden states first (a test's injected host read)."""
    eager_pipe = _pipeline(spec)
    call = family_call(spec)
    stage = eager_pipe.stage
    eager_run = stage.run_segment

    def with_break(run_segment):
        if break_in is None:
            return run_segment

        def broken(hidden, *args, **kwargs):
            break_in(hidden)
            return run_segment(hidden, *args, **kwargs)

        return broken

    found: dict = {}

    def counted(hidden, segment, cond, band, *args, **kwargs):
        syncs = found.setdefault(pass_kind(band), {"host_syncs": collections.Counter()})["host_syncs"]
        ops: collections.Counter = collections.Counter()
        with counting_ops(ops):
            out = with_break(eager_run)(hidden, segment, cond, band, *args, **kwargs)
        syncs.update({name: n for name, n in ops.items() if name in HOST_SYNCS})
        return out

    stage.run_segment = counted  # the first request's passes: every kind (a dispatch mode costs each op dearly)
    eager = [_latents(run(eager_pipe, call, STEPS))]
    stage.run_segment = eager_run
    eager.append(_latents(run(eager_pipe, {**call, "prompt": OTHER_PROMPT}, STEPS)))

    torch._dynamo.reset()
    graph_pipe = _pipeline(spec, compile={"mode": "graphs"})
    captured = graph_pipe.engine.stage  # the CapturedStage the engine drives
    graph_pass = with_break(captured.inner.run_segment)
    graphs: list[torch.fx.GraphModule] = []

    product = EagerKernelGraphs(capture=False)  # compile.mode graphs' own backend, as on a GPU but for the capture

    def recording(graph: torch.fx.GraphModule, example_inputs):
        graphs.append(graph)
        return product(graph, example_inputs)

    one_graph = torch.compile(graph_pass, fullgraph=True, backend=recording)

    def traced(hidden, segment, cond, band, *args, **kwargs):
        entry = found[pass_kind(band)]
        if entry.get("graph_break"):  # a kind that broke: its later passes run eagerly
            return graph_pass(hidden, segment, cond, band, *args, **kwargs)
        made = len(graphs)
        try:
            out = one_graph(hidden, segment, cond, band, *args, **kwargs)
        except torch._dynamo.exc.Unsupported as exc:
            entry["graph_break"] = str(exc).splitlines()[0]
            return graph_pass(hidden, segment, cond, band, *args, **kwargs)
        entry.setdefault("graph_break", None)
        reads = {
            name for graph in graphs[made:] for node in graph.graph.nodes if (name := _called(node)) in GRAPH_HOST_READS
        }
        entry["graph_host_reads"] = sorted(set(entry.get("graph_host_reads", ())) | reads)
        return out

    captured.graph_pass = traced
    found["requests"], found["segments"] = [], len(graph_pipe.plan.route)
    for prompt, expected in zip((call["prompt"], OTHER_PROMPT), eager, strict=True):
        made, passes = len(graphs), captured.graph_passes
        latents = _latents(run(graph_pipe, {**call, "prompt": prompt}, STEPS))
        found["requests"].append({"graphs": len(graphs) - made, "graph_passes": captured.graph_passes - passes,
                                  "equal": torch.equal(latents, expected)})  # fmt: skip
    found["uncaptured"] = product.uncaptured
    torch._dynamo.reset()
    return found


def _called(node: torch.fx.Node) -> str:
    """The name of what a traced graph's node calls ("" for a placeholder or an output)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return ""


@pytest.fixture(scope="module")
def passes():
    return {spec.name: stage_passes(spec) for spec in COMPILED}


@pytest.mark.parametrize("kind", PASS_KINDS)
@pytest.mark.parametrize("family", [spec.name for spec in COMPILED])
def test_every_stage_pass_is_one_graph_with_no_host_read(passes, family, kind):
    assert kind in passes[family], f"{family}: no {kind} pass ran"
    found = passes[family][kind]
    assert "graph_break" in found, f"{family}, {kind}: no pass of this kind ran as a graph"
    assert found["graph_break"] is None, f"{family}, {kind}: {found['graph_break']}"
    assert found["graph_host_reads"] == [] and found["host_syncs"] == {}, f"{family}, {kind}: the host reads back"


@pytest.mark.parametrize("family", [spec.name for spec in COMPILED])
def test_graph_passes_equal_eager_and_a_new_prompt_makes_no_graph(passes, family):
    """Per request and segment of the route (HunyuanDiT's has two at degree 1): one whole-image graph pass and one per
    patch (the later passes of each kind), the latents bit for bit the eager pipeline's; the second request, another
    prompt, replays the first's graphs."""
    first, second = passes[family]["requests"]
    per_request = passes[family]["segments"] * (1 + PARALLEL["num_patches"])
    assert first["graph_passes"] == second["graph_passes"] == per_request, (first, second)
    assert first["equal"] and second["equal"], (first, second)
    assert first["graphs"] == per_request and second["graphs"] == 0, (first, second)


@pytest.mark.parametrize("family", [spec.name for spec in COMPILED])
def test_every_input_a_graph_pass_writes_has_a_static_address(passes, family):
    """What a CUDA graph of the pass needs (``EagerKernelGraphs``, the capture left out on a CPU): every input the
    pass writes in place is one the graph keeps at its address (the K/V buffers and text slots, ``static_slot``), not
    one copied in before a replay, whose write would be lost."""
    assert passes[family]["requests"][0]["graphs"] > 0  # the backend ran: graphs were made and checked
    assert passes[family]["uncaptured"] == [], passes[family]["uncaptured"]


def test_a_host_read_or_a_branch_on_a_value_inside_one_familys_pass_is_found():
    """Wan's stage pass (the cheapest family to trace) with an ``.item()`` whose value it uses: every kind of pass
    has ``item`` in its graph and counts ``_local_scalar_dense`` at the dispatcher; with a branch on a tensor's value
    instead, the one-graph trace breaks, saying why, and the product's ``CapturedStage`` names the pass that broke.
    (A read whose value is unused leaves the graph: only the eager count has it.)"""
    wan = next(spec for spec in FAMILIES if spec.name == "wan")
    found = stage_passes(wan, break_in=lambda hidden: hidden.mul_(1 + 0 * hidden.sum().item()))  # a read used
    for kind in PASS_KINDS:
        assert found[kind]["graph_host_reads"] == ["item"], found[kind]
        assert set(found[kind]["host_syncs"]) == {"_local_scalar_dense"}

    def branch(hidden):
        if hidden.sum() > 0:
            hidden.add_(0)

    found = stage_passes(wan, break_in=branch)
    for kind in PASS_KINDS:
        assert found[kind]["graph_break"] == "Data-dependent branching", found[kind]
        assert set(found[kind]["host_syncs"]) == {"_local_scalar_dense"}

    with World(1) as world:  # the product's error ends the world it happens in: one of its own
        (error,) = world.run_ok(a_pass_that_is_not_one_graph, wan.presets[0], PARALLEL, STEPS, timeout=120)
    assert error is not None and error.startswith(
        "the stage pass of blocks 0-3 over the whole image is not one graph (Data-dependent branching), as "
        "compile.mode graphs and regional+graphs need; use compile.mode regional or off for this model"
    ), error
