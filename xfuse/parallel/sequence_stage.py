"""A family's stage run by one rank of a sequence-parallel group (Ulysses and/or Ring), applied from outside.

The engine drives it like any ``Stage``; the ranks of an SP group run the same program on the same tasks, each on its
chunk of every pass's tokens (``xfuse.parallel.sequence``), and hand their chunks to the same SP index of the next
pipeline rank. This wrapper adds the three places where a chunk meets the whole:

* ``embed``: the family embeds the band's whole rows (positions are the rows' own), the rank keeps its chunk;
* the attention: the stage's ``PassAttention`` gets the group (every processor goes through it);
* ``head``: the chunks are gathered in token order, and every rank of the group runs the output layer on the whole
  band, so each holds the same model output and steps the same latents (no rank waits for another's scheduler).
"""

from __future__ import annotations

from typing import Any

import torch

from xfuse.parallel.patch_grid import PatchBand, PatchGrid, check_sequence_chunks
from xfuse.parallel.sequence import SequenceParallel
from xfuse.parallel.stage import StageWrapper, controls_kwarg
from xfuse.parallel.stage_plan import Segment


class SequenceParallelStage(StageWrapper):
    """``stage`` (a family's ``Stage``, built for this rank's pipeline rank) on this rank's token chunks."""

    def __init__(self, stage, sequence: SequenceParallel):
        super().__init__(stage)
        self.sequence = sequence
        stage.attention.sequence = sequence
        self._num_tokens = 0

    def _tokens(self, band: PatchBand | None) -> slice:
        return slice(0, self._num_tokens) if band is None else band.tokens

    def begin_request(self, grid: PatchGrid) -> None:
        """Start a request; refuses a grid whose smallest patch (cut by cost) has fewer tokens than the group."""
        check_sequence_chunks(grid, self.sequence.ulysses, self.sequence.ring)
        self._num_tokens = grid.num_tokens
        self.inner.begin_request(grid)

    def request_state_holders(self) -> tuple[object, ...]:
        raise ValueError(
            "a stream of several requests does not run under sequence parallelism (its exchanges are learnt per "
            "request): run them one at a time, or with parallel.ulysses_degree and parallel.ring_degree 1"
        )

    def begin_task(self, step: int, patch: int | None) -> None:
        self.sequence.begin_task(step, patch)
        self.inner.begin_task(step, patch)

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        return self.sequence.all_sum(values)

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C, rows, W) -> (B, my chunk's tokens, hidden): the band embedded whole, this rank's chunk kept."""
        whole = self.inner.embed(latent_rows, band)  # (B, band tokens, hidden)
        tokens = self._tokens(band)
        mine = self.sequence.local(tokens)
        return whole[:, mine.start - tokens.start : mine.stop - tokens.start]

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
        self.sequence.begin_pass(self._tokens(band), segment.blocks)
        out = self.inner.run_segment(hidden, segment, cond, band, skips, keep_kv, streams, **controls_kwarg(controls))
        self.sequence.end_pass()
        return out

    def head(self, hidden: torch.Tensor, cond: Any, token_cols: int, band: PatchBand | None = None) -> torch.Tensor:
        """(B, my chunk's tokens, hidden) -> the model output of the whole band, on every rank of the group."""
        return self.inner.head(self.sequence.gather_tokens(hidden, self._tokens(band)), cond, token_cols, band)
