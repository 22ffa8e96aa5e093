"""Pure planning: patch grid, stage plan, communication volume. No torch processes."""

import pytest

from xfuse.config import ConfigError
from xfuse.models.registry import HUNYUANDIT, PIXART_SIGMA
from xfuse.parallel.costs import comm_volume, kv_buffer_bytes
from xfuse.parallel.patch_grid import patch_grid
from xfuse.parallel.stage_plan import stage_plan

skip_pairs = HUNYUANDIT.skip_pairs


def diffusers_skip_wiring(num_layers):
    """(producer, consumer) pairs as HunyuanDiT2DModel.forward's push/pop loop produces them."""
    stack, pairs = [], []
    for layer in range(num_layers):
        if layer > num_layers // 2:
            pairs.append((stack.pop(), layer))
        if layer < num_layers // 2 - 1:
            stack.append(layer)
    return sorted(pairs)


@pytest.mark.parametrize("num_layers", [4, 8, 28, 40])
def test_skip_pairs_match_diffusers_wiring(num_layers):
    assert sorted(skip_pairs(num_layers)) == diffusers_skip_wiring(num_layers)


@pytest.mark.parametrize("num_layers", [4, 8, 28, 40])
@pytest.mark.parametrize("degree", range(1, 9))
@pytest.mark.parametrize("placement", ["folded", "linear"])
def test_every_block_once_and_route_shape(num_layers, degree, placement):
    limit = num_layers // 2 if placement == "folded" else num_layers
    if degree > limit:
        with pytest.raises(ConfigError) as err:
            stage_plan(num_layers, degree, placement, skips=HUNYUANDIT.skip_pairs(num_layers))
        assert err.value.key == "parallel.pipefusion_degree"
        return
    plan = stage_plan(num_layers, degree, placement, skips=HUNYUANDIT.skip_pairs(num_layers))
    route_blocks = [b for seg in plan.route for b in seg.blocks]
    assert route_blocks == list(range(num_layers))  # the route runs the model's blocks in order
    assert sorted(b for r in range(degree) for b in plan.blocks_of(r)) == list(range(num_layers))
    assert plan.embed_rank == 0
    if placement == "folded":
        assert [s.rank for s in plan.route] == [*range(degree), *reversed(range(degree))]
        assert plan.output_rank == 0 and plan.cross_rank_skips == ()  # skips never cross ranks
        assert len(plan.handoffs) == 2 * (degree - 1)
        assert all(abs(h.src_rank - h.dst_rank) == 1 for h in plan.handoffs)  # neighbours only
        for rank in range(degree):  # a rank holds a chunk and its mirror
            blocks = plan.blocks_of(rank)
            assert {num_layers - 1 - b for b in blocks} == set(blocks)
    else:
        assert [s.rank for s in plan.route] == list(range(degree))
        assert plan.output_rank == degree - 1 and len(plan.handoffs) == degree - 1
        for rank in range(degree):  # contiguous runs
            blocks = plan.blocks_of(rank)
            assert list(blocks) == list(range(blocks[0], blocks[-1] + 1))
        expected_cross = {(p, c) for p, c in skip_pairs(num_layers) if plan.rank_of_block(p) != plan.rank_of_block(c)}
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
    assert all(a.row_stop == b.row_start for a, b in zip(grid.bands, grid.bands[1:]))
    assert [b.num_rows for b in patch_grid(16, 16, 8, 2)] == [1] * 8  # one token row per patch is allowed


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


@pytest.mark.parametrize("num_layers", [5, 28])
@pytest.mark.parametrize("degree", [1, 2, 4])
def test_a_family_without_long_skips_plans_any_block_count_linearly(num_layers, degree):
    plan = stage_plan(num_layers, degree, "linear", skips=PIXART_SIGMA.skip_pairs(num_layers))
    assert plan.skips == () and plan.cross_rank_skips == ()
    assert [b for seg in plan.route for b in seg.blocks] == list(range(num_layers))


def test_folded_needs_an_even_block_count_whatever_the_skips():
    with pytest.raises(ConfigError, match=r"^parallel.placement: 'folded' puts block j and its mirror"):
        stage_plan(5, 2, "folded")


@pytest.mark.parametrize("spec,placement", [(HUNYUANDIT, "folded"), (PIXART_SIGMA, "linear")])
def test_the_default_placement_comes_from_the_family(spec, placement):
    from xfuse.config import ParallelConfig

    assert ParallelConfig(pipefusion_degree=2).placement is None  # "the family's default"
    assert spec.plan(28, ParallelConfig(pipefusion_degree=2)).placement == placement
    assert spec.plan(28, ParallelConfig(pipefusion_degree=2, placement="folded")).placement == "folded"
