"""Rank functions for the parallel VAE decode tests: each family's VAE decoded over bands of the latent on a subset of
a world's ranks, against diffusers' own ``vae.decode`` of the whole latent."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist


@functools.lru_cache(maxsize=8)
def family_vae(preset: str):
    """The VAE of a preset (each family's tiny VAE, or the shipped ``shapes`` model's), built once per rank."""
    from xfuse.families.registry import load_pipeline

    return load_pipeline(preset).vae


def latents_for(vae, batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """Scaled latents as a pipeline hands them to ``vae.decode``: (B, latent channels, height/8, width/8)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, vae.config.latent_channels, height // 8, width // 8)
    return torch.randn(shape, generator=generator)


def band_decode(preset, *, ranks, height, width, batch=1, per_band_norm=False, timeout_s=30.0):
    """Decode on ``ranks`` (the others return None): on the first of them, ``(parallel image, diffusers' image)``."""
    from xfuse.comm.p2p import P2PChannels
    from xfuse.parallel import vae_decode
    from xfuse.parallel.vae_decode import ParallelVAEDecode

    rank = dist.get_rank()
    if rank not in ranks:
        return None
    vae = family_vae(preset)
    channels = P2PChannels(rank=rank, timeout_s=timeout_s, max_inflight=2, device="cpu")
    decoder = ParallelVAEDecode(vae, ranks=list(ranks), rank=rank, channels=channels)
    latents = latents_for(vae, batch, height, width)
    original = vae_decode._merged_moments
    if per_band_norm:  # the injected approximation: each band normalised by its own statistics
        vae_decode._merged_moments = _own_band_moments(ranks.index(rank))
    try:
        image = decoder.decode(latents if rank == ranks[0] else None, tuple(latents.shape))
    finally:
        vae_decode._merged_moments = original
    if rank != ranks[0]:
        return None
    return image, diffusers_decode(preset, batch, height, width)


@functools.lru_cache(maxsize=4)
def diffusers_decode(preset: str, batch: int, height: int, width: int) -> torch.Tensor:
    """diffusers' ``vae.decode`` of ``latents_for``'s latents, once per rank for each (preset, size): the cases on 2, 3
    and 4 ranks decode the same image (a 1,024 px decode is seconds of one core)."""
    vae = family_vae(preset)
    with torch.no_grad():
        return vae.decode(latents_for(vae, batch, height, width), return_dict=False)[0]


def _own_band_moments(index):
    def moments(stats):
        count, mean, m2 = stats[index].unbind(-1)
        return mean, m2 / count

    return moments


# ------------------------------------------------------------------------------------------ Wan's causal 3-D VAE
@functools.lru_cache(maxsize=4)
def wan_vae(preset: str):
    """A Wan preset's ``AutoencoderKLWan`` (``wan-tiny``: Wan 2.1's layout; ``wan2.2-ti2v-tiny``: Wan 2.2's residual,
    2 x 2-patch layout), built alone (no transformer or text encoder) and once per rank."""
    from diffusers import AutoencoderKLWan

    from xfuse.families.wan.presets import preset_vae_config

    config = {k: v for k, v in preset_vae_config(preset).items() if k != "_class_name"}
    torch.manual_seed(0)
    return AutoencoderKLWan(**config).eval()


def video_latents_for(vae, batch: int, frames: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Latents as Wan's pipeline hands them to ``vae.decode``: (B, z_dim, latent frames, rows, cols)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((batch, vae.config.z_dim, frames, rows, cols), generator=generator)


def video_band_decode(preset, *, ranks, frames, rows, cols, batch=1, approximation=None, timeout_s=30.0):
    """Decode a Wan VAE's latents on ``ranks`` (the others return None): on the first of them, ``(parallel video,
    diffusers' video)``. ``approximation``: ``"no halo"`` (each band's convolutions read zeros beyond its rows) or
    ``"own keys"`` (each band's attention sees its own keys and values only), injected to show the test catches it."""
    from xfuse.comm.p2p import P2PChannels
    from xfuse.parallel.video_vae_decode import ParallelWanDecode

    rank = dist.get_rank()
    if rank not in ranks:
        return None
    vae = wan_vae(preset)
    channels = P2PChannels(rank=rank, timeout_s=timeout_s, max_inflight=2, device="cpu")
    decoder = ParallelWanDecode(vae, ranks=list(ranks), rank=rank, channels=channels)
    if approximation == "no halo":  # the halos still travel (the ranks stay in step); the edge rows keep their zeros
        decoder._convolve_rows = lambda conv, stacked: _own_rows_only(decoder, conv, stacked)
    elif approximation == "own keys":
        decoder._every_band = lambda tokens, dim: tokens
    latents = video_latents_for(vae, batch, frames, rows, cols)
    video = decoder.decode(latents if rank == ranks[0] else None, tuple(latents.shape))
    if rank != ranks[0]:
        return None
    return video, diffusers_video_decode(preset, batch, frames, rows, cols)


@functools.lru_cache(maxsize=4)
def diffusers_video_decode(preset: str, batch: int, frames: int, rows: int, cols: int) -> torch.Tensor:
    """diffusers' ``vae.decode`` of ``video_latents_for``'s latents, once per rank for each (preset, clip): as
    ``diffusers_decode``."""
    vae = wan_vae(preset)
    with torch.no_grad():
        return vae.decode(video_latents_for(vae, batch, frames, rows, cols), return_dict=False)[0]


def _own_rows_only(decoder, conv, stacked):
    """The edge rows a band computes from zero halos: the injected "no halo" approximation."""
    halo = decoder._halo_of(conv)
    zeros = stacked.clone()
    if decoder.index > 0:
        zeros[..., :halo, :] = 0
    if decoder.index < decoder.degree - 1:
        zeros[..., -halo:, :] = 0
    return type(decoder)._convolve_rows(decoder, conv, zeros)


def video_band_costs(preset, *, ranks, frames, rows, cols):
    """Decode on ``ranks`` of the world under the counters ``xfuse.perf.video_vae`` traces with, on real CPU tensors:
    each rank's (activation peak, FLOPs, bytes sent, communicating layers); None on the other ranks."""
    from torch.utils.flop_counter import FlopCounterMode

    from xfuse.comm.p2p import P2PChannels
    from xfuse.parallel.video_vae_decode import ParallelWanDecode
    from xfuse.perf.activations import LiveBytes

    rank = dist.get_rank()
    if rank not in ranks:
        return None
    vae = wan_vae(preset)
    channels = P2PChannels(rank=rank, timeout_s=60, max_inflight=2, device="cpu")
    decoder = ParallelWanDecode(vae, ranks=list(ranks), rank=rank, channels=channels)
    latents = video_latents_for(vae, 1, frames, rows, cols)
    live, flops = LiveBytes(), FlopCounterMode(display=False)
    with torch.no_grad(), flops, live:
        decoder.decode(latents if rank == ranks[0] else None, tuple(latents.shape))
    sent = sum(channels.counters.sent_bytes.values())
    return live.peak, flops.get_total_flops(), sent, decoder._layer
