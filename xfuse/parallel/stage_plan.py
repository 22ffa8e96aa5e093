"""Which transformer blocks each rank runs, in what order, and where the model's long skips go.

A model is B blocks run in order, plus optional long skips: (producer, consumer) pairs where the output of an early
block is also an input of a later one (HunyuanDiT: block ``k`` feeds block ``B-1-k``; most DiTs have none). The
skips come from the model family's spec; the planner knows no model. Blocks ``j`` and ``B-1-j`` are "mirrors".

Two placements (DESIGN.md §3):

* ``linear`` — rank r holds a contiguous run of blocks (xDiT's split, generalised to any degree and split). A patch
  visits ranks 0 → N-1 once; a skip whose producer and consumer live on different ranks is a cross-rank transfer,
  and the last rank (which owns the output layer) hands the stepped latent back to rank 0.
* ``folded`` — the first half of the blocks is cut into N chunks; chunk r and its mirror live on rank r. A patch
  visits 0 → N-1 and back N-1 → 0, so every mirror-pair skip stays on one rank and rank 0 owns both ends of the
  model. Without long skips it only doubles the hand-offs.

Everything here is pure: no torch, no processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xfuse.errors import ConfigError

PLACEMENTS = ("folded", "linear")


@dataclass(frozen=True)
class Segment:
    """Consecutive blocks one rank runs on a patch before handing it on. ``hop`` is its position on the route."""

    hop: int
    rank: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class SkipEdge:
    """A long skip: the output of block ``producer`` is an input of block ``consumer``."""

    producer: int
    consumer: int
    src_rank: int
    dst_rank: int

    @property
    def crosses_ranks(self) -> bool:
        return self.src_rank != self.dst_rank


@dataclass(frozen=True)
class Handoff:
    """The hidden state leaves ``src_rank`` after segment ``after_hop`` and enters ``dst_rank``."""

    after_hop: int
    src_rank: int
    dst_rank: int


@dataclass(frozen=True)
class StagePlan:
    """The route of one patch through the ranks, and the long skips of the model on that route."""

    num_layers: int
    degree: int
    placement: str
    route: tuple[Segment, ...]
    skips: tuple[SkipEdge, ...]
    # Hand-off tensors besides the hidden state that only a step's first patch (and a whole-image pass) carries:
    # an MMDiT's text stream, whose update patch 0 owns (later patches reuse its text K/V and carry no text).
    streams: tuple[str, ...] = ()

    @property
    def embed_rank(self) -> int:
        """Rank that runs patch embedding (the first segment's rank)."""
        return self.route[0].rank

    @property
    def output_rank(self) -> int:
        """Rank that runs the output layer and the scheduler step (the last segment's rank)."""
        return self.route[-1].rank

    def blocks_of(self, rank: int) -> tuple[int, ...]:
        """Global indices of the blocks ``rank`` keeps, ascending."""
        return tuple(sorted(b for seg in self.route if seg.rank == rank for b in seg.blocks))

    def segments_of(self, rank: int) -> tuple[Segment, ...]:
        """The route segments ``rank`` runs, in route order."""
        return tuple(seg for seg in self.route if seg.rank == rank)

    @property
    def handoffs(self) -> tuple[Handoff, ...]:
        """Hidden-state transfers along the route (consecutive segments on different ranks)."""
        return tuple(Handoff(a.hop, a.rank, b.rank) for a, b in zip(self.route, self.route[1:]) if a.rank != b.rank)

    @property
    def cross_rank_skips(self) -> tuple[SkipEdge, ...]:
        return tuple(s for s in self.skips if s.crosses_ranks)

    def rank_of_block(self, block: int) -> int:
        for seg in self.route:
            if block in seg.blocks:
                return seg.rank
        raise KeyError(block)


def _even_split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _check_split(split: Sequence[int] | None, degree: int, total: int, what: str) -> list[int]:
    if split is None:
        return _even_split(total, degree)
    split = list(split)
    if (
        len(split) != degree
        or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in split)
        or (sum(split) != total)
    ):
        raise ConfigError(
            "parallel.stage_split",
            f"must list {degree} positive block counts (one per rank) summing to {total}, {what} (got {split!r})",
        )
    return split


def stage_plan(
    num_layers: int,
    degree: int,
    placement: str,
    stage_split: Sequence[int] | None = None,
    *,
    skips: Sequence[tuple[int, int]] = (),
    streams: Sequence[str] = (),
) -> StagePlan:
    """Plan which blocks each of ``degree`` ranks runs.

    Args:
        num_layers: number of transformer blocks (even for ``folded``, which pairs block j with block B-1-j).
        degree: number of pipeline ranks (PipeFusion degree).
        placement: ``"folded"`` or ``"linear"``.
        stage_split: optional block counts per rank. Folded: sizes of the N first-half chunks (sum = B/2; each
            rank also runs the mirror chunk). Linear: blocks per rank (sum = B).
        skips: the model's long skips as (producer, consumer) block pairs (its spec's ``skip_pairs``).
        streams: names of the hand-off tensors the first patch of a step carries besides the hidden state (its
            spec's ``streams``; e.g. ``("text",)``).

    Raises:
        ConfigError: naming ``model``, ``parallel.placement``, ``parallel.pipefusion_degree`` or
            ``parallel.stage_split``.
    """
    if placement not in PLACEMENTS:
        raise ConfigError("parallel.placement", f"must be one of {', '.join(PLACEMENTS)} (got {placement!r})")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError("model", f"must have at least one transformer block (got num_layers={num_layers!r})")
    if placement == "folded" and num_layers % 2:
        raise ConfigError(
            "parallel.placement",
            f"'folded' puts block j and its mirror B-1-j on one rank, so it needs an even block count; use "
            f"'linear' for this {num_layers}-block model (got 'folded')",
        )
    bad = [pair for pair in skips if not 0 <= pair[0] < pair[1] < num_layers]
    if bad:
        raise ValueError(f"long skips must be (producer, consumer) pairs, producer < consumer < {num_layers}: {bad}")
    half = num_layers // 2
    max_degree = half if placement == "folded" else num_layers
    if not isinstance(degree, int) or isinstance(degree, bool) or not 1 <= degree <= max_degree:
        need = "2 x degree blocks (a chunk and its mirror per rank)" if placement == "folded" else "a block per rank"
        raise ConfigError(
            "parallel.pipefusion_degree",
            f"must be from 1 to {max_degree} for a {num_layers}-block model with {placement} placement, which needs "
            f"{need} (got {degree!r})",
        )

    route: list[Segment] = []
    if placement == "folded":
        sizes = _check_split(stage_split, degree, half, "the chunk sizes of the first half (mirrors are equal)")
        starts = [sum(sizes[:r]) for r in range(degree + 1)]
        for r in range(degree):  # outbound: chunk r of the first half
            route.append(Segment(len(route), r, tuple(range(starts[r], starts[r + 1]))))
        for r in reversed(range(degree)):  # return: mirror of chunk r
            route.append(Segment(len(route), r, tuple(range(num_layers - starts[r + 1], num_layers - starts[r]))))
    else:
        sizes = _check_split(stage_split, degree, num_layers, "the blocks each rank runs")
        start = 0
        for r, size in enumerate(sizes):
            route.append(Segment(r, r, tuple(range(start, start + size))))
            start += size

    owner = {b: seg.rank for seg in route for b in seg.blocks}
    edges = tuple(SkipEdge(p, c, owner[p], owner[c]) for p, c in skips)
    reserved = {"hidden", "skip", "latent", "cfg"} & set(streams)
    if reserved:
        raise ValueError(f"stream names {sorted(reserved)} are taken by the engine's own messages")
    return StagePlan(num_layers, degree, placement, tuple(route), edges, tuple(streams))
