"""The model boundary: what the engine calls on one rank's share of a model (a family's adapter implements it).

The engine knows blocks only by index (a ``Segment``), patches only as row bands (a ``PatchBand``) and the model's
per-step conditioning only as an opaque object the request builds. Everything a family does differently (text,
positions, modulation, long skips, unpatchify) stays behind these methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from xfuse.parallel.patch_grid import PatchBand, PatchGrid
from xfuse.parallel.stage_plan import Segment


@dataclass(frozen=True)
class BatchPart:
    """Part ``index`` of ``count`` equal parts of a transformer batch: rows ``index * size … (index + 1) * size``.

    The engine streams a whole-image step through the route in batch parts (``xfuse.parallel.schedule.batch_parts``):
    the rows of a batch never attend to each other, so each part is exact on its own.
    """

    index: int
    count: int
    size: int  # rows per part

    @property
    def rows(self) -> slice:
        return slice(self.index * self.size, (self.index + 1) * self.size)

    @property
    def model_batch(self) -> int:
        return self.count * self.size


@runtime_checkable
class Stage(Protocol):
    """One pipeline rank's blocks of a diffusers transformer, run on the whole image or on one patch."""

    hidden_size: int  # width of the hidden states that travel between ranks

    def begin_request(self, grid: PatchGrid) -> None:
        """Start a request on the image ``grid`` describes: forget every K/V and per-request cache."""

    def request_state_holders(self) -> tuple[object, ...]:
        """The objects that keep the state of the request in flight, each naming its attributes in a
        ``REQUEST_STATE`` tuple: what the engine switches between requests of a stream
        (``xfuse.parallel.request_state``)."""

    def begin_task(self, step: int, patch: int | None) -> None:
        """The engine is about to compute a task of (step, patch) (``None``: a whole-image step)."""

    def prepare_step(self, cond: Any) -> None:
        """Per-step model work done ahead: called with a pipelined step's conditioning once this rank's last task of
        the step before has sent its messages, so that the step's first patch does not carry it."""

    def hidden_tokens(self, band: PatchBand | None) -> slice:
        """Positions in the image of the hidden states this rank holds for ``band`` (``None``: the whole image):
        the band's tokens, or under sequence parallelism this rank's chunk of them."""

    def stream_shape(self, kind: str, shape: tuple) -> tuple:
        """The shape this rank holds of the plan's stream ``kind`` whose whole shape is ``shape`` (B, T, ...): all of
        it, or under sequence parallelism its chunk of the tokens."""

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a few elements) summed over the ranks that share each pass's tokens: the same bits on each of
        them under sequence parallelism (its SP group), ``values`` itself otherwise."""

    def batch_part(self, cond: Any, part: BatchPart) -> Any:
        """The conditioning of ``part``'s rows of the transformer batch: ``cond`` with every batch-indexed tensor
        sliced. Passes run with it are whole-image passes on those rows only (their K/V go into those rows)."""

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C, rows, W) model-input latent rows covering ``band`` (``None``: the whole image) -> (B, band tokens,
        hidden): the covering rows embedded, the band's own tokens kept (``PatchBand.trim``).

        Position information is that of the band's rows in the whole image, never recomputed for the band's size.
        """

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
        """Run ``segment``'s blocks on (B, tokens, hidden). ``skips`` maps a long-skip producer block to its output
        for this patch (producers add, consumers pop). ``keep_kv=False``: a whole-image pass whose K/V no patch
        will read. ``streams``: the plan's streams (an MMDiT's text) that the step's first patch and a whole-image
        pass carry: the segment reads its inputs from it (none at the first segment) and replaces them with its
        outputs; empty for the other patches, which reuse what the first patch left (its text K/V).
        ``controls``: block -> the ControlNet residual (B, tokens, hidden) added to its image output
        (``xfuse.parallel.control``); the engine passes it only with a ControlNet, to the families that take one."""

    def head(self, hidden: torch.Tensor, cond: Any, token_cols: int, band: PatchBand | None = None) -> torch.Tensor:
        """(B, band tokens, hidden) -> the transformer's output (B, C_out, rows, W) for the rows covering ``band``
        (``None``: whole rows), zeros at the other bands' tokens of a partial row (``PatchBand.pad``)."""


def controls_kwarg(controls: dict[int, torch.Tensor] | None) -> dict[str, Any]:
    """``run_segment``'s ``controls=`` as a keyword to pass on: none without a ControlNet (the families without a
    ControlNet pipeline take no ``controls``)."""
    return {} if controls is None else {"controls": controls}


class StageWrapper:
    """A ``Stage`` applied from outside around another (``inner``): every method is the inner stage's unless the
    wrapper changes it (``xfuse.parallel.sequence_stage``: a rank's token chunks; ``xfuse.parallel.pass_graphs``:
    captured passes)."""

    def __init__(self, inner: Stage):
        self.inner = inner
        self.hidden_size = inner.hidden_size

    def begin_request(self, grid: PatchGrid) -> None:
        self.inner.begin_request(grid)

    def request_state_holders(self) -> tuple[object, ...]:
        return self.inner.request_state_holders()

    def begin_task(self, step: int, patch: int | None) -> None:
        self.inner.begin_task(step, patch)

    def prepare_step(self, cond: Any) -> None:
        self.inner.prepare_step(cond)

    def hidden_tokens(self, band: PatchBand | None) -> slice:
        return self.inner.hidden_tokens(band)

    def stream_shape(self, kind: str, shape: tuple) -> tuple:
        return self.inner.stream_shape(kind, shape)

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        return self.inner.group_sum(values)

    def batch_part(self, cond: Any, part: BatchPart) -> Any:
        return self.inner.batch_part(cond, part)

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        return self.inner.embed(latent_rows, band)

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
        return self.inner.run_segment(hidden, segment, cond, band, skips, keep_kv, streams, **controls_kwarg(controls))

    def head(self, hidden: torch.Tensor, cond: Any, token_cols: int, band: PatchBand | None = None) -> torch.Tensor:
        return self.inner.head(hidden, cond, token_cols, band)
