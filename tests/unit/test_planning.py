"""Pure planning: patch grid, stage plan, communication volume. No torch processes."""

import itertools
from itertools import pairwise

import pytest
import torch

from xfuse.config import ConfigError
from xfuse.families.registry import HUNYUANDIT, PIXART_SIGMA
from xfuse.parallel.costs import comm_volume, kv_buffer_bytes
from xfuse.parallel.patch_grid import patch_grid, token_counts
from xfuse.parallel.stage_plan import stage_plan

skip_pairs = HUNYUANDIT.skip_pairs


def diffusers_skip_wiring(num_blocks):
    """(producer, consumer) pairs as HunyuanDiT2DModel.forward's push/pop loop produces them."""
    stack, pairs = [], []
    for layer in range(num_blocks):
        if layer > num_blocks // 2:
            pairs.append((stack.pop(), layer))
        if layer < num_blocks // 2 - 1:
            stack.append(layer)
    return sorted(pairs)


@pytest.mark.parametrize("num_blocks", [4, 8, 28, 40])
def test_skip_pairs_match_diffusers_wiring(num_blocks):
    assert sorted(skip_pairs(num_blocks)) == diffusers_skip_wiring(num_blocks)


@pytest.mark.parametrize("num_blocks", [4, 8, 28, 40])
@pytest.mark.parametrize("degree", range(1, 9))
@pytest.mark.parametrize("placement", ["balanced", "folded", "linear"])
def test_every_block_once_and_route_shape(num_blocks, degree, placement):
    limit = num_blocks if placement == "linear" else num_blocks // 2
    if degree > limit:
        with pytest.raises(ConfigError) as err:
            stage_plan(num_blocks, degree, placement, skips=HUNYUANDIT.skip_pairs(num_blocks))
        assert err.value.key == "parallel.pipefusion_degree"
        return
    plan = stage_plan(num_blocks, degree, placement, skips=HUNYUANDIT.skip_pairs(num_blocks))
    route_blocks = [b for seg in plan.route for b in seg.blocks]
    assert route_blocks == list(range(num_blocks))  # the route runs the model's blocks in order
    assert sorted(b for r in range(degree) for b in plan.blocks_of(r)) == list(range(num_blocks))
    assert plan.embed_rank == 0
    if placement == "folded":
        assert [s.rank for s in plan.route] == [*range(degree), *reversed(range(degree))]
        assert plan.output_rank == 0 and plan.cross_rank_skips == ()  # skips never cross ranks
        assert len(plan.handoffs) == 2 * (degree - 1)
        assert all(abs(h.src_rank - h.dst_rank) == 1 for h in plan.handoffs)  # neighbours only
        for rank in range(degree):  # a rank holds a chunk and its mirror
            blocks = plan.blocks_of(rank)
            assert {num_blocks - 1 - b for b in blocks} == set(blocks)
    elif placement == "balanced":
        assert [s.rank for s in plan.route] == [*range(degree), *reversed(range(degree))]
        assert plan.output_rank == 0 and len(plan.handoffs) == 2 * (degree - 1)
        sizes = [len(plan.blocks_of(r)) for r in range(degree)]
        assert max(sizes) - min(sizes) <= 1
    else:
        assert [s.rank for s in plan.route] == list(range(degree))
        assert plan.output_rank == degree - 1 and len(plan.handoffs) == degree - 1
        for rank in range(degree):  # contiguous runs
            blocks = plan.blocks_of(rank)
            assert list(blocks) == list(range(blocks[0], blocks[-1] + 1))
        expected_cross = {(p, c) for p, c in skip_pairs(num_blocks) if plan.rank_of_block(p) != plan.rank_of_block(c)}
        assert {(s.producer, s.consumer) for s in plan.cross_rank_skips} == expected_cross


def test_linear_matches_xdit_contiguous_split():
    plan = stage_plan(40, 4, "linear", skips=HUNYUANDIT.skip_pairs(40))
    assert [plan.blocks_of(r) for r in range(4)] == [tuple(range(10 * r, 10 * r + 10)) for r in range(4)]
    # At pp=2 every skip crosses: blocks 0..18 on rank 0 feed blocks 39..21 on rank 1.
    assert len(stage_plan(40, 2, "linear", skips=HUNYUANDIT.skip_pairs(40)).cross_rank_skips) == 19


def test_folded_split_and_odd_degree():
    plan = stage_plan(40, 3, "folded", stage_split=[6, 7, 7], skips=HUNYUANDIT.skip_pairs(40))
    assert plan.blocks_of(0) == (*range(0, 6), *range(34, 40))
    assert plan.blocks_of(2) == tuple(range(13, 27))


@pytest.mark.parametrize(
    "args,key",
    [
        ((7, 2, "folded"), "model"),  # odd block count: diffusers itself cannot run it
        ((5, 1, "linear"), "model"),
        ((8, 2, "diagonal"), "parallel.placement"),
        ((8, 5, "folded"), "parallel.pipefusion_degree"),
        ((8, 5, "balanced"), "parallel.pipefusion_degree"),
        ((8, 0, "linear"), "parallel.pipefusion_degree"),
        ((8, 9, "linear"), "parallel.pipefusion_degree"),
    ],
)
def test_bad_plans(args, key):
    with pytest.raises(ConfigError) as err:
        stage_plan(*args, skips=HUNYUANDIT.skip_pairs(args[0]))
    assert err.value.key == key and str(err.value).startswith(key)


@pytest.mark.parametrize(
    "split,placement", [([3, 2], "folded"), ([4, 0], "folded"), ([3, 3, 2], "linear"), ([4, 3], "linear")]
)
def test_bad_stage_split(split, placement):
    with pytest.raises(ConfigError, match=r"parallel.stage_split: must list 2 positive block counts"):
        stage_plan(8, 2, placement, stage_split=split, skips=HUNYUANDIT.skip_pairs(8))


def test_patch_grid_uneven_bands():
    grid = patch_grid(108, 128, 4, 2)  # 864 px tall: 54 token rows, not divisible by 4
    assert grid.token_rows == 54 and [b.num_rows for b in grid] == [14, 14, 13, 13]
    assert grid[0].tokens == slice(0, 14 * 64) and grid[3].tokens.stop == grid.num_tokens
    assert grid[1].latent_rows == slice(28, 56)
    assert all(a.row_stop == b.row_start for a, b in pairwise(grid.bands))
    assert [b.num_rows for b in patch_grid(16, 16, 8, 2)] == [1] * 8  # one token row per patch is allowed


@pytest.mark.parametrize("rows", range(1, 40))
def test_token_counts_without_lead_tokens_are_tensor_splits_of_rows(rows):
    for m in range(1, rows + 1):
        assert token_counts(rows, 5, m) == [5 * len(part) for part in torch.arange(rows).tensor_split(m)]
        assert all(band.whole_rows for band in patch_grid(rows * 2, 10, m, 2))


@pytest.mark.parametrize(
    "rows,cols,m,lead,expected",
    [
        (32, 32, 2, 93, [466, 558]),  # sd3-small at 512 px, 16 T5 tokens: 559 / 558 (by rows: 573 / 544)
        (32, 32, 2, 333, [346, 678]),  # the default 256 T5 tokens: 679 / 678
        (32, 32, 2, 16, [504, 520]),  # flux-small, 16 T5 tokens: half a row (by rows: 528 / 512)
        (64, 64, 2, 333, [1882, 2214]),  # SD3-medium at 1024 px: 2,215 / 2,214 (by rows: 2,189 / 2,240)
        (64, 64, 2, 512, [1792, 2304]),  # FLUX at 1024 px, 512 T5 tokens: whole rows (28 / 36)
        (8, 6, 2, 93, [6, 42]),  # more text than image: the first patch keeps one row
        (8, 6, 3, 16, [6, 21, 21]),
    ],
)
def test_token_counts_give_the_first_patch_fewer_tokens_for_those_it_carries(rows, cols, m, lead, expected):
    assert token_counts(rows, cols, m, lead) == expected
    grid = patch_grid(rows * 2, cols * 2, m, 2, lead)
    assert [b.num_tokens for b in grid] == expected and grid[0].lead_tokens == lead
    assert grid.cost_tokens == (expected[0] + lead, *expected[1:])
    assert grid[0].token_start == 0 and grid.bands[-1].token_stop == rows * cols
    assert all(a.token_stop == b.token_start for a, b in pairwise(grid.bands))
    for band in grid:  # the covering rows: the rows holding the band's first and last token
        assert band.row_start == band.token_start // cols and band.row_stop == (band.token_stop - 1) // cols + 1
        assert band.whole_rows == (band.token_start % cols == 0 == band.token_stop % cols)


def compositions(total, parts, first_at_least=1):
    """Every way to write ``total`` as ``parts`` positive counts, in order (the first at least ``first_at_least``)."""
    if parts == 1:
        if total >= first_at_least:
            yield (total,)
        return
    for first in range(first_at_least, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize("m", [2, 3, 4])
@pytest.mark.parametrize("lead", [3, 7, 20, 45])
def test_token_counts_reach_the_smallest_largest_patch_of_every_cut(m, lead):
    """Against every cut of 10 rows of 4 tokens (the first patch keeping at least a row): no cut has a smaller
    largest patch, the lead tokens counted in the first."""
    for rows in range(m, 11):
        tokens = rows * 4
        best = min(max(c[0] + lead, *c[1:]) for c in compositions(tokens, m, first_at_least=4))
        counts = token_counts(rows, 4, m, lead)
        assert sum(counts) == tokens and counts[0] >= 4 and min(counts) >= 1
        assert max(counts[0] + lead, *counts[1:]) == best, (rows, counts)


def band_mask(band, rows, cols, patch_size):
    """(rows * p, cols * p) bool: the latent pixels of ``band``'s tokens, from each pixel's token index."""
    token_of_pixel = torch.arange(rows * cols).reshape(rows, cols)
    token_of_pixel = token_of_pixel.repeat_interleave(patch_size, 0).repeat_interleave(patch_size, 1)
    return (token_of_pixel >= band.token_start) & (token_of_pixel < band.token_stop)


@pytest.mark.parametrize("m,lead", [(2, 16), (3, 16), (2, 5), (4, 9), (3, 0)])
def test_bands_inside_rows_trim_pad_and_copy_only_their_tokens(m, lead):
    """A band cut inside a row: ``trim`` keeps its tokens of the covering rows, ``pad`` puts them back among zeros,
    ``copy_pixels`` writes exactly its latent pixels (checked against a per-pixel token map)."""
    rows, cols, p = 8, 6, 2
    grid = patch_grid(rows * p, cols * p, m, p, lead)
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 3, rows * p, cols * p, generator=gen)  # (B, C, H, W)
    stepped = torch.randn(2, 3, rows * p, cols * p, generator=gen)
    tokens = torch.randn(2, rows * cols, 5, generator=gen)  # (B, tokens, D) of the whole image
    for band in grid:
        covering = tokens[:, band.row_tokens]
        assert torch.equal(band.trim(covering), tokens[:, band.tokens])
        padded = band.pad(tokens[:, band.tokens])
        assert padded.shape == covering.shape and torch.equal(band.trim(padded), tokens[:, band.tokens])
        band.trim(padded).zero_()
        assert not padded.any()  # zeros at the other bands' tokens
        expected = torch.where(band_mask(band, rows, cols, p), stepped, latents)[:, :, band.latent_rows]
        dest = latents.clone()
        band.copy_pixels(dest[:, :, band.latent_rows], stepped[:, :, band.latent_rows])
        assert torch.equal(dest[:, :, band.latent_rows], expected)
        outside = torch.ones(rows * p, dtype=torch.bool)
        outside[band.latent_rows] = False
        assert torch.equal(dest[:, :, outside], latents[:, :, outside])
    assert any(not band.whole_rows for band in grid) == (lead > 0)


@pytest.mark.parametrize("m", [0, 9, -1, 2.0])
def test_patch_grid_refuses_bad_num_patches(m):
    with pytest.raises(ConfigError) as err:
        patch_grid(16, 16, m, 2)
    assert err.value.key == "parallel.num_patches" and "from 1 to the number of token rows, 8" in str(err.value)


def test_patch_grid_refuses_odd_latent():
    with pytest.raises(ConfigError, match="generation.width"):
        patch_grid(16, 15, 2, 2)


def test_comm_volume_folded_vs_linear_40_blocks():
    grid = patch_grid(128, 128, 4, 2)  # 1024 px
    act = 2 * grid.num_tokens * 1408 * 2  # CFG batch 2, bf16
    for n in (2, 4, 8):
        folded = comm_volume(
            stage_plan(40, n, "folded", skips=HUNYUANDIT.skip_pairs(40)), grid, hidden_size=1408, batch=2, dtype_bytes=2
        )
        linear = comm_volume(
            stage_plan(40, n, "linear", skips=HUNYUANDIT.skip_pairs(40)),
            grid,
            hidden_size=1408,
            batch=2,
            latent_batch=1,
            dtype_bytes=2,
        )
        assert all(v["skip"] == 0 and v["latent"] == 0 for v in folded.values())
        # Folded: ranks 0..N-2 send once outbound; ranks 1..N-1 once on the way back.
        assert [folded[r]["hidden"] for r in range(n)] == [act if r in (0, n - 1) else 2 * act for r in range(n)]
        assert sum(v["hidden"] for v in linear.values()) == (n - 1) * act
        assert sum(v["skip"] for v in linear.values()) == 19 * act  # every skip crosses in xDiT's split
        assert linear[n - 1]["latent"] == 1 * 4 * 128 * 128 * 2
        total = lambda vol: sum(sum(v.values()) for v in vol.values())  # noqa: E731
        ratio = total(folded) / total(linear)
        assert ratio <= {2: 1 / 8, 4: 1 / 3, 8: 1.0}[n]


def test_kv_buffer_bytes_per_rank():
    plan, grid = stage_plan(8, 2, "folded", skips=HUNYUANDIT.skip_pairs(8)), patch_grid(16, 16, 2, 2)
    assert kv_buffer_bytes(plan, grid, hidden_size=32, batch=2) == {
        0: 2 * 2 * 64 * 32 * 4 * 4,
        1: 2 * 2 * 64 * 32 * 4 * 4,
    }


@pytest.mark.parametrize("num_blocks", [5, 28])
@pytest.mark.parametrize("degree", [1, 2, 4])
def test_a_family_without_long_skips_plans_any_block_count_linearly(num_blocks, degree):
    plan = stage_plan(num_blocks, degree, "linear", skips=PIXART_SIGMA.skip_pairs(num_blocks))
    assert plan.skips == () and plan.cross_rank_skips == ()
    assert [b for seg in plan.route for b in seg.blocks] == list(range(num_blocks))


def test_folded_needs_an_even_block_count_whatever_the_skips():
    with pytest.raises(ConfigError, match=r"^parallel.placement: 'folded' puts block j and its mirror"):
        stage_plan(5, 2, "folded")


@pytest.mark.parametrize("spec,placement", [(HUNYUANDIT, "balanced"), (PIXART_SIGMA, "linear")])
def test_the_default_placement_comes_from_the_family(spec, placement):
    from xfuse.config import ParallelConfig

    assert ParallelConfig(pipefusion_degree=2).placement is None  # "the family's default"
    assert spec.plan(28, ParallelConfig(pipefusion_degree=2)).placement == placement
    assert spec.plan(28, ParallelConfig(pipefusion_degree=2, placement="folded")).placement == "folded"
    assert spec.plan(28, ParallelConfig(pipefusion_degree=3, placement="balanced")).placement == "balanced"


# --- balanced placement -----------------------------------------------------------------------------------------


def mirror_skips(num_blocks):
    """HunyuanDiT's skips for an even block count; for an odd one, every block k < B // 2 feeds its mirror B-1-k."""
    return (
        skip_pairs(num_blocks)
        if num_blocks % 2 == 0
        else tuple((k, num_blocks - 1 - k) for k in range(num_blocks // 2))
    )


def crossing(route, skips):
    """Skips whose producer and consumer blocks lie on different ranks of a route given as (rank, blocks) pairs."""
    owner = {b: rank for rank, blocks in route for b in blocks}
    return sum(owner[p] != owner[c] for p, c in skips)


def brute_force_min_crossing(num_blocks, degree, skips):
    """Fewest crossing skips over every folded-route split with per-rank totals within one block: every cut point,
    every composition of the way out and of the way back into one chunk per rank. Independent of the planner."""

    def compositions(n, k):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            yield [bounds[i + 1] - bounds[i] for i in range(k)]

    best = None
    for cut in range(degree, num_blocks - degree + 1):
        for out in compositions(cut, degree):
            for back in compositions(num_blocks - cut, degree):  # route order: rank N-1 first
                totals = [out[r] + back[degree - 1 - r] for r in range(degree)]
                if max(totals) - min(totals) > 1:
                    continue
                route, start = [], 0
                for rank, size in [*enumerate(out), *zip(reversed(range(degree)), back, strict=True)]:
                    route.append((rank, range(start, start + size)))
                    start += size
                count = crossing(route, skips)
                best = count if best is None else min(best, count)
    return best


BALANCED_BLOCKS = [40, 16, 57, 7]


@pytest.mark.parametrize("num_blocks", BALANCED_BLOCKS)
def test_balanced_route_and_totals_for_every_degree(num_blocks):
    skips = mirror_skips(num_blocks)
    for degree in range(1, num_blocks // 2 + 1):
        plan = stage_plan(num_blocks, degree, "balanced", skips=skips)
        assert [s.rank for s in plan.route] == [*range(degree), *reversed(range(degree))]  # one chunk each way
        assert all(len(s.blocks) >= 1 for s in plan.route)
        assert [b for s in plan.route for b in s.blocks] == list(range(num_blocks))  # every block once, in order
        totals = [len(plan.blocks_of(r)) for r in range(degree)]
        assert max(totals) - min(totals) <= 1 and sum(totals) == num_blocks
        assert plan.embed_rank == plan.output_rank == 0
        assert len(plan.cross_rank_skips) == crossing([(s.rank, s.blocks) for s in plan.route], skips)
        # every crossing skip goes down to a lower rank's return chunk: the schedule sends it with that hand-off
        assert all(e.src_rank > e.dst_rank for e in plan.cross_rank_skips)


def test_balanced_crossing_skips_at_40_blocks():
    skips = skip_pairs(40)
    counts = {n: len(stage_plan(40, n, "balanced", skips=skips).cross_rank_skips) for n in range(2, 9)}
    assert counts == {2: 0, 3: 1, 4: 0, 5: 0, 6: 2, 7: 1, 8: 4}
    assert all(len(stage_plan(40, n, "linear", skips=skips).cross_rank_skips) > counts[n] for n in range(2, 9))
    totals = {n: [len(stage_plan(40, n, "balanced", skips=skips).blocks_of(r)) for r in range(n)] for n in (6, 8)}
    assert totals == {6: [6, 6, 7, 7, 7, 7], 8: [5] * 8}  # the lighter shares on rank 0 first


@pytest.mark.parametrize("num_blocks", [4, 6, 7, 8, 9, 11, 12, 13, 16])
def test_balanced_crossing_count_is_minimal(num_blocks):
    for skips in (mirror_skips(num_blocks), ()):
        for degree in range(1, num_blocks // 2 + 1):
            plan = stage_plan(num_blocks, degree, "balanced", skips=skips)
            assert len(plan.cross_rank_skips) == brute_force_min_crossing(num_blocks, degree, skips), degree


@pytest.mark.parametrize("num_blocks", [8, 16, 24, 40, 48])
def test_balanced_is_folded_where_folded_is_balanced(num_blocks):
    for degree in range(1, num_blocks // 2 + 1):
        if (num_blocks // 2) % degree == 0:
            skips = skip_pairs(num_blocks)
            assert stage_plan(num_blocks, degree, "balanced", skips=skips).route == (
                stage_plan(num_blocks, degree, "folded", skips=skips).route
            )


def test_balanced_stage_split_sets_the_totals():
    plan = stage_plan(40, 3, "balanced", stage_split=[12, 14, 14], skips=skip_pairs(40))
    assert [len(plan.blocks_of(r)) for r in range(3)] == [12, 14, 14]
    assert plan.blocks_of(0) == (*range(0, 6), *range(34, 40)) and plan.cross_rank_skips == ()
    # any totals: at most one crossing skip per boundary, always down the return route
    plan = stage_plan(40, 4, "balanced", stage_split=[3, 11, 13, 13], skips=skip_pairs(40))
    assert [len(plan.blocks_of(r)) for r in range(4)] == [3, 11, 13, 13]
    assert len(plan.cross_rank_skips) == 2 and all(e.src_rank == e.dst_rank + 1 for e in plan.cross_rank_skips)


@pytest.mark.parametrize(
    "split,message",
    [
        ([20, 19], "must list 2 block counts of at least 2 (one per rank) summing to 40"),
        ([39, 1], "must list 2 block counts of at least 2 (one per rank) summing to 40"),
        ([10, 10, 20], "must list 2 block counts of at least 2"),
        ([20.0, 20], "must list 2 block counts of at least 2"),
    ],
)
def test_balanced_bad_stage_split(split, message):
    with pytest.raises(ConfigError) as err:
        stage_plan(40, 2, "balanced", stage_split=split, skips=skip_pairs(40))
    assert (
        err.value.key == "parallel.stage_split" and message in str(err.value) and f"(got {split!r})" in str(err.value)
    )


def test_balanced_degree_limit_and_uncarriable_skips():
    with pytest.raises(ConfigError) as err:
        stage_plan(40, 21, "balanced", skips=skip_pairs(40))
    assert err.value.key == "parallel.pipefusion_degree"
    assert "must be from 1 to 20 for a 40-block model with balanced placement" in str(err.value)
    assert "2 blocks per rank" in str(err.value) and "(got 21)" in str(err.value)
    stage_plan(7, 3, "balanced", skips=mirror_skips(7))  # odd block counts reach B // 2 ranks
    with pytest.raises(ConfigError, match=r"^parallel.placement: 'balanced' runs a chunk .* needs at least 2 blocks"):
        stage_plan(1, 1, "balanced")
    # a skip from rank 0's outbound chunk into rank 1's return chunk, unavoidable here: the schedule cannot send it
    with pytest.raises(ConfigError, match=r"^parallel.placement: 'balanced' found no split of 4 blocks over 2 ranks"):
        stage_plan(4, 2, "balanced", skips=[(0, 2)])
