"""Wan's stage (one rank's blocks of a diffusers ``WanTransformer3DModel``), run in one process, reproduces the model's
own forward on the whole clip and patch by patch, in both patch directions (``xfuse.parallel.video_layout``)."""

import copy

import pytest
import torch
from diffusers import WanTransformer3DModel

from xfuse.errors import ConfigError
from xfuse.families.wan.stage import WanStage
from xfuse.parallel.patch_grid import patch_grid
from xfuse.parallel.stage_plan import stage_plan
from xfuse.parallel.video_layout import VideoLayout

BLOCKS = 5
# 3 latent frames of 6 x 10 latent pixels: 3 x 5 token rows, so no band count below divides the frames evenly
FRAMES, HEIGHT, WIDTH = 3, 6, 10


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # 3-D RoPE: 4 + 4 + 4
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=BLOCKS,
        rope_max_seq_len=64,
    ).eval()
    with torch.no_grad():  # no zero-initialised part: a dropped block or a wrong position must show
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return transformer


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 4, FRAMES, HEIGHT, WIDTH, generator=g)
    return latents, torch.randn(2, 7, 16, generator=g), torch.tensor([500.0, 300.0])


def rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def staged(stages, plan, layout, latents, text, t, grid):
    """The stages chained on every band of ``grid`` (a whole-clip pass first, which fills the K/V buffers), the
    output written back band by band: the model's output as (B, C, F, H, W)."""
    stacked = layout.to_grid(latents)  # (B, C, F*H, W)
    for stage in stages.values():
        stage.begin_request(grid)
    out = torch.zeros_like(stacked)
    for band in [None, *grid] if grid.num_patches > 1 else [None]:
        rows = slice(None) if band is None else band.latent_rows
        hidden = stages[plan.embed_rank].embed(stacked[:, :, rows], band)  # (B, band tokens, hidden)
        for segment in plan.route:
            stage = stages[segment.rank]
            cond = stage.conditioning(t, stage.text_states(text), stage.rotary_embedding(latents, layout))
            hidden = stage.run_segment(hidden, segment, cond, band, {})
        head = stages[plan.output_rank].head(hidden, cond, grid.token_cols, band)  # (B, C, covering rows, W)
        if band is None:
            out = head
        else:
            band.copy_pixels(out[:, :, rows], head)
    return layout.from_grid(out)


@pytest.mark.parametrize("direction", ["temporal", "spatial"])
@pytest.mark.parametrize("degree,num_patches", [(1, 1), (1, 4), (2, 2), (3, 4), (4, 7)])
def test_stages_reproduce_forward_whole_and_patchwise(model, direction, degree, num_patches):
    latents, text, t = inputs()
    with torch.no_grad():
        expected = model(latents, t, text, return_dict=False)[0]
        plan = stage_plan(BLOCKS, degree, "linear")
        stages = {r: WanStage(copy.deepcopy(model), plan, r) for r in range(degree)}
        layout = VideoLayout(direction, FRAMES, HEIGHT, WIDTH, 2)
        out = staged(stages, plan, layout, latents, text, t, patch_grid(FRAMES * HEIGHT, WIDTH, num_patches, 2))
    # temporal keeps the model's token order (observed 0); spatial reorders the keys of the softmax sum (1.6e-7)
    assert rel_diff(out, expected) <= 1e-6


def test_positions_off_by_a_few_tokens_change_the_output(model):
    """The comparison above sees positions: the whole clip's RoPE table shifted by 7 tokens (what a band slicing the
    wrong entries would get) moves the output well beyond its tolerance."""
    latents, text, t = inputs()
    plan = stage_plan(BLOCKS, 1, "linear")
    layout = VideoLayout("temporal", FRAMES, HEIGHT, WIDTH, 2)
    with torch.no_grad():
        expected = model(latents, t, text, return_dict=False)[0]
        stage = WanStage(copy.deepcopy(model), plan, 0)
        whole_table = stage.rotary_embedding
        stage.rotary_embedding = lambda lat, lay: tuple(
            x.roll(7, dims=2) for x in whole_table(lat, lay)
        )  # the token axis
        out = staged({0: stage}, plan, layout, latents, text, t, patch_grid(FRAMES * HEIGHT, WIDTH, 3, 2))
    assert rel_diff(out, expected) > 1e-2


@pytest.mark.parametrize("direction", ["temporal", "spatial"])
def test_layout_round_trips_and_orders_tokens_as_the_patch_embedding_does(direction):
    g = torch.Generator().manual_seed(0)
    video = torch.randn(2, 3, 5, 6, 8, generator=g)
    layout = VideoLayout(direction, 5, 6, 8, 2)
    stacked = layout.to_grid(video)
    assert stacked.shape == (2, 3, 30, 8) and torch.equal(layout.from_grid(stacked), video)
    conv = torch.nn.Conv3d(3, 4, (1, 2, 2), (1, 2, 2))
    with torch.no_grad():
        model_tokens = conv(video).flatten(2).transpose(1, 2)  # (B, F*h*w, 4), frame-major
        layout_tokens = conv(stacked.unsqueeze(2)).flatten(2).transpose(1, 2)  # the stacked image's tokens
    assert torch.equal(layout_tokens, model_tokens[:, layout.token_order()])
    if direction == "spatial":  # a strip of token rows across every frame: the first 5 tokens rows are row 0 of each
        frames_of_first_rows = layout.token_order()[: 5 * 4].reshape(5, 4) // (3 * 4)
        assert frames_of_first_rows[:, 0].tolist() == [0, 1, 2, 3, 4]


def test_layout_refuses_an_unknown_direction():
    with pytest.raises(
        ConfigError, match=r"^parallel.video_patches: must be one of temporal, spatial \(got 'frames'\)"
    ):
        VideoLayout("frames", 3, 6, 8, 2)


def test_stage_refuses_image_to_video_transformers():
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                  text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=64)  # fmt: skip
    i2v = WanTransformer3DModel(**config, image_dim=8, added_kv_proj_dim=24)
    with pytest.raises(ValueError, match="text-to-video transformers"):
        WanStage(i2v, stage_plan(2, 1, "linear"), 0)
