"""What the SD3 and FLUX ControlNet pipelines refuse before any rank communicates (``check_sd3_controlnet``,
``check_flux_controlnet``), and the residual map of each family's transformer (``ModelSpec.control_samples``) against
diffusers' ``interval_control`` rule."""

import pytest
from diffusers import FluxControlNetModel, FluxMultiControlNetModel, SD3ControlNetModel, SD3MultiControlNetModel

from xfuse.families.flux.controlnet import check_flux_controlnet
from xfuse.families.registry import model_spec
from xfuse.families.sd3.controlnet import check_sd3_controlnet

TINY = dict(sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=16,
            pos_embed_max_size=48)  # fmt: skip


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: None, "controlnet is required"),
        (lambda: SD3MultiControlNetModel([SD3ControlNetModel(**TINY)]), "several ControlNets"),
        (lambda: SD3ControlNetModel(**TINY | {"joint_attention_dim": None, "use_pos_embed": False}), "8b"),
        (lambda: SD3ControlNetModel(**TINY, extra_conditioning_channels=1), "inpainting"),
    ],
)
def test_refused_controlnets(make, message):
    with pytest.raises(ValueError, match=message):
        check_sd3_controlnet(make())


def test_a_plain_controlnet_passes():
    check_sd3_controlnet(SD3ControlNetModel(**TINY))


@pytest.mark.parametrize(
    "layers,control,expected",
    [
        (4, 2, {0: 0, 1: 0, 2: 1}),  # interval 2; the last block (context_pre_only) takes none
        (4, 4, {0: 0, 1: 1, 2: 2}),
        (24, 12, {b: b // 2 for b in range(23)}),
        (5, 2, {0: 0, 1: 0, 2: 0, 3: 1}),  # interval 2.5: int(i / 2.5)
        (4, 1, {0: 0, 1: 0, 2: 0}),
    ],
)
def test_sd3_control_samples_follow_diffusers_interval_rule(layers, control, expected):
    """``int(index_block / (num_layers / samples))`` for every block with ``context_pre_only`` False, as
    ``SD3Transformer2DModel.forward`` indexes ``block_controlnet_hidden_states``."""
    spec = model_spec("sd3-tiny")
    assert spec.control_samples({"num_layers": layers}, {"num_layers": control}) == expected


FLUX_TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                 axes_dims_rope=(4, 4, 8))  # fmt: skip


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: None, "controlnet is required"),
        (lambda: FluxMultiControlNetModel([FluxControlNetModel(**FLUX_TINY)]), "several ControlNets"),
        (lambda: FluxControlNetModel(**FLUX_TINY, conditioning_embedding_channels=16), "XLabs"),
        (lambda: FluxControlNetModel(**FLUX_TINY, num_mode=4), "union"),
    ],
)
def test_refused_flux_controlnets(make, message):
    with pytest.raises(ValueError, match=message):
        check_flux_controlnet(make())
    check_flux_controlnet(FluxControlNetModel(**FLUX_TINY))


@pytest.mark.parametrize(
    "control,expected",
    [
        # FLUX-tiny's 2 double + 3 single blocks: interval ceil(2 / 1) = 2, ceil(3 / 2) = 2; singles numbered after
        ({"num_layers": 1, "num_single_layers": 2}, {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}),
        ({"num_layers": 2, "num_single_layers": 0}, {0: 0, 1: 1}),  # no single residuals: diffusers passes None
        ({"num_layers": 0, "num_single_layers": 3}, {2: 0, 3: 1, 4: 2}),
        ({"num_layers": 4, "num_single_layers": 10}, {0: 0, 1: 1, 2: 4, 3: 5, 4: 6}),  # more than blocks: ceil = 1
    ],
)
def test_flux_control_samples_follow_diffusers_interval_rule(control, expected):
    """``index_block // ceil(blocks / samples)`` per list, as ``FluxTransformer2DModel.forward`` indexes
    ``controlnet_block_samples`` and ``controlnet_single_block_samples``."""
    spec = model_spec("flux-tiny")
    assert spec.control_samples({"num_layers": 2, "num_single_layers": 3}, control) == expected


@pytest.mark.parametrize(
    "blocks,degree,control,expected",
    [
        (16, 2, 8, [4, 12]),  # 4 + 8 against 12
        (24, 4, 12, [1, 8, 8, 7]),  # rank 0 cannot go below one block: 13 against 8
        (4, 2, 2, [1, 3]),
        (4, 4, 2, [1, 1, 1, 1]),
        (57, 4, 15, [3, 18, 18, 18]),  # FLUX.1's 19 + 38 blocks, an InstantX-sized ControlNet of 5 + 10
        (24, 3, 0, [8, 8, 8]),  # no ControlNet: the even split
    ],
)
def test_control_split_evens_the_ranks_counting_the_controlnet_on_rank_0(blocks, degree, control, expected):
    from xfuse.parallel.control import control_split

    split = control_split(blocks, degree, control)
    assert split == expected and sum(split) == blocks
    loads = [split[0] + control, *split[1:]]
    for first in range(1, blocks - degree + 2):  # no other first share (rest even) has a lighter busiest rank
        rest = blocks - first
        assert max(loads) <= max(first + control, -(-rest // (degree - 1)))


def test_a_call_without_control_image_is_refused_and_scales_follow_diffusers_keep():
    """``control_image`` is required (before any rank communicates); each step's scale is diffusers'
    ``controlnet_conditioning_scale * controlnet_keep[i]``: 0 where ``i / steps < start`` or ``(i + 1) / steps > end``,
    a list's first entry."""
    from xfuse.families.common.control import ControlCall

    with pytest.raises(ValueError, match="control_image is required"):
        ControlCall(None, 1.0, 0.0, 1.0)
    assert ControlCall("image", 0.5, 0.25, 0.75).scales(4) == [0.0, 0.5, 0.5, 0.0]
    assert ControlCall("image", [2.0], [0.0], [0.5]).scales(4) == [2.0, 2.0, 0.0, 0.0]
