"""Which transformer blocks each rank runs, in what order, and where the model's long skips go.

A model is B blocks run in order, plus optional long skips: (producer, consumer) pairs where the output of an early
block is also an input of a later one (HunyuanDiT: block ``k`` feeds block ``B-1-k``; most DiTs have none). The
skips come from the model family's spec; the planner knows no model. Blocks ``j`` and ``B-1-j`` are "mirrors".

Three placements (docs/design.md §3):

* ``linear`` — rank r holds a contiguous run of blocks (xDiT's split, generalised to any degree and split). A patch
  visits ranks 0 → N-1 once; a skip whose producer and consumer live on different ranks is a cross-rank transfer,
  and the last rank (which owns the output layer) hands the stepped latent back to rank 0.
* ``folded`` — the first half of the blocks is cut into N chunks; chunk r and its mirror live on rank r. A patch
  visits 0 → N-1 and back N-1 → 0, so every mirror-pair skip stays on one rank and rank 0 owns both ends of the
  model. Without long skips it only doubles the hand-offs. Blocks come in mirror pairs, so unless N divides B/2
  the ranks hold uneven counts (40 blocks at N = 8: 6/6/6/6/4/4/4/4).
* ``balanced`` — folded's route (0 → N-1 and back, one contiguous chunk each way per rank), but the ranks' block
  totals differ by at most one (any N, any B, odd too) and the outbound/return cut need not be B/2. Among all such
  splits it takes the one with the fewest long skips crossing ranks (exact dynamic programming, below); ties go to
  fewer blocks on early ranks (rank 0 also runs the embedding, the output layer and the scheduler step), then to
  chunks as even as possible each way. Where N divides B/2 this is folded's plan. HunyuanDiT, 40 blocks: 0 skips
  cross at N = 2, 4, 5, one at N = 3 and 7, 2 at N = 6, 4 at N = 8 (linear: 19 at N = 2). A crossing skip always
  goes from a rank's outbound chunk down to a lower rank's return chunk, and leaves with the sender's return
  hand-off (``schedule.skip_send_hops``): splits that would need one upwards are not considered.

Everything here is pure: no torch, no processes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from xfuse.errors import ConfigError
from xfuse.types import PLACEMENTS


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

    num_blocks: int
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

    @property
    def handoffs(self) -> tuple[Handoff, ...]:
        """Hidden-state transfers along the route (consecutive segments on different ranks)."""
        return tuple(Handoff(a.hop, a.rank, b.rank) for a, b in pairwise(self.route) if a.rank != b.rank)

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


def _check_split(split: Sequence[int] | None, degree: int, total: int, what: str, least: int = 1) -> list[int]:
    if split is None:
        return _even_split(total, degree)
    split = list(split)
    if (
        len(split) != degree
        or any(not isinstance(n, int) or isinstance(n, bool) or n < least for n in split)
        or (sum(split) != total)
    ):
        counts = "positive block counts" if least == 1 else f"block counts of at least {least}"
        raise ConfigError(
            "parallel.stage_split",
            f"must list {degree} {counts} (one per rank) summing to {total}, {what} (got {split!r})",
        )
    return split


@functools.lru_cache(maxsize=256)
def _balanced_cuts(
    num_blocks: int, degree: int, totals: tuple[int, ...] | None, skips: tuple[tuple[int, int], ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Block totals and outbound chunk sizes per rank of the ``balanced`` placement, or None if no split qualifies.

    The route is rank 0 … N-1 outbound, then N-1 … 0 back. With ``A_r`` blocks outbound before rank r and ``S_r``
    blocks on ranks before r, rank r's return chunk ends at ``B - (S_r - A_r)``: given the totals, the outbound
    prefixes fix the whole plan. Dynamic programming over ranks in route order, state (r, A_r, number of ranks so
    far given the larger total ``ceil(B/N)``; with ``totals`` given, that count is unused); a skip stays on rank r
    iff both its blocks are in rank r's two chunks, which only depend on that rank's transition.

    Only splits whose crossing skips the schedule can carry qualify: no skip may go from a lower rank's outbound
    chunk into a higher rank's return chunk. (A skip into a lower rank's return chunk travels with the return
    hand-off, and one into a higher rank's outbound chunk with the outbound one; one from rank a's outbound chunk to
    rank a+1's return chunk would reach a+1 by a different task pair than the hand-off a -> a+1, and messages
    between two ranks must arrive in the order they are sent.) For mirror skips this costs nothing: the crossings
    at each boundary can always point downwards.

    The cost of a plan, compared as a tuple: (skips crossing ranks, which ranks got the larger total as a binary
    number with rank 0 the highest bit, sum over ranks of |outbound - return|); remaining ties go to the smallest
    outbound chunks, earliest ranks first.
    """
    # table[i][j]: skips with producer < i and consumer < j, so the skips between two block ranges take O(1).
    size = num_blocks + 1
    table = [[0] * size for _ in range(size)]
    for p, c in skips:
        table[p + 1][c + 1] += 1
    for i in range(size):
        for j in range(size):
            table[i][j] += (table[i - 1][j] if i else 0) + (table[i][j - 1] if j else 0)
            table[i][j] -= table[i - 1][j - 1] if i and j else 0

    def between(a: int, b: int, x: int, y: int) -> int:  # skips with producer in [a, b) and consumer in [x, y)
        return table[b][y] - table[a][y] - table[b][x] + table[a][x]

    def kept(ranges: tuple[tuple[int, int], ...]) -> int:  # skips with both ends in the union of ranges
        return sum(between(a, b, x, y) for a, b in ranges for x, y in ranges)

    base, extra = divmod(num_blocks, degree)
    memo: dict[tuple[int, int, int], tuple[tuple[int, int, int], tuple[int, int]] | None] = {}

    def best(r: int, outbound: int, larger: int):
        """(cost, (total, outbound chunk) of rank r) of the best completion from rank r on; None if none."""
        key = (r, outbound, larger)
        if key in memo:
            return memo[key]
        before = sum(totals[:r]) if totals else r * base + larger
        end = num_blocks - before + outbound  # where rank r's return chunk ends
        options: tuple[int, ...]
        if totals:
            options = (totals[r],)
        else:  # the ranks left must be able to take the larger totals not yet given
            options = tuple(t for t in (base, base + 1) if 0 <= extra - larger - (t - base) <= degree - r - 1)
        result = None
        for total in options:
            bit = 0 if totals else (total - base) << (degree - 1 - r)
            for chunk in range(1, total):
                start = end - (total - chunk)  # rank r's return chunk: [start, end)
                if between(0, outbound, start, end):  # from a lower rank's outbound chunk: not carried
                    continue
                if r == degree - 1:  # the turn: [outbound, end) is one run, the cut only labels the chunks
                    cost = (-kept(((outbound, end),)), bit, abs(2 * chunk - total))
                else:
                    rest = best(r + 1, outbound + chunk, larger + (0 if totals else total - base))
                    if rest is None:
                        continue
                    same = kept(((outbound, outbound + chunk), (start, end)))
                    cost = (rest[0][0] - same, rest[0][1] + bit, rest[0][2] + abs(2 * chunk - total))
                if result is None or cost < result[0]:
                    result = (cost, (total, chunk))
        memo[key] = result
        return result

    if best(0, 0, 0) is None:
        return None
    chosen_totals, chunks, outbound, larger = [], [], 0, 0
    for r in range(degree):
        total, chunk = best(r, outbound, larger)[1]
        chosen_totals.append(total)
        chunks.append(chunk)
        outbound += chunk
        larger += 0 if totals else total - base
    return tuple(chosen_totals), tuple(chunks)


def stage_plan(
    num_blocks: int,
    degree: int,
    placement: str,
    stage_split: Sequence[int] | None = None,
    *,
    skips: Sequence[tuple[int, int]] = (),
    streams: Sequence[str] = (),
) -> StagePlan:
    """Plan which blocks each of ``degree`` ranks runs.

    Args:
        num_blocks: number of transformer blocks (even for ``folded``, which pairs block j with block B-1-j).
        degree: number of pipeline ranks (PipeFusion degree).
        placement: ``"balanced"``, ``"folded"`` or ``"linear"``.
        stage_split: optional block counts per rank. Folded: sizes of the N first-half chunks (sum = B/2; each
            rank also runs the mirror chunk). Linear: blocks per rank (sum = B). Balanced: blocks per rank (sum =
            B, at least 2 each; default the even split, larger shares where they cut the fewest skips); the
            planner picks where each rank's blocks split between the way out and the way back.
        skips: the model's long skips as (producer, consumer) block pairs (its spec's ``skip_pairs``).
        streams: names of the hand-off tensors the first patch of a step carries besides the hidden state (its
            spec's ``streams``; e.g. ``("text",)``).

    Raises:
        ConfigError: naming ``model``, ``parallel.placement``, ``parallel.pipefusion_degree`` or
            ``parallel.stage_split``.
    """
    if placement not in PLACEMENTS:
        raise ConfigError("parallel.placement", f"must be one of {', '.join(PLACEMENTS)} (got {placement!r})")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ConfigError("model", f"must have at least one transformer block (got num_blocks={num_blocks!r})")
    if placement == "folded" and num_blocks % 2:
        raise ConfigError(
            "parallel.placement",
            f"'folded' puts block j and its mirror B-1-j on one rank, so it needs an even block count; use "
            f"'balanced' or 'linear' for this {num_blocks}-block model (got 'folded')",
        )
    if placement == "balanced" and num_blocks < 2:
        raise ConfigError(
            "parallel.placement",
            f"'balanced' runs a chunk of blocks on the way out and one on the way back on every rank, so it needs "
            f"at least 2 blocks; use 'linear' for this {num_blocks}-block model (got 'balanced')",
        )
    skips = tuple((p, c) for p, c in skips)
    bad = [pair for pair in skips if not 0 <= pair[0] < pair[1] < num_blocks]
    if bad:
        raise ValueError(f"long skips must be (producer, consumer) pairs, producer < consumer < {num_blocks}: {bad}")
    half = num_blocks // 2
    max_degree = num_blocks if placement == "linear" else half
    if not isinstance(degree, int) or isinstance(degree, bool) or not 1 <= degree <= max_degree:
        need = {
            "folded": "2 x degree blocks (a chunk and its mirror per rank)",
            "balanced": "2 blocks per rank (a chunk each way)",
            "linear": "a block per rank",
        }[placement]
        raise ConfigError(
            "parallel.pipefusion_degree",
            f"must be from 1 to {max_degree} for a {num_blocks}-block model with {placement} placement, which needs "
            f"{need} (got {degree!r})",
        )

    route: list[Segment] = []
    if placement == "folded":
        sizes = _check_split(stage_split, degree, half, "the chunk sizes of the first half (mirrors are equal)")
        starts = [sum(sizes[:r]) for r in range(degree + 1)]
        for r in range(degree):  # outbound: chunk r of the first half
            route.append(Segment(len(route), r, tuple(range(starts[r], starts[r + 1]))))
        for r in reversed(range(degree)):  # return: mirror of chunk r
            route.append(Segment(len(route), r, tuple(range(num_blocks - starts[r + 1], num_blocks - starts[r]))))
    elif placement == "balanced":
        totals = None
        if stage_split is not None:
            what = "the blocks each rank runs (a chunk each way)"
            totals = tuple(_check_split(stage_split, degree, num_blocks, what, least=2))
        cuts = _balanced_cuts(num_blocks, degree, totals, skips)
        if cuts is None:
            raise ConfigError(
                "parallel.placement",
                f"'balanced' found no split of {num_blocks} blocks over {degree} ranks in which every long skip "
                f"that crosses ranks can travel with the patch's hand-offs (none may go from a lower rank's outbound "
                f"chunk into a higher rank's return chunk); use 'folded' or 'linear' (got 'balanced')",
            )
        totals, outbound = cuts
        start = 0
        for r in range(degree):  # outbound: rank r's first chunk
            route.append(Segment(len(route), r, tuple(range(start, start + outbound[r]))))
            start += outbound[r]
        for r in reversed(range(degree)):  # return: the rest of rank r's blocks
            route.append(Segment(len(route), r, tuple(range(start, start + totals[r] - outbound[r]))))
            start += totals[r] - outbound[r]
    else:
        sizes = _check_split(stage_split, degree, num_blocks, "the blocks each rank runs")
        start = 0
        for r, size in enumerate(sizes):
            route.append(Segment(r, r, tuple(range(start, start + size))))
            start += size

    owner = {b: seg.rank for seg in route for b in seg.blocks}
    edges = tuple(SkipEdge(p, c, owner[p], owner[c]) for p, c in skips)
    reserved = {"hidden", "skip", "latent", "cfg"} & set(streams)
    if reserved:
        raise ValueError(f"stream names {sorted(reserved)} are taken by the engine's own messages")
    return StagePlan(num_blocks, degree, placement, tuple(route), edges, tuple(streams))
