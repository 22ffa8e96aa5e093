"""One rank's share of a request's ControlNet residuals (``xfuse.parallel.control``), fixed for the request.

Each rank whose blocks add residuals gets, with each patch, the residuals those blocks use stacked in one ``control``
message (in ``samples[rank]`` order). This rank keeps its residuals of a unit (step, patch, batch part) by block until
the segment running that block adds them: from the control model's pass on the embedding rank, else from the received
stack. A received buffer is reused after its task, so a residual that a later segment of this rank adds is copied,
once however many blocks share it.
"""

from __future__ import annotations

import torch

from xfuse.parallel.control import ControlResiduals
from xfuse.parallel.stage_plan import StagePlan


class ControlRouting:
    def __init__(self, control: ControlResiduals, plan: StagePlan, rank: int, first_blocks: tuple[int, ...]):
        # the residuals each rank's blocks use, in the order its ``control`` message stacks them
        self.samples = {r: control.samples_of(plan.blocks_of(r)) for r in range(plan.degree)}
        used = self.samples[rank]
        # this rank's controlled blocks: (block, residual, its index in the message, whether a later segment runs it)
        self.blocks = [
            (block, sample, used.index(sample), block not in first_blocks)
            for block in plan.blocks_of(rank)
            if (sample := control.block_samples.get(block)) is not None
        ]
        self.kept: dict[tuple, dict[int, torch.Tensor]] = {}  # (step, patch, part) -> block -> its residual

    def keep(self, key: tuple, residuals: list[torch.Tensor] | None = None, received=None) -> None:
        """Keep this rank's residuals of unit ``key`` by block: from the control model's ``residuals`` (indexed by
        residual), else from the ``received`` stack (indexed as ``samples``)."""
        kept: dict[int, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}  # residual -> its copy
        for block, sample, index, later in self.blocks:
            if residuals is not None:
                kept[block] = residuals[sample]
            elif later:
                kept[block] = copies.setdefault(sample, received[index].clone())
            else:
                kept[block] = received[index]
        if kept:
            self.kept[key] = kept

    def take(self, key: tuple, blocks: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """The residuals of unit ``key`` that ``blocks`` add, no longer kept."""
        kept = self.kept.get(key, {})
        taken = {b: kept.pop(b) for b in blocks if b in kept}
        if not kept:
            self.kept.pop(key, None)
        return taken

    def message(self, residuals: list[torch.Tensor], dst: int) -> torch.Tensor:
        """The ``control`` message to pipeline rank ``dst``: (its residuals, B, tokens, hidden), stacked."""
        return torch.stack([residuals[i] for i in self.samples[dst]])
