"""What the planner, the performance model and ``xfuse plan`` know about a video family (Wan): its latent frames
stacked into the patch grid's rows, its FLOPs, its bytes."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from xfuse.config import config_from_dict
from xfuse.families.registry import model_spec, transformer_config
from xfuse.perf.planner import workload
from xfuse.plan_report import format_plan_report, plan_report


def test_block_flops_equal_torchs_flop_counter_on_every_block():
    """``WAN.block_flops`` against ``FlopCounterMode`` on ``WanPipeline``'s own call (math attention): every block,
    per batch element, exactly, for 2 latent frames of 4 x 4 tokens and the 512-token prompt."""
    spec, config = model_spec("wan-tiny"), transformer_config("wan-tiny")
    pipe = spec.build_preset_pipeline("wan-tiny")
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter, torch.no_grad():
        pipe(prompt="a cat", height=64, width=64, num_frames=5, num_inference_steps=1, output_type="latent")
    counts = counter.get_flop_counts()
    tokens = spec.latent_frames(5) * (64 // 8 // spec.token_patch(config)) ** 2
    blocks = [name for name in counts if name.count(".") == 2 and ".blocks." in name]
    assert len(blocks) == spec.num_blocks(config) == 4
    for name in blocks:
        counted = sum(counts[name].values()) / 2  # diffusers calls the transformer for cond and uncond
        block = int(name.split(".")[-1])
        assert spec.block_flops(config, block, tokens, tokens, sum(spec.text_lengths), True) == counted, name


@pytest.mark.parametrize("direction", ["temporal", "spatial"])
def test_plan_of_the_released_14b_at_480p_81_frames(direction):
    config = config_from_dict(
        {
            "model": "wan2.1-t2v-14b",
            "parallel": {"pipefusion_degree": 4, "video_patches": direction},
            "runtime": {"dtype": "bfloat16"},
        }
    )
    report = plan_report(config)
    grid = report.grid
    assert (report.frames, grid.latent_height, grid.latent_width) == (21, 21 * 60, 104)
    assert grid.num_tokens == 21 * 30 * 52 == 32760
    assert [band.num_tokens for band in grid] == [8216, 8216, 8164, 8164]  # 630 stacked rows: 158, 158, 157, 157
    hand_off = 2 * 32760 * 5120 * 2  # (CFG batch, tokens, hidden) in bfloat16, once per step and hand-off
    assert [report.volume[r]["hidden"] for r in range(4)] == [hand_off] * 3 + [0]
    assert report.volume[3]["latent"] == 16 * 21 * 60 * 104 * 2  # the stepped latent back to rank 0
    text = format_plan_report(report)
    assert (
        "video 81 frames of 480x832 px -> latent 21x60x104 -> 21x30x52 = 32760 tokens, "
        f"patches {direction} (630 stacked token rows)"
    ) in text
    # The released Wan 2.1 VAE's decode, traced per rank (xfuse.perf.video_vae): in bands over the 4 ranks (auto),
    # 15 latent rows each, each band's peak about a quarter of rank 0's alone (its own rows' work; rank 0's also
    # the whole clip it gathers).
    assert "VAE decode: AutoencoderKLWan (causal 3-D), latent 21x60x104 -> 81 frames of 480x832 px; " in text
    assert "this request decodes in row bands over the 4 ranks (auto: 480x832 px is at least 96x96;" in text
    vae = report.vae
    assert [band.rows for band in vae.bands] == [15] * 4 and vae.clip_bytes == 3 * 81 * 480 * 832 * 2
    assert all(0.2 < band.peak / vae.serial.peak < 0.3 for band in vae.bands), [b.peak for b in vae.bands]


def test_the_performance_model_counts_every_frame():
    """One latent frame more is one picture's tokens more: the modelled workload's grid and latent grow with it."""
    base = {"model": "wan2.1-t2v-1.3b", "parallel": {"pipefusion_degree": 2}}
    one = workload(config_from_dict({**base, "generation": {"num_frames": 1}}))
    many = workload(config_from_dict({**base, "generation": {"num_frames": 81}}))
    assert (one.frames, many.frames) == (1, 21)
    assert many.grid(2).num_tokens == 21 * one.grid(2).num_tokens == 21 * 30 * 52
    assert many.latent_bytes_per_element == 21 * one.latent_bytes_per_element


def test_two_experts_double_every_ranks_parameters_not_its_buffers():
    """Wan 2.2 A14B keeps both experts' blocks on every rank (a step runs one of them): twice the 14B's parameters,
    the same K/V buffers and bytes sent."""
    reports = {
        model: plan_report(
            config_from_dict({"model": model, "parallel": {"pipefusion_degree": 4}, "runtime": {"dtype": "bfloat16"}})
        )  # (the 14B traced once, above)
        for model in ("wan2.1-t2v-14b", "wan2.2-t2v-a14b")
    }
    one, two = reports["wan2.1-t2v-14b"], reports["wan2.2-t2v-a14b"]
    assert (one.experts, two.experts) == (1, 2)
    assert {r: 2 * n for r, n in one.param_bytes.items()} == two.param_bytes
    assert one.kv_bytes == two.kv_bytes and one.volume == two.volume
    assert "2 experts (each rank keeps its blocks of every one; a step runs one)" in format_plan_report(two)
