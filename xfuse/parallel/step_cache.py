"""Step caching inside the PipeFusion engine: First-Block Cache, and a TaylorSeer-style prediction of the cached
residual, with one skip-or-compute decision per step that every rank of a pipeline group takes alike.

The semantics (``tests/support/pipefusion_oracle.py`` implements them independently):

* **The decision.** Block 0 always runs. When the step's first task (patch 0; the whole image in a whole-image step)
  has passed it on the embedding rank, the step is skipped if the mean absolute change of block 0's residual
  (output - input) over that task's tokens, relative to the mean absolute value of the same tokens' residual at the
  last computed step, is at most ``cache.threshold`` (diffusers' ``FBCHeadBlockHook``); always computed before
  ``cache.warmup_steps``, at the first pipelined step (see below), before any step was computed, and after
  ``cache.max_skips`` skipped steps in a row.
* **It travels with the step.** The first task's hand-offs carry it (a one-element ``cache`` message beside the
  hidden state); every segment sees a step's patches in order, the first first, so every later task of the step on
  every rank takes the same branch, with no extra round trip. The schedule (every message) is the same either way:
  a wrong decision cannot deadlock, and the ranks' decisions are compared after the loop (``check_decisions``).
* **A computed segment** stores its residual at its tokens (and, for the step's first patch, the residual of the
  plan's streams, an MMDiT's text). **A skipped segment** adds the stored residual instead of running its blocks
  (``taylor``: extrapolated to first order from the last two computed steps); the sum over a route's segments is the
  whole tail residual diffusers adds after block 0. A skipped block that produces a long skip passes its input on,
  as diffusers' pass-through hook does (its skipped consumer ignores it).
* **Stale K/V.** A skipped segment writes no K/V: the other patches of later steps attend to its blocks' K/V as
  of the last computed step (block 0's are always fresh). Whole-image steps store their K/V whenever computed, so a
  skipped last warm-up step leaves the last computed step's.
* **Sequence parallelism.** A rank of an SP group holds a chunk of every pass's tokens. The decision sums the
  changes over the group's chunks (``Stage.group_sum``), so the group decides on the whole task. Residuals are kept
  at their tokens' positions in the image; a rank's chunk of the whole image is not its chunks of the patches, so
  the first pipelined step (where passes turn from the whole image to patches) is always computed, and ``taylor``
  does not extrapolate across it (it adds the newer residual). The rule holds for every layout: one semantics.
* With caching, whole-image steps are not split in batch parts: the decision is then on the whole transformer batch
  ([uncond, cond] with CFG batched), as diffusers decides on one batched call. With ``cfg_degree: 2`` each CFG group
  decides on its half, as diffusers decides per ``cache_context`` where a pipeline makes two calls (FLUX, Wan).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import torch

from xfuse.config import CacheConfig
from xfuse.parallel.schedule import Task
from xfuse.parallel.stage import Stage
from xfuse.parallel.stage_plan import Segment, StagePlan


@dataclass
class _Residuals:
    """A segment's residuals at its last one or two computed steps (newest last), each at every token this rank
    holds: written patch by patch, read where a skipped step's patch needs them."""

    steps: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # (B_model, tokens held, D) each
    streams: list[dict[str, torch.Tensor]] = field(default_factory=list)  # the step's first patch's stream residuals


class StepCache:
    """One request's caching state on one rank (``xfuse.parallel.request_run`` drives it)."""

    def __init__(self, config: CacheConfig, num_tokens: int, first_pipelined: int | None = None):
        # Residuals are kept at their positions in the image (``num_tokens``: the whole image's): under sequence
        # parallelism a rank writes and reads only its chunks, whose positions differ between whole-image and patch
        # passes. ``first_pipelined``: the step where passes turn from the whole image to patches (always computed).
        self.config, self.num_tokens, self.first_pipelined = config, num_tokens, first_pipelined
        self.decisions: dict[int, bool] = {}  # step -> computed (True) or skipped
        self.skipped_in_row = 0
        self.head: torch.Tensor | None = None  # block 0's residual at the last computed step (embedding rank)
        self.segments: dict[int, _Residuals] = {}  # hop -> its residuals

    # --- the decision (embedding rank) and its arrival elsewhere -------------------------------------------------
    def decide(
        self,
        step: int,
        residual: torch.Tensor,
        tokens: slice,
        group_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> bool:
        """The step's decision from its first task's block-0 ``residual`` (B, n, D) at ``tokens``; True: compute.
        ``group_sum`` (``Stage.group_sum``) totals the sums over the ranks that share the task's tokens (an SP group:
        each holds a chunk), so they all take one decision on the whole task's tokens.
        Mirrors ``diffusers.hooks.first_block_cache.FBCHeadBlockHook._should_compute_remaining_blocks``."""
        cfg = self.config
        limited = cfg.max_skips is not None and self.skipped_in_row >= cfg.max_skips
        if step < cfg.warmup_steps or step == self.first_pipelined or self.head is None or limited:
            compute = True
        else:
            previous = self.head[:, tokens]
            # in float32: a half-precision sum over a whole patch's elements overflows (fp16 ends at 65504)
            diff, prev = (residual - previous).abs().sum(dtype=torch.float32), previous.abs().sum(dtype=torch.float32)
            sums = torch.stack((diff, prev))  # (2,)
            if group_sum is not None:
                sums = group_sum(sums)
            change, scale = sums  # diffusers' ratio of two means over the same tokens: the ratio of their sums
            compute = (change / scale).item() > cfg.threshold
        self.note(step, compute)
        return compute

    def note(self, step: int, compute: bool) -> None:
        """Record ``step``'s decision (taken here, or received with its first task)."""
        self.decisions[step] = compute
        self.skipped_in_row = 0 if compute else self.skipped_in_row + 1

    def keep_head(self, residual: torch.Tensor, tokens: slice) -> None:
        """A computed step's block-0 residual at ``tokens``: what the next decision compares against."""
        if self.head is None:
            self.head = residual.new_zeros(residual.shape[0], self.num_tokens, residual.shape[2])
        self.head[:, tokens] = residual

    # --- segments ---------------------------------------------------------------------------------------------
    def store(self, hop: int, step: int, tokens: slice, residual: torch.Tensor, streams: dict[str, torch.Tensor]):
        """A computed segment's residual (B, n, D) at ``tokens`` (and its stream residuals, the first patch's)."""
        entry = self.segments.setdefault(hop, _Residuals())
        if not entry.steps or entry.steps[-1] != step:  # the step's first patch on this segment: a new newest
            keep = 2 if self.config.method == "taylor" else 1
            if len(entry.steps) == keep:  # the oldest step goes; its buffer takes the newest
                entry.steps.pop(0)
                entry.streams.pop(0)
                buffer = entry.hidden.pop(0)
            else:
                buffer = residual.new_zeros(residual.shape[0], self.num_tokens, residual.shape[2])
            entry.steps.append(step)
            entry.hidden.append(buffer)
            entry.streams.append({})
        entry.hidden[-1][:, tokens] = residual
        entry.streams[-1].update(streams)

    def residual(self, hop: int, step: int, tokens: slice) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """What a skipped segment adds at ``tokens`` on ``step``: its last computed residual, or (``taylor``, two
        computed steps a > b) ``r_a + (r_a - r_b) * (step - a) / (a - b)``; and the same for its streams."""
        entry = self.segments[hop]
        newest, streams = entry.hidden[-1][:, tokens], entry.streams[-1]
        if self.config.method != "taylor" or len(entry.steps) < 2 or self._across_the_turn(*entry.steps):
            return newest, streams
        (b, a), older = entry.steps, entry.hidden[0][:, tokens]
        ratio = (step - a) / (a - b)
        predicted = {k: v + (v - entry.streams[0][k]) * ratio for k, v in streams.items() if k in entry.streams[0]}
        return newest + (newest - older) * ratio, predicted

    def _across_the_turn(self, older: int, newer: int) -> bool:
        """Whether two computed steps straddle the first pipelined step: the older one's residuals were written by
        whole-image passes, which under sequence parallelism put a rank's tokens elsewhere than its patch passes do,
        so ``taylor`` does not extrapolate from them (it adds the newer one's, as ``first_block`` does)."""
        return self.first_pipelined is not None and older < self.first_pipelined <= newer


def first_pipelined_step(num_steps: int, warmup_steps: int, num_patches: int) -> int | None:
    """The step where passes turn from the whole image to patches, which ``StepCache`` always computes; ``None`` when
    no step runs in patches (one patch, or warm-up = all steps)."""
    return warmup_steps if num_patches > 1 and warmup_steps < num_steps else None


def always_computed(config: CacheConfig, num_steps: int, warmup_steps: int, num_patches: int) -> list[int]:
    """The steps ``StepCache.decide`` computes whatever block 0 says: step 0 (nothing to compare with), those before
    ``cache.warmup_steps``, and the first pipelined step."""
    steps = set(range(min(num_steps, max(config.warmup_steps, 1))))
    first = first_pipelined_step(num_steps, warmup_steps, num_patches)
    return sorted(steps if first is None else steps | {first})


def most_skipped(config: CacheConfig, num_steps: int, always: list[int]) -> int:
    """How many steps can be skipped at most: the runs between the always-computed steps, each with a computed step
    after every ``cache.max_skips`` skipped ones (S S C S S C ...)."""
    most = 0
    for run in (b - a - 1 for a, b in pairwise([*always, num_steps])):
        most += run if config.max_skips is None else run - run // (config.max_skips + 1)
    return most


def check_decisions(per_rank: list[tuple[int, list[bool]]]) -> None:
    """Raise naming the first step whose decision two ranks of one pipeline group took differently: ``per_rank`` is
    every global rank's (its CFG group, its decisions by step). CFG groups decide on their own halves."""
    groups: dict[int, list[tuple[int, list[bool]]]] = {}
    for rank, (group, decisions) in enumerate(per_rank):
        groups.setdefault(group, []).append((rank, decisions))
    for group, members in groups.items():
        first_rank, reference = members[0]
        for rank, decisions in members[1:]:
            for step, (a, b) in enumerate(zip(reference, decisions, strict=True)):
                if a != b:
                    what = {True: "computed", False: "skipped"}
                    raise RuntimeError(
                        f"step cache: the ranks of pipeline group {group} took different decisions at step {step}: "
                        f"rank {first_rank} {what[a]} it, rank {rank} {what[b]} it; every rank of a group must "
                        "take the decision its first task carries"
                    )


class CachedSegments:
    """A rank's segments under step caching, as the engine runs them (the rules in the module docstring): the stage's
    blocks run, or skipped with the cached residual added, one decision per step."""

    def __init__(self, cache: StepCache, stage: Stage, plan: StagePlan, pipe_rank: int):
        self.cache, self.stage, self.plan, self.pipe_rank = cache, stage, plan, pipe_rank

    def run(self, task: Task, hidden, cond, band, skips, keep_kv, streams, flag) -> torch.Tensor:
        """The task's segment: block 0 always runs and, on the step's first task, decides; the rest of the segment
        runs and stores its residual, or is skipped and adds it. ``flag``: the step's decision, received with its
        first task (ranks without block 0)."""
        cache, step = self.cache, task.step
        segment = self.plan.route[task.hop]
        tokens = self.stage.hidden_tokens(band)
        blocks = segment.blocks
        if task.hop == 0:
            before = hidden
            hidden = self.stage.run_segment(hidden, Segment(0, segment.rank, blocks[:1]), cond, band, skips,
                                            keep_kv, streams)  # fmt: skip
            first = step not in cache.decisions  # the step's first task decides
            if first or cache.decisions[step]:  # a skipped step's later patches need no residual of block 0
                residual = hidden - before  # (B, n, D)
                if first:
                    cache.decide(step, residual, tokens, self.stage.group_sum)
                if cache.decisions[step]:
                    cache.keep_head(residual, tokens)
            blocks = blocks[1:]
        elif step not in cache.decisions:  # the step's first task here: its decision came with it
            assert flag, f"step {step}: the first task on pipeline rank {self.pipe_rank} came without its decision"
            ((_, value),) = flag
            cache.note(step, bool(value.item()))
        if not blocks:
            return hidden
        rest = Segment(task.hop, segment.rank, blocks)
        if cache.decisions[step]:
            before, streams_before = hidden, dict(streams)
            hidden = self.stage.run_segment(hidden, rest, cond, band, skips, keep_kv, streams)
            changed = {k: streams[k] - v for k, v in streams_before.items() if k in streams}
            cache.store(task.hop, step, tokens, hidden - before, changed)
            return hidden
        return self._skip(task, hidden, rest, tokens, skips, streams)

    def _skip(self, task: Task, hidden, rest: Segment, tokens: slice, skips, streams) -> torch.Tensor:
        """A skipped segment: its cached residual added, no block run (no K/V written); a long skip produced in it
        passes its input on, one consumed in it is dropped (its consumer is skipped too)."""
        residual, stream_residuals = self.cache.residual(task.hop, task.step, tokens)
        for edge in self.plan.skips:
            if edge.producer in rest.blocks and edge.consumer not in rest.blocks:
                skips[edge.producer] = hidden
            elif edge.consumer in rest.blocks and edge.producer not in rest.blocks:
                skips.pop(edge.producer, None)
        for kind, change in stream_residuals.items():
            if kind in streams:
                streams[kind] = streams[kind] + change
        return hidden + residual
