"""The traced decode of a causal 3-D VAE (``xfuse.perf.video_vae``): a long clip's shares, extended from two short
clips, equal the shares traced whole, for Wan 2.1's and Wan 2.2's layouts, serial and in bands; a rank's FLOPs are
those ``torch.utils.flop_counter`` counts on diffusers' own ``AutoencoderKLWan.decode`` of real tensors."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.support.vae_fns import video_latents_for, wan_vae
from xfuse.perf import video_vae
from xfuse.perf.video_vae import traced_decode_ranks


@pytest.mark.parametrize("preset,ranks", [("wan-tiny", 1), ("wan-tiny", 3), ("wan2.2-ti2v-tiny", 2)])
def test_a_long_clip_extended_from_two_short_ones_equals_its_trace(monkeypatch, preset, ranks):
    """7 latent frames (25 frames): extended from 3 and 4 (``FIT_FRAMES``) against traced whole: every rank's peak,
    FLOPs, traffic and messages equal (serial; a middle band's two neighbours; Wan 2.2's layout)."""
    extended = traced_decode_ranks(preset, frames=7, rows=7, cols=5, ranks=ranks)
    monkeypatch.setattr(video_vae, "FIT_FRAMES", 100)
    video_vae._shares.cache_clear()
    try:
        whole = traced_decode_ranks(preset, frames=7, rows=7, cols=5, ranks=ranks)
    finally:
        video_vae._shares.cache_clear()
    assert len(extended) == len(whole) == ranks
    for a, b in zip(extended, whole, strict=True):
        assert dataclasses.astuple(a) == dataclasses.astuple(b)
    assert all(share.exchanges for share in whole) is (ranks > 1)


def test_the_serial_flops_are_diffusers_decodes():
    vae = wan_vae("wan-tiny")
    latents = video_latents_for(vae, 1, 5, 6, 4)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        vae.decode(latents)
    (serial,) = traced_decode_ranks("wan-tiny", frames=5, rows=6, cols=4)
    assert serial.flops == counter.get_total_flops() > 0
