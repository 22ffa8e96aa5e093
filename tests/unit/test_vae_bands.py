"""The band decode's pure parts, in one process: the bands, the merged moments, the refusals, and one rank equal to
diffusers' ``vae.decode`` (the multi-rank worlds are in ``tests/multirank/test_vae_decode.py``)."""

import copy
import itertools

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0, SlicedAttnProcessor

from xfuse.families.common.presets import tiny_vae, tiny_vae_config
from xfuse.parallel.vae_decode import ParallelVAEDecode, _merged_moments, band_rows, check_decoder


@pytest.fixture(scope="module")
def vae():
    return tiny_vae(tiny_vae_config(64, scaling_factor=0.13025), seed=0)


@pytest.mark.parametrize("rows,parts,sizes", [(16, 2, [8, 8]), (125, 4, [32, 31, 31, 31]), (5, 4, [2, 1, 1, 1])])
def test_bands_are_tensor_splits_rows(rows, parts, sizes):
    bands = band_rows(rows, parts)
    assert [b.stop - b.start for b in bands] == sizes
    assert [tuple(t.shape)[0] for t in torch.arange(rows).tensor_split(parts)] == sizes
    assert (
        bands[0].start == 0 and bands[-1].stop == rows and all(a.stop == b.start for a, b in itertools.pairwise(bands))
    )


def test_merged_moments_are_the_whole_tensors():
    """Bands of different sizes and far-apart means: the merge equals var_mean of the concatenation (float64)."""
    generator = torch.Generator().manual_seed(0)
    bands = [torch.randn(2, 3, n, generator=generator, dtype=torch.float64) * (i + 1) + 10 * i for i, n in
             enumerate((7, 1, 12))]  # fmt: skip
    stats = []
    for band in bands:
        var, mean = torch.var_mean(band, dim=-1, correction=0)
        count = torch.full_like(mean, band.shape[-1])
        stats.append(torch.stack([count, mean, var * count], dim=-1))
    mean, var = _merged_moments(stats)
    expected_var, expected_mean = torch.var_mean(torch.cat(bands, dim=-1), dim=-1, correction=0)
    torch.testing.assert_close(mean, expected_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, expected_var, rtol=1e-12, atol=1e-12)


def test_one_rank_is_diffusers_decode(vae):
    latents = torch.randn(2, 4, 9, 7, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = vae.decode(latents, return_dict=False)[0]
    image = ParallelVAEDecode(vae, ranks=[0], rank=0, channels=None).decode(latents, tuple(latents.shape))
    assert (image - expected).abs().max().item() <= 1e-5
    assert "forward" not in vars(vae.decoder.conv_norm_out)  # the norms' own forward is back
    assert not vae.decoder.conv_in._forward_pre_hooks and not vae.decoder.conv_in._forward_hooks


def _strided(vae):
    vae.decoder.conv_out.stride = (2, 2)


def _sliced_attention(vae):
    vae.decoder.mid_block.attentions[0].set_processor(SlicedAttnProcessor(slice_size=1))


def _transposed_upsampler(vae):
    vae.decoder.up_blocks[0].upsamplers[0].use_conv_transpose = True


def _unknown_module(vae):
    vae.decoder.conv_act = torch.nn.GELU()


REFUSALS = [
    (_strided, "vae.decoder.conv_out", "stride"),
    (_sliced_attention, "vae.decoder.mid_block.attentions.0", "SlicedAttnProcessor"),
    (_transposed_upsampler, "vae.decoder.up_blocks.0.upsamplers.0", "nearest x2"),
    (_unknown_module, "vae.decoder.conv_act", "GELU is not a module"),
]


@pytest.mark.parametrize("change,name,reason", REFUSALS, ids=[c[0].__name__.strip("_") for c in REFUSALS])
def test_decoders_the_bands_cannot_run_exactly_are_refused_by_name(vae, change, name, reason):
    changed = copy.deepcopy(vae)
    change(changed)
    with pytest.raises(ValueError) as e:
        check_decoder(changed)
    assert f"cannot run {name} exactly" in str(e.value) and reason in str(e.value)


def test_the_default_attention_processor_is_accepted(vae):
    changed = copy.deepcopy(vae)
    changed.decoder.mid_block.attentions[0].set_processor(AttnProcessor2_0())
    check_decoder(changed)


# ---------------------------------------------------------------------------------------- Wan's causal 3-D VAE
def _first(vae, kind: str):
    """The first module of class ``kind`` in ``vae.decoder`` and its name there (Wan 2.1's up blocks hold
    ``upsamplers``, Wan 2.2's residual ones an ``upsampler``)."""
    return next((name, module) for name, module in vae.decoder.named_modules() if type(module).__name__ == kind)


def _strided_causal(vae):
    vae.decoder.conv_in.stride = (1, 2, 1)
    return "conv_in"


def _rms_over_rows(vae):
    vae.decoder.norm_out.channel_first = False
    return "norm_out"


def _downsampler(vae):
    name, resample = _first(vae, "WanResample")
    resample.mode = "downsample2d"
    return name


def _bilinear(vae):
    name, upsample = _first(vae, "WanUpsample")
    upsample.mode = "bilinear"
    return name


def _attention_outside_the_mid_block(vae):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock

    vae.decoder.up_blocks[1].attention = WanAttentionBlock(8)
    return "up_blocks.1.attention"


def _unknown_activation(vae):
    vae.decoder.conv_act = torch.nn.GELU()
    return "conv_act"


WAN_REFUSALS = [
    (_strided_causal, "stride"),
    (_rms_over_rows, "the last dimension"),
    (_downsampler, "'downsample2d'"),
    (_bilinear, "nearest x2"),
    (_attention_outside_the_mid_block, "outside the mid block"),
    (_unknown_activation, "GELU is not a module"),
]


@pytest.mark.parametrize("change,reason", WAN_REFUSALS, ids=[c[0].__name__.strip("_") for c in WAN_REFUSALS])
@pytest.mark.parametrize("preset", ["wan-tiny", "wan2.2-ti2v-tiny"])
def test_wan_decoders_the_bands_cannot_run_exactly_are_refused_by_name(preset, change, reason):
    """The released layouts pass ``check_wan_decoder``; each change is refused naming the module and why."""
    from tests.support.vae_fns import wan_vae
    from xfuse.parallel.video_vae_decode import check_wan_decoder

    check_wan_decoder(wan_vae(preset))
    changed = copy.deepcopy(wan_vae(preset))
    name = change(changed)
    with pytest.raises(ValueError) as e:
        check_wan_decoder(changed)
    assert f"cannot run vae.decoder.{name} exactly" in str(e.value) and reason in str(e.value), str(e.value)
