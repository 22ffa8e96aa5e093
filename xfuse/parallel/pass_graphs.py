"""``compile.mode: graphs`` and ``regional+graphs``: each stage pass one graph, captured once and replayed.

A stage pass (``Stage.run_segment``: one segment's blocks over the whole image, a batch part, or patch p) is the same
code on tensors of the same shapes in every step after its first: PipeFusion's stale K/V and the text slots are
buffers written in place at one address (``StaleKVCache``, ``CachedCrossAttnProcessor``; ``static_slot`` marks them),
and a step's timestep, modulation and RoPE inputs are new tensors of the request's shapes. So a pass can be one graph
that a GPU replays without the host issuing its kernels one by one (``docs/performance.md``, "The host's cost").

``CapturedStage`` wraps a family's stage (applied from outside: a ``StageWrapper``, as ``SequenceParallelStage`` is)
and runs a request's first pass of each *kind* (segment, patch or whole image, batch part, whether it keeps K/V,
carries streams or ControlNet residuals) eagerly: that pass allocates the buffers and writes the slots, outside any
graph. Every later pass of that kind goes through ``torch.compile(fullgraph=True)`` of the family's ``run_segment``:
dynamo makes one graph per kind and request shape (its guards tell them apart), then

* ``graphs``: ``EagerKernelGraphs`` captures the graph's own (eager) kernels in a CUDA graph at its first compiled
  call (CUDA graph trees) and replays it after, the non-static inputs copied into the graph's static ones;
* ``regional+graphs``: Inductor's kernels for the graph (``mode="reduce-overhead"``), captured the same way.

The P2P exchanges stay outside: a pass runs between them. A replay writes its outputs into the graph's memory pool,
where the next replay writes again, so the hidden states, skips and streams a pass hands on are copied out (one copy
each, on CUDA; ``torch.compiler.cudagraph_mark_step_begin`` before each pass says the previous ones are consumed).
On another device nothing is captured: the same graphs run as traced (AOT autograd's eager kernels, or Inductor's),
which is what CI checks on a CPU (the pass kinds, their guards, the static buffers, the numbers). Sequence
parallelism exchanges inside a pass (its all-to-all): these modes refuse it (``XfuseConfig``).
"""

from __future__ import annotations

from typing import Any

import torch

from xfuse.parallel.patch_grid import PatchBand, PatchGrid
from xfuse.parallel.stage import StageWrapper, controls_kwarg
from xfuse.parallel.stage_plan import Segment

__all__ = ["CapturedStage", "EagerKernelGraphs", "compile_pass"]


class EagerKernelGraphs:
    """``compile.mode: graphs``'s ``torch.compile`` backend: AOT autograd's graph of a stage pass run as its own
    (eager) kernels, no code generated, captured as a CUDA graph by CUDA graph trees where ``capture``.

    What torch's ``cudagraphs`` backend does, with the static inputs Inductor's ``reduce-overhead`` takes: the
    parameters and the static-address tensors (``static_slot``), from AOT's metadata. torch's own backend counts only
    the parameters AOT lifts, none when dynamo inlines the modules (its default), so it would copy every weight into
    the graph's memory before each replay and refuse the K/V buffers' in-place writes. A graph that writes in place
    into another input (which a replay would write into its own copy) runs uncaptured: said as torch says it (its
    ``cudagraph_skips`` counter, the compiler's "not captured") and named in ``uncaptured``.
    """

    def __init__(self, capture: bool):
        self.capture = capture
        self.uncaptured: list[str] = []  # per graph left uncaptured: the inputs it writes that are not static

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list):
        from torch._dynamo.backends.common import aot_autograd

        # the K/V buffers' writes stay in the graph (not applied after it by AOT's wrapper)
        return aot_autograd(fw_compiler=self._forward, keep_inference_input_mutations=True)(graph, example_inputs)

    def _forward(self, graph: torch.fx.GraphModule, inputs: list):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.cudagraphs import find_input_mutations, get_device_index, get_stack_traces
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._inductor.compile_fx import cudagraphify, get_static_input_idxs
        from torch._inductor.cudagraph_utils import get_placeholder_info, log_cudagraph_skip_and_bump_counter

        # uncaptured, the graph's own code runs its kernels; captured, torch's interpreter (as its backend's), once
        run = boxed_nop(graph, inputs) if self.capture else make_boxed_func(graph.forward)
        static = get_static_input_idxs(0)  # AOT's: the parameters and the static-address tensors
        mutated = find_input_mutations(graph.graph)
        written = sorted(mutated - set(static))
        if written:
            names = [node.name for node in graph.graph.nodes if node.op == "placeholder"]
            self.uncaptured.append(", ".join(names[i] for i in written))
            log_cudagraph_skip_and_bump_counter(
                f"skipping cudagraphs of a stage pass that writes into inputs with no static address: "
                f"{self.uncaptured[-1]}"
            )
            return run
        if not self.capture:
            return run
        captured = cudagraphify(run, static, device_index=get_device_index(graph), stack_traces=get_stack_traces(graph),
                                is_backward=False, is_inference=True, placeholders=get_placeholder_info(graph.graph),
                                mutated_input_idxs=tuple(mutated))  # fmt: skip
        captured._boxed_call = True  # type: ignore[attr-defined]
        return captured


def compile_pass(run_segment, mode: str, backend: str, dynamic: bool | None, capture: bool):
    """``run_segment`` as ``torch.compile`` makes it one graph per pass kind for ``compile.mode`` ``mode``, captured
    where ``capture`` (a CUDA device): ``graphs`` by ``EagerKernelGraphs``, ``regional+graphs`` by Inductor
    (``backend``) with ``mode="reduce-overhead"`` (uncaptured, Inductor's graphs run as generated)."""
    if mode == "graphs":
        return torch.compile(run_segment, fullgraph=True, backend=EagerKernelGraphs(capture), dynamic=dynamic)
    return torch.compile(run_segment, fullgraph=True, backend=backend, mode="reduce-overhead" if capture else None,
                         dynamic=dynamic)  # fmt: skip


def _copied_out(values: dict, before: dict[Any, int]) -> None:
    """Replace each tensor of ``values`` that a pass put there (not the one it held before, by identity) with a copy."""
    for name, tensor in values.items():
        if before.get(name) != id(tensor):
            values[name] = tensor.clone()


class CapturedStage(StageWrapper):
    """``stage`` (a family's ``Stage``) with every pass after a request's first of its kind run by ``graph_pass``
    (``compile_pass`` of ``stage.run_segment``; module docstring). Counts ``eager_passes`` (a kind's first) and
    ``graph_passes`` (the others: through ``graph_pass``, which runs eagerly past ``compile.max_shapes``)."""

    REQUEST_STATE = ("_ran",)  # the pass kinds the request in flight has run (``xfuse.parallel.request_state``)

    def __init__(self, stage, graph_pass):
        super().__init__(stage)
        self.graph_pass = graph_pass
        self._ran: set[tuple] = set()
        self.eager_passes = self.graph_passes = 0

    def begin_request(self, grid: PatchGrid) -> None:
        self._ran = set()
        self.inner.begin_request(grid)

    def request_state_holders(self) -> tuple[object, ...]:
        return (*self.inner.request_state_holders(), self)

    def prepare_step(self, cond: Any) -> None:
        """Nothing: a family's per-step products (``prefetch_modulation``'s memo, keyed by a tensor's identity) are
        not what a graph reads (traced, it computes them in the pass), so making them ahead would be work thrown
        away; a request's eager passes compute theirs."""

    def run_segment(
        self,
        hidden: torch.Tensor,
        segment: Segment,
        cond: Any,
        band: PatchBand | None,
        skips: dict[int, torch.Tensor],
        keep_kv: bool = True,
        streams: dict[str, torch.Tensor] | None = None,
        *,
        controls: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The family's pass: eagerly the first time the request runs its kind, else its graph (the ``Stage``
        method's arguments)."""
        part = cond.part.index if cond.part is not None else None
        kind = (segment.blocks, None if band is None else band.index, part, keep_kv, tuple(streams or ()),
                controls is not None)  # fmt: skip
        extra = controls_kwarg(controls)
        if kind not in self._ran:
            self._ran.add(kind)
            self.eager_passes += 1
            return self.inner.run_segment(hidden, segment, cond, band, skips, keep_kv, streams, **extra)
        self.graph_passes += 1
        if not hidden.is_cuda:
            return self._graph(kind, hidden, segment, cond, band, skips, keep_kv, streams, **extra)
        torch.compiler.cudagraph_mark_step_begin()  # the previous passes' outputs were copied out
        held_skips = {block: id(tensor) for block, tensor in skips.items()}
        held_streams = {name: id(tensor) for name, tensor in (streams or {}).items()}
        out = self._graph(kind, hidden, segment, cond, band, skips, keep_kv, streams, **extra)
        _copied_out(skips, held_skips)
        if streams is not None:
            _copied_out(streams, held_streams)
        return out.clone()

    def _graph(self, kind: tuple, *args, **kwargs) -> torch.Tensor:
        """``graph_pass(*args, **kwargs)``; a pass that cannot be one graph (dynamo's ``Unsupported``: a graph
        break, which ``fullgraph`` refuses) is named, on every rank alike (the same code traced the same way)."""
        try:
            return self.graph_pass(*args, **kwargs)
        except Exception as exc:
            from torch._dynamo.exc import Unsupported

            if not isinstance(exc, Unsupported):
                raise
            blocks, patch, part, keep_kv, streams, controls = kind
            where = "the whole image" if patch is None else f"patch {patch}"
            raise RuntimeError(
                f"the stage pass of blocks {blocks[0]}-{blocks[-1]} over {where}"
                f"{'' if part is None else f' (batch part {part})'} is not one graph ({str(exc).splitlines()[0]}), "
                "as compile.mode graphs and regional+graphs need; use compile.mode regional or off for this model"
            ) from exc
