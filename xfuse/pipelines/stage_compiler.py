"""``compile.mode`` for one pipeline: what a rank compiles, when, for how long, and what it counts.

``StageCompiler`` compiles a rank's kept blocks in place (``regional``: ``xfuse.parallel.regional_compile``), or
runs the stage the engine drives through one graph per pass kind (``graphs``, ``regional+graphs``:
``xfuse.parallel.pass_graphs``), and frames every request:

* a request of a shape this engine has compiled runs its graphs;
* a request of a new shape, while fewer than ``compile.max_shapes`` shapes were compiled, compiles: its waits get the
  compile bound (``XfuseConfig.longest_wait_s``), ``CompileWatch`` times the compiles, publishes "compiling shape 2
  of 3 (1024x768) for 41 s" for the other ranks and ends the world past ``compile.timeout_s``; after it, one line on
  stderr: what it compiled, in how long, and how much came from ``compile.cache_dir``. In the graph modes a pass kind
  compiles at its second pass of a request: a request too short to reach one compiles nothing and leaves its shape
  new (``warm_up_compile`` runs the warm-up steps and two pipelined ones);
* a request of a further shape runs eagerly (``torch.compiler.set_stance("force_eager")``) and is counted. Every rank
  decides alike: the request's shape is the same everywhere, so no rank runs compiled beside an eager one.

The request shape is the engine's: the latents' shape and the patch grid (a rank's block inputs follow from it: the
whole image in warm-up steps, its patches after, the text's lengths).
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch

from xfuse.config import CompileConfig
from xfuse.parallel.pass_graphs import CapturedStage, compile_pass
from xfuse.parallel.regional_compile import compile_blocks
from xfuse.runtime.compile_cache import CompileCache
from xfuse.runtime.compile_watch import CompileWatch
from xfuse.stderr import write_stderr

__all__ = ["StageCompiler", "compile_counts"]

RECOMPILES_PER_SHAPE = 4  # graphs one code object may make per (request shape, block input size): see compile()
# a stage pass's graphs per (request shape, patch) over a block's: each of a rank's segments (two under step caching)
GRAPH_KINDS_PER_PATCH = 2


def compile_counts() -> dict[str, int]:
    """This process's compile counters from torch's own (0 before dynamo was imported): ``graphs`` dynamo made,
    ``generated`` graphs Inductor generated code for, ``cached`` graphs Inductor found in its caches,
    ``not_captured`` graphs a capturing backend left uncaptured (it logged why)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {"graphs": 0, "generated": 0, "cached": 0, "not_captured": 0}
    counters = utils.counters
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "generated": int(counters["inductor"]["fxgraph_cache_miss"]),
        # a graph AOT autograd's cache returns is looked up in the FX graph cache too: the larger count is the graphs
        "cached": int(max(counters["inductor"]["fxgraph_cache_hit"], counters["aot_autograd"]["autograd_cache_hit"])),
        "not_captured": int(counters["inductor"]["cudagraph_skips"]),
    }


class StageCompiler:
    """One pipeline's compile (module docstring).

    Args:
        section: the config's ``compile`` section.
        rank: this global rank (its lines and its watch name it).
        monitor: the process's failure monitor: publishes what this rank compiles, records a compile timeout.
        num_patches: the layout's patches (a request meets at most the whole image and its patches per block).
        cache: ``compile.cache_dir``'s folder for this launch, or ``None``.
        device: this rank's device (the graph modes capture on CUDA only: ``captures``).
    """

    def __init__(self, section: CompileConfig, rank: int, monitor, num_patches: int, cache: CompileCache | None,
                 device: torch.device):  # fmt: skip
        self.section, self.rank, self.num_patches, self.cache = section, rank, num_patches, cache
        self.captures = section.graphs and device.type == "cuda"  # CUDA graphs made (elsewhere: run as traced)
        doing = "compiling and capturing" if self.captures else "compiling"
        self.watch = CompileWatch(rank, section.timeout_s, on_timeout=monitor.fail_from_thread, doing=doing)
        monitor.activity_source = self.watch.activity
        self.shapes: dict[int, list[tuple]] = {}  # id(engine) -> the request shapes it compiled, in order
        self.eager_shapes: set[tuple] = set()  # (engine, shape) pairs past max_shapes, said once each
        self.eager_requests = 0  # requests that ran eagerly because their engine had max_shapes shapes
        self.label: str | None = None  # what the next compiling request is called (a warm-up's "shape 1 of 2 (..)")

    def compile(self, stage) -> None:
        """``regional``: compile ``stage``'s kept blocks in place; the graphs are made at the first request of each
        shape. The graph modes compile nothing in place (``engine_stage``)."""
        import torch._dynamo

        if self.cache is not None:
            self.cache.activate()
        # torch's own bound per code object (a block class's forward, and its resumes after each eager region) is a
        # backstop, not the bound: a request shape meets each of them with the whole image and every patch size, a
        # few in two memory layouts (a received buffer, a view); past max_shapes shapes this class runs requests
        # eagerly before torch's limit is reached.
        limit = self.section.max_shapes * RECOMPILES_PER_SHAPE * (self.num_patches + 1)
        if self.section.graphs:  # one code object, the family's run_segment, for every pass kind
            limit *= GRAPH_KINDS_PER_PATCH
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, limit)
        if not self.section.graphs:
            compile_blocks(stage, self.section.backend, self.section.dynamic)

    def engine_stage(self, stage):
        """The stage the engine drives: ``stage`` itself (``regional``), or ``stage`` with each pass after a request's
        first of its kind run as one graph (the graph modes: ``CapturedStage``)."""
        if not self.section.graphs:
            return stage
        section = self.section
        graph_pass = compile_pass(stage.run_segment, section.mode, section.backend, section.dynamic, self.captures)
        return CapturedStage(stage, graph_pass)

    @contextlib.contextmanager
    def request(self, engine, shape: tuple, bounds: contextlib.AbstractContextManager, describe: str):
        """Frame one request of ``engine`` whose shape is ``shape`` (``describe`` says it for the lines);
        ``bounds``: the compiling request's wait bounds, entered only when it compiles."""
        compiled = self.shapes.setdefault(id(engine), [])
        if shape in compiled:
            yield
            return
        if len(compiled) >= self.section.max_shapes:
            self.eager_requests += 1
            if (id(engine), shape) not in self.eager_shapes:
                self.eager_shapes.add((id(engine), shape))
                write_stderr(f"rank {self.rank}: compile.max_shapes = {self.section.max_shapes} shapes compiled; "
                             f"{describe} runs eagerly on every rank (an eager request each time)")  # fmt: skip
            with torch.compiler.set_stance("force_eager"):
                yield
            return
        label = self.label or f"request shape {len(compiled) + 1} of at most {self.section.max_shapes} ({describe})"
        before, start = compile_counts(), time.monotonic()
        with bounds, self.watch.request(label):
            yield
            spent = self.watch.compiling_s()
        after = compile_counts()
        made = after["graphs"] - before["graphs"]
        if self.section.graphs and not made:  # too short to reach a graph pass (a pass kind's second): not compiled
            return
        compiled.append(shape)
        where = ""
        if self.cache is not None:
            self.cache.record(describe)
            cached, generated = after["cached"] - before["cached"], after["generated"] - before["generated"]
            where = f", {cached} from compile.cache_dir, {generated} generated"
        if self.captures:
            where += f", {after['not_captured'] - before['not_captured']} not captured (torch's log says why)"
        write_stderr(f"rank {self.rank}: compile.mode {self.section.mode}: {label}: {made} graph(s){where} in "
                     f"{spent:.1f} s of compiling; its denoising took {time.monotonic() - start:.1f} s")  # fmt: skip
