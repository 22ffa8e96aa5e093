"""Every registered family's stage pass is one graph that reads nothing back to the host: for each kind of pass a
degree-1 engine runs (the whole image, the step's first patch with the plan's streams, a later patch),
``torch.compile(fullgraph=True)`` traces ``Stage.run_segment`` on CPU with no graph break and no host read in its
graph, and the eager pass issues no operation whose result the host reads (counted at the dispatcher). What capturing
a stage's passes once and replaying them needs (CUDA graphs, ``docs/performance.md``). Since torch 2.13 a traced
``.item()`` is no graph break (it becomes a graph's scalar output), so the graph's nodes are read for host reads.

Each family's smallest preset, at 4 x 4 tokens (``benchmarks/bench_host.py``'s call), one warm-up step and one
pipelined step of two patches. A batch part's pass (degree >= 2 under guidance) is a whole-image pass on some of the
batch's rows: the same code with other row slices. No process group: the module sits in this tier for its cost (a
trace is seconds per pass, like ``test_regional_compile.py``'s), beside the other compiles, not in the unit tier's
minute."""

import collections

import pytest
import torch
import torch._dynamo

from benchmarks.bench_host import HOST_SYNCS, counting_ops, family_call, run
from xfuse.families.registry import FAMILIES

PASS_KINDS = ("whole image", "first patch", "later patch")
# What a traced graph calls that reads a tensor's value on the host (the dispatcher's ``HOST_SYNCS``, as dynamo names
# them: methods of a tensor, or functions).
GRAPH_HOST_READS = {"item", "tolist", "nonzero", "_local_scalar_dense", "equal", "is_nonzero", "__bool__"}
PARALLEL = {"pipefusion_degree": 1, "num_patches": 2, "warmup_steps": 1}


def pass_kind(band) -> str:
    return "whole image" if band is None else "first patch" if band.index == 0 else "later patch"


def stage_passes(spec, break_in=None) -> dict[str, dict]:
    """For each pass kind of ``spec``'s smallest preset: ``graph_break`` (None, or what stopped the one-graph trace of
    its first pass), ``graph_host_reads`` (the traced graph's calls that read a value on the host) and ``host_syncs``
    (the ops, by name, whose result the host reads, over every eager pass of the kind).
    ``break_in``: a function every pass calls on its hidden states first (a test's injected host read)."""
    pipe = spec.pipeline_class().from_pipe(spec.build_preset_pipeline(spec.presets[0]), parallel=PARALLEL)
    pipe.set_progress_bar_config(disable=True)
    call = family_call(spec)
    stage = pipe.stage
    eager = stage.run_segment
    if break_in is not None:

        def eager(hidden, *args, _run=stage.run_segment, **kwargs):
            break_in(hidden)
            return _run(hidden, *args, **kwargs)

    found: dict[str, dict] = {}

    def counted(hidden, segment, cond, band, *args, **kwargs):
        syncs = found.setdefault(pass_kind(band), {"host_syncs": collections.Counter()})["host_syncs"]
        ops: collections.Counter = collections.Counter()
        with counting_ops(ops):
            out = eager(hidden, segment, cond, band, *args, **kwargs)
        syncs.update({name: n for name, n in ops.items() if name in HOST_SYNCS})
        return out

    stage.run_segment = counted
    run(pipe, call, 2)

    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def recording(graph: torch.fx.GraphModule, example_inputs):  # tracing only: the graph runs as traced
        graphs.append(graph)
        return graph.forward

    one_graph = torch.compile(eager, fullgraph=True, backend=recording)

    def traced(hidden, segment, cond, band, *args, **kwargs):
        entry = found[pass_kind(band)]
        if "graph_break" in entry:  # one trace per kind: its later passes run eagerly
            return eager(hidden, segment, cond, band, *args, **kwargs)
        try:
            graphs.clear()
            out = one_graph(hidden, segment, cond, band, *args, **kwargs)
            entry["graph_break"] = None
            entry["graph_host_reads"] = sorted(
                {name for graph in graphs for node in graph.graph.nodes if (name := _called(node)) in GRAPH_HOST_READS}
            )
            return out
        except torch._dynamo.exc.Unsupported as exc:
            entry["graph_break"] = str(exc).splitlines()[0]
            return eager(hidden, segment, cond, band, *args, **kwargs)

    stage.run_segment = traced
    run(pipe, call, 2)
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
    return {spec.name: stage_passes(spec) for spec in FAMILIES}


@pytest.mark.parametrize("kind", PASS_KINDS)
@pytest.mark.parametrize("family", [spec.name for spec in FAMILIES])
def test_every_stage_pass_is_one_graph_with_no_host_read(passes, family, kind):
    assert kind in passes[family], f"{family}: no {kind} pass ran"
    found = passes[family][kind]
    assert found["graph_break"] is None, f"{family}, {kind}: {found['graph_break']}"
    assert found["graph_host_reads"] == [] and found["host_syncs"] == {}, f"{family}, {kind}: the host reads back"


def test_a_host_read_or_a_branch_on_a_value_inside_one_familys_pass_is_found():
    """Wan's stage pass (the cheapest family to trace) with an ``.item()`` whose value it uses: every kind of pass
    has ``item`` in its graph and counts ``_local_scalar_dense`` at the dispatcher; with a branch on a tensor's value
    instead, the one-graph trace breaks, saying why. (A read whose value is unused leaves the graph: only the eager
    count has it.)"""
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
