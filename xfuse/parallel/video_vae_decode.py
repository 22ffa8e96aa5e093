"""Exact band-parallel decode of Wan's causal 3-D VAE (``AutoencoderKLWan``, Wan 2.1's and Wan 2.2's): diffusers' own
decoder run on row bands of every latent frame, one band per rank, as the image decode runs ``AutoencoderKL``'s
(``xfuse.parallel.vae_decode``: the bands, the messages, the scatter and the gather are its).

Each rank runs diffusers' frame-by-frame loop (``AutoencoderKLWan._decode``: one latent frame at a time through the
decoder, each causal convolution keeping the last frames of its input in a feature cache) on its band. The cache of a
band holds the band's own rows, so time costs nothing; only what reads other rows talks to the other ranks, changed
from outside for the duration of one decode:

* **Causal 3-D convolutions** (``WanCausalConv3d``, 3 x 3 x 3: a 1-row halo): the image decode's halo exchange, with
  the rows sent as the convolution reads them, its cached frames in front and its causal zero frames before those; the
  band's convolution runs as diffusers calls it and the ``p`` output rows at each inner edge are recomputed from the
  neighbour's rows. The 1 x 1 x 1 shortcuts and the (3, 1, 1) time convolution of the up-samplers read no other row.
* **The up-samplers' 3 x 3 ``Conv2d``** (after nearest-exact x2 interpolation, which is per pixel at an integer
  factor: a band of r rows becomes 2r): the image decode's halo exchange as it is.
* **The mid block's attention** (``WanAttentionBlock``: one head over every position of a frame): its forward runs
  with the keys and values of every band, in row order.
* **Per position**: Wan's RMS norm (over channels), SiLU, Wan 2.2's ``DupUp3D`` shortcut and ``unpatchify``, the
  clamp; the decoder has no GroupNorm, so no statistic is merged.

A decoder with any other module is refused by name (:func:`check_wan_decoder`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from xfuse.comm.p2p import P2PChannels
from xfuse.parallel.vae_decode import VIDEO_BAND_DECODED_VAES, ParallelVAEDecode

# The decoder modules the bands run exactly, besides those the checks below look into: containers and per-position
# layers (class names: diffusers' import paths move).
_PER_POSITION = {
    "WanDecoder3d",
    "WanMidBlock",
    "WanUpBlock",
    "WanResidualUpBlock",
    "WanResidualBlock",
    "DupUp3D",
    "ModuleList",
    "Sequential",
    "Identity",
    "SiLU",
    "Dropout",
}


def check_wan_decoder(vae) -> None:
    """Raise ValueError naming the first module of ``vae.decoder`` (an ``AutoencoderKLWan``'s) that the band decode
    cannot run exactly."""

    def refuse(name: str, why: str) -> None:
        raise ValueError(f"the parallel VAE decode cannot run vae.decoder.{name} exactly: {why}")

    for name, module in vae.decoder.named_modules():
        kind = type(module).__name__
        if kind == "WanCausalConv3d":
            (kt, kh, kw), (pw, _, ph, _, pt, _) = module.kernel_size, module._padding
            if module.stride != (1, 1, 1) or module.dilation != (1, 1, 1):
                refuse(name, "a causal convolution with stride or dilation")
            if kh % 2 == 0 or ph != kh // 2 or pw != kw // 2 or pt != kt - 1:
                refuse(name, f"a {kt}x{kh}x{kw} causal convolution with padding {module._padding} changes the size")
        elif kind == "WanRMS_norm":
            if not module.channel_first:
                refuse(name, "an RMS norm over the last dimension (the rows' width), not the channels")
        elif kind == "WanResample":
            if module.mode not in ("upsample2d", "upsample3d"):
                refuse(name, f"a resampler in mode {module.mode!r} (the bands run upsample2d and upsample3d)")
        elif kind == "WanUpsample":
            if tuple(module.scale_factor) != (2.0, 2.0) or module.mode not in ("nearest", "nearest-exact"):
                refuse(name, f"a {module.mode} up-sampler by {module.scale_factor} (the bands run nearest x2)")
        elif kind == "Conv2d":
            (kh, kw), (ph, pw) = module.kernel_size, module.padding
            if module.stride != (1, 1) or module.dilation != (1, 1) or module.padding_mode != "zeros":
                refuse(name, "a convolution with stride, dilation or non-zero padding")
            if kh % 2 == 0 or ph != kh // 2 or pw != kw // 2:
                refuse(name, f"a {kh}x{kw} convolution with padding {module.padding} does not keep the size")
        elif kind == "WanAttentionBlock":
            if not name.startswith("mid_block."):
                refuse(name, "attention outside the mid block")
        elif kind not in _PER_POSITION:
            refuse(name, f"{kind} is not a module the band decode knows")


class ParallelWanDecode(ParallelVAEDecode):
    """One rank's share of the band decode of an ``AutoencoderKLWan`` (module docstring).

    Collective over ``ranks`` as :class:`~xfuse.parallel.vae_decode.ParallelVAEDecode`: the first rank passes the
    (B, z_dim, frames, h, w) latents to ``decode`` and gets ``vae.decode(latents).sample``, (B, 3, 1 + 4 (frames - 1),
    H, W), back; the others pass ``None``. Every rank holds the VAE's weights; each keeps its own feature cache (the
    VAE's, cleared before and after a decode, as diffusers does)."""

    check = staticmethod(check_wan_decoder)

    def latent_shape(self, batch: int, frames: int, rows: int, cols: int) -> tuple[int, ...]:
        """(B, z_dim, latent frames, h, w)."""
        return (batch, self.vae.config.z_dim, frames, rows, cols)

    def _decode_band(self, band: torch.Tensor) -> torch.Tensor:
        # Mirrors ``diffusers.AutoencoderKLWan._decode`` (tiling off: the bands are the exact alternative) on the
        # band: latent frame by latent frame through the decoder, the causal caches carrying the band's rows.
        vae = self.vae
        vae.clear_cache()
        x = vae.post_quant_conv(band)  # (B, z, frames, rows, w)
        frames = []
        for i in range(x.shape[2]):
            vae._conv_idx = [0]
            frames.append(
                vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
            )
        out = torch.cat(frames, dim=2)  # (B, C, 1 + 4 (frames - 1), 8 rows, 8 w)
        del frames
        if vae.config.patch_size is not None:  # Wan 2.2: 2 x 2 patches of the frames back into pixels
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=vae.config.patch_size)  # (B, 3, T, 16 rows, 16 w)
        out = torch.clamp(out, min=-1.0, max=1.0)
        vae.clear_cache()
        return out

    @contextlib.contextmanager
    def _installed(self) -> Iterator[None]:
        """The decoder's halo convolutions and attention made band-aware for the duration of one decode."""
        hooks, attentions = [], []
        try:
            for module in self.vae.decoder.modules():
                kind = type(module).__name__
                if kind in ("Conv2d", "WanCausalConv3d") and self._halo_of(module) > 0:
                    hooks.append(module.register_forward_pre_hook(self._post_halo))
                    hooks.append(module.register_forward_hook(self._edge_rows))
                elif kind == "WanAttentionBlock":
                    attentions.append(module)
                    module.forward = self._attention_of(module)  # the instance's own, removed below
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for module in attentions:
                del module.forward

    # ------------------------------------------------------------------------------- the causal 3-D convolutions
    def _halo_of(self, conv: Any) -> int:
        if type(conv).__name__ == "WanCausalConv3d":
            return conv._padding[2]  # (w, w, h, h, 2 * time, 0): the rows' zero padding
        return super()._halo_of(conv)

    def _input_rows(self, conv: Any, args: tuple, rows: slice) -> torch.Tensor:
        if type(conv).__name__ != "WanCausalConv3d":
            return super()._input_rows(conv, args, rows)
        # Mirrors ``diffusers.models.autoencoders.autoencoder_kl_wan.WanCausalConv3d.forward`` in time: the cached
        # frames in front of the input, causal zero frames before them (the rows and columns: not padded here).
        x, cache = args[0], (args[1] if len(args) > 1 else None)
        part = x[..., rows, :]  # (B, C, T, r, W)
        zero_frames = conv._padding[4]
        if cache is not None and zero_frames > 0:
            part = torch.cat([cache[..., rows, :].to(x.device), part], dim=2)  # (B, C, cached + T, r, W)
            zero_frames -= cache.shape[2]
        return F.pad(part, (0, 0, 0, 0, zero_frames, 0))  # (B, C, T + kt - 1, r, W)

    def _convolve_rows(self, conv: Any, stacked: torch.Tensor) -> torch.Tensor:
        if type(conv).__name__ != "WanCausalConv3d":
            return super()._convolve_rows(conv, stacked)
        # (B, C, T + kt - 1, r + 2p, W) -> (B, C_out, T, r, W): time and rows given, the columns zero-padded
        width_only = (0, 0, conv._padding[0])
        return F.conv3d(stacked, conv.weight, conv.bias, conv.stride, width_only, conv.dilation, conv.groups)

    # --------------------------------------------------------------------------------------- the mid-block attention
    def _attention_of(self, block: Any):
        """``block``'s forward with the keys and values of every band."""

        def forward(x: torch.Tensor) -> torch.Tensor:
            # Mirrors ``diffusers.models.autoencoders.autoencoder_kl_wan.WanAttentionBlock.forward``; the keys and
            # values gathered from every band between the projection and the attention.
            identity = x
            batch, channels, time, rows, width = x.shape
            x = x.permute(0, 2, 1, 3, 4).reshape(batch * time, channels, rows, width)  # (B T, C, r, W)
            x = block.norm(x)
            qkv = block.to_qkv(x)  # (B T, 3 C, r, W)
            qkv = qkv.reshape(batch * time, 1, channels * 3, -1)  # (B T, 1, 3 C, r W)
            qkv = qkv.permute(0, 1, 3, 2).contiguous()  # (B T, 1, r W, 3 C)
            q, k, v = qkv.chunk(3, dim=-1)  # (B T, 1, r W, C) each
            k, v = self._every_band(k, dim=2), self._every_band(v, dim=2)  # (B T, 1, H W, C) each
            x = F.scaled_dot_product_attention(q, k, v)  # (B T, 1, r W, C)
            x = x.squeeze(1).permute(0, 2, 1).reshape(batch * time, channels, rows, width)  # (B T, C, r, W)
            x = block.proj(x)
            x = x.view(batch, time, channels, rows, width).permute(0, 2, 1, 3, 4)  # (B, C, T, r, W)
            return x + identity

        return forward


def band_decoder(vae, *, ranks: list[int], rank: int, channels: P2PChannels | None) -> ParallelVAEDecode:
    """This rank's share of the band decode of ``vae``, by its class: a causal 3-D VAE's (:class:`ParallelWanDecode`)
    or an image VAE's (:class:`~xfuse.parallel.vae_decode.ParallelVAEDecode`); ValueError naming a module the bands
    cannot run exactly."""
    decode = ParallelWanDecode if type(vae).__name__ in VIDEO_BAND_DECODED_VAES else ParallelVAEDecode
    return decode(vae, ranks=ranks, rank=rank, channels=channels)
