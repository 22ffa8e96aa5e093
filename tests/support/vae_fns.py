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
    with torch.no_grad():
        expected = vae.decode(latents, return_dict=False)[0]
    return image, expected


def _own_band_moments(index):
    def moments(stats):
        count, mean, m2 = stats[index].unbind(-1)
        return mean, m2 / count

    return moments
