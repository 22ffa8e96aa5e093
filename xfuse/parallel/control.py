"""ControlNet residuals under PipeFusion: which block takes which residual, and which ranks they travel to.

A ControlNet (diffusers' ``SD3ControlNetModel``, ``FluxControlNetModel``) is a copy of the first blocks of the
transformer that reads the control image beside the latents; after each of its blocks a zero-initialised linear layer
gives a residual, scaled by the call's ``conditioning_scale``, and the transformer adds residual ``i`` to the image
stream after each block that maps to ``i`` (its forward's ``interval_control`` rule, given here as data by the
family's adapter: ``block_samples``).

Where it runs: on the embedding rank, with each hop-0 task (per patch and step, or per whole-image pass), since that
rank holds the patch's model input already and the control model's K/V, like the transformer's, go stale per patch
(``xfuse.families.common.control``). Each other rank that holds a controlled block gets the residuals its blocks use,
stacked in one ``control`` message with the patch (``xfuse.parallel.schedule``), received by its first segment of
that patch. The engine, schedule and comm layer know residuals only by block and sample index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from xfuse.parallel.stage_plan import StagePlan

if TYPE_CHECKING:  # the planner and the performance model read this module without torch
    import torch

    from xfuse.parallel.patch_grid import PatchBand, PatchGrid
    from xfuse.parallel.stage import BatchPart

    # (step, transformer input rows (B, C, h, W), band or None, batch part or None, keep_kv) -> every residual
    # (B, band tokens, hidden), indexed by sample
    ComputeResiduals = Callable[[int, torch.Tensor, PatchBand | None, BatchPart | None, bool], list[torch.Tensor]]


@dataclass
class ControlResiduals:
    """A request's ControlNet residuals, as the engine routes them.

    Attributes:
        block_samples: transformer block -> index of the residual added to its image output (blocks without one
            are absent: SD3's last block, which updates no image stream after it).
        num_samples: residuals the control model gives per pass.
        compute: on the embedding rank, the control model's pass over a hop-0 task (see ``ComputeResiduals``);
            ``None`` on the other ranks, which only receive.
        begin_request: on the embedding rank, called with the request's grid before its first task (the control
            model forgets the previous request's K/V).
    """

    block_samples: dict[int, int]
    num_samples: int
    compute: ComputeResiduals | None = None
    begin_request: Callable[[PatchGrid], None] | None = None

    def samples_of(self, blocks: Iterable[int]) -> tuple[int, ...]:
        """The residuals ``blocks`` use, in sample order, each once (an interval > 1 shares one over blocks)."""
        return tuple(sorted({self.block_samples[b] for b in blocks if b in self.block_samples}))

    def ranks(self, plan: StagePlan) -> tuple[int, ...]:
        """The ranks other than the embedding rank that hold a controlled block (each gets a ``control`` message)."""
        return tuple(r for r in range(plan.degree) if r != plan.embed_rank and self.samples_of(plan.blocks_of(r)))

    def counts(self, plan: StagePlan) -> dict[int, int]:
        """The residuals each rank other than the embedding rank receives per pass (``comm_volume``'s input)."""
        return {rank: len(self.samples_of(plan.blocks_of(rank))) for rank in self.ranks(plan)}


def interval_samples(
    blocks: Iterable[int], first: int, count: int, samples: int, offset: int = 0, *, ceil: bool
) -> dict[int, int]:
    """``block_samples`` of one list of transformer blocks (global indices ``first …``, ``count`` of them in the
    list) for ``samples`` residuals numbered from ``offset``, by diffusers' rule: ``interval = count / samples``
    (``ceil``: rounded up, FLUX; else a float, SD3) and block ``i`` of the list takes ``int(i / interval)``.
    ``blocks``: the blocks of the list that take one."""
    if samples == 0:
        return {}
    interval = -(-count // samples) if ceil else count / samples
    return {block: offset + int((block - first) / interval) for block in blocks}


def control_split(num_blocks: int, degree: int, control_blocks: int) -> list[int]:
    """Blocks per rank of a linear plan whose embedding rank (0) also runs a ControlNet of ``control_blocks`` blocks,
    a ControlNet block costing what a transformer block costs (the same block class on the same tokens): the split
    whose busiest rank runs the fewest blocks, at least one transformer block per rank; among equals rank 0 the
    fewest (the control model's residual layers and messages are its extra)."""
    if not 1 < degree <= num_blocks:
        raise ValueError(f"need 1 < degree <= num_blocks (got {degree}, {num_blocks})")
    best: tuple[int, list[int]] | None = None
    for first in range(1, num_blocks - degree + 2):
        base, extra = divmod(num_blocks - first, degree - 1)
        others = [base + (1 if i < extra else 0) for i in range(degree - 1)]
        load = max(first + control_blocks, *others)
        if best is None or load < best[0]:
            best = (load, [first, *others])
    assert best is not None
    return best[1]
