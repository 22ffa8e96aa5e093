"""Exact patch-parallel VAE decode: diffusers' ``AutoencoderKL`` decoder run on row bands of the latent, one per rank.

The latent's rows are cut into one contiguous band per rank (``torch.tensor_split``'s rule: uneven bands are fine);
each rank runs diffusers' own decoder modules on its band, and only the layers that read other rows talk to the other
ranks. They are changed from outside, for the duration of one decode, and nothing else is:

* **3×3 convolutions** (every ``Conv2d`` whose kernel is taller than one row, halo ``p = k // 2``): a forward pre-hook
  posts the exchange of the band's first and last ``p`` rows with its neighbours; the band's convolution runs as
  diffusers calls it (its zero padding is right at the image's edges) while they travel; a forward hook then
  recomputes the ``p`` output rows at each inner edge from the neighbour's rows and the band's own, so every output row
  is computed from the rows the whole-image convolution reads. No band-sized copy is made.
* **GroupNorm**: the mean and variance of each (image, group) are merged from every band's (Chan et al.'s parallel
  variance: count, mean and squared deviations in float64), not taken per band. This is what tiling and early DistVAE
  approximate; here it is the whole image's statistic.
* **Mid-block self-attention**: forward hooks on ``to_k`` and ``to_v`` gather every band's keys and values in row
  order, so each band's queries attend to the whole image (diffusers' own processor computes the softmax:
  ``diffusers.models.attention_processor.AttnProcessor2_0.__call__`` projects the keys and values once each).
* **Up-sampling** (nearest, ×2) is per pixel: a band of r rows becomes 2r rows, so the bands stay aligned.

Rank 0 (the world's output rank) sends each rank its band of the latent and receives the decoded bands back; the
decoded image exists whole only there (the pipeline's post-processing and PNG need it). Messages go over P2P channels
(the same bounded buffers, waits and failure reports as the rest: kinds ``vae latent``, ``vae halo``, ``vae norm``,
``vae kv``, ``vae image``); in a decode's reports "step" counts the decoder's communicating layers and "patch" is the
band of the sending rank.

A decoder with any module this does not know is refused by name (:func:`check_decoder`) rather than decoded
approximately.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from xfuse.comm.p2p import P2PChannels, Recv, Send
from xfuse.errors import ConfigError
from xfuse.parallel.sequence import token_chunks

if TYPE_CHECKING:
    from xfuse.config import ParallelConfig

# vae_parallel: auto decodes over the world from this many image pixels on. Measured (benchmarks/bench_vae.py, the
# shipped VAE, 2 ranks over gloo, docs/performance.md): 0.70x of rank 0 alone at 256 x 256 px (the messages of ~50
# layers cost more than half a small decode), 1.08x at 384 x 384, 1.55x at 512 x 512. A wider VAE gains sooner.
VAE_PARALLEL_MIN_PIXELS = 384 * 384
# The same for a clip, per frame (its messages and its work both grow with its frames). Measured (benchmarks/
# bench_vae.py --vae wan2.1 --frames 5: the released Wan 2.1 VAE's widths, 2 ranks over gloo, docs/performance.md):
# 0.97x of rank 0 alone at 64 x 64 px, 1.25x at 96 x 96, 1.87x at 192 x 192; a wide 3-D VAE gains early.
VIDEO_VAE_PARALLEL_MIN_PIXELS = 96 * 96

# The decoder's modules the bands are proven exact for (by class name: diffusers' import paths move); any other
# module is refused. Convolutions, norms and attention get the treatment above; the rest is per pixel.
_PER_PIXEL = {"SiLU", "Dropout", "Linear", "ModuleList", "Decoder", "UNetMidBlock2D", "UpDecoderBlock2D"}
_ATTENTION_PROCESSORS = {"AttnProcessor2_0", "AttnProcessor"}  # softmax over the keys they are given


# The diffusers VAE classes with AutoencoderKL's decoder, which the bands run (``check_decoder`` checks the modules):
# FLUX.2's AutoencoderKLFlux2 adds only a BatchNorm whose running statistics its pipelines (de)normalise the latents
# with, outside ``decode``.
IMAGE_BAND_DECODED_VAES = ("AutoencoderKL", "AutoencoderKLFlux2")
# The causal 3-D VAEs the bands run (``xfuse.parallel.video_vae_decode``); Qwen-Image's (AutoencoderKLQwenImage, a
# copy of Wan's under other class names, decoding one frame) decodes on rank 0.
VIDEO_BAND_DECODED_VAES = ("AutoencoderKLWan",)
BAND_DECODED_VAES = IMAGE_BAND_DECODED_VAES + VIDEO_BAND_DECODED_VAES


def world_decodes(parallel: ParallelConfig, world_size: int) -> bool:
    """Whether a call may decode over the world at all: ``parallel.vae_parallel`` not ``off`` and more than one
    rank (which VAEs and requests then do: ``vae_on_every_rank``, ``decodes_in_parallel``)."""
    return parallel.vae_parallel != "off" and world_size > 1


def vae_on_every_rank(parallel: ParallelConfig, world_size: int, vae_class: str | None) -> bool:
    """Whether every rank loads the VAE (``vae_class``: its diffusers class name; ``None``: the model has none) to
    decode its band when a call decodes in parallel: unless ``parallel.vae_parallel`` is ``off``, the world has one
    rank or the VAE is not one the bands run (``BAND_DECODED_VAES``), where rank 0 alone holds it."""
    return world_decodes(parallel, world_size) and vae_class in BAND_DECODED_VAES


def decodes_in_parallel(
    parallel: ParallelConfig, world_size: int, height: int, width: int, latent_rows: int, *, video: bool = False
) -> bool:
    """Whether a ``height`` x ``width`` px request (``latent_rows`` rows of latent; ``video``: a clip's frames) is
    decoded over every rank (``parallel.vae_parallel``). ``on`` with fewer latent rows than ranks is refused
    (:class:`ConfigError`): a band needs at least one row."""
    if not world_decodes(parallel, world_size):  # (the callers hold a VAE of BAND_DECODED_VAES)
        return False
    if latent_rows < world_size:
        if parallel.vae_parallel == "on":
            raise ConfigError(
                "parallel.vae_parallel",
                f"is on, but the latent has {latent_rows} rows for {world_size} ranks (one band of rows each): "
                "use auto or off, or a taller image",
            )
        return False
    least = VIDEO_VAE_PARALLEL_MIN_PIXELS if video else VAE_PARALLEL_MIN_PIXELS
    return parallel.vae_parallel == "on" or height * width >= least


def band_rows(latent_rows: int, parts: int) -> list[slice]:
    """The latent rows of each rank's band: ``parts`` contiguous bands, the first ``latent_rows % parts`` one row
    taller."""
    return list(token_chunks(slice(0, latent_rows), parts))


def check_decoder(vae) -> None:
    """Raise ValueError naming the first module of ``vae.decoder`` that the band decode cannot run exactly."""

    def refuse(name: str, why: str) -> None:
        where = f"vae.decoder.{name}" if name else "vae.decoder"
        raise ValueError(f"the parallel VAE decode cannot run {where} exactly: {why}")

    for name, module in vae.decoder.named_modules():
        kind = type(module).__name__
        if kind == "Conv2d":
            (kh, kw), (ph, pw) = module.kernel_size, module.padding
            if module.stride != (1, 1) or module.dilation != (1, 1) or module.padding_mode != "zeros":
                refuse(name, "a convolution with stride, dilation or non-zero padding")
            if kh % 2 == 0 or ph != kh // 2 or pw != kw // 2:
                refuse(name, f"a {kh}x{kw} convolution with padding {module.padding} does not keep the size")
        elif kind == "ResnetBlock2D":
            if module.upsample is not None or module.downsample is not None or module.time_emb_proj is not None:
                refuse(name, "a resnet block that resamples or takes a time embedding")
        elif kind == "Upsample2D":
            if module.use_conv_transpose or not module.interpolate or module.norm is not None:
                refuse(name, "an up-sampler other than nearest x2 interpolation and a convolution")
        elif kind == "Attention":
            processor = type(module.processor).__name__
            if processor not in _ATTENTION_PROCESSORS or module.spatial_norm is not None:
                refuse(name, f"attention with processor {processor} or a spatial norm")
            if not name.startswith("mid_block."):
                refuse(name, "self-attention outside the mid block")
        elif kind not in _PER_PIXEL and kind != "GroupNorm":
            refuse(name, f"{kind} is not a module the band decode knows")


def _merged_moments(stats: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased) variance of the union of the bands from each band's (count, mean, squared deviations), each
    (B, G, 3) float64: Chan, Golub and LeVeque's pairwise update, written for all bands at once."""
    parts = torch.stack(stats)  # (bands, B, G, 3)
    count, mean, m2 = parts.unbind(-1)  # (bands, B, G) each
    total = count.sum(0)  # (B, G)
    merged_mean = (count * mean).sum(0) / total
    merged_m2 = (m2 + count * (mean - merged_mean) ** 2).sum(0)
    return merged_mean, merged_m2 / total


class ParallelVAEDecode:
    """One rank's share of the band decode (module docstring).

    Args:
        vae: the pipeline's ``AutoencoderKL`` (every rank holds the same weights); checked by :func:`check_decoder`.
        ranks: global ranks of the world, by band (``ranks[0]`` holds the latent and gets the image).
        rank: this rank's global rank.
        channels: this rank's P2P channels to every other rank of ``ranks`` (``None`` with a single rank).
    """

    check = staticmethod(check_decoder)  # raises ValueError naming a module the bands cannot run exactly

    def __init__(self, vae, *, ranks: list[int], rank: int, channels: P2PChannels | None):
        self.check(vae)
        if len(ranks) > 1 and channels is None:
            raise ValueError("a parallel VAE decode over several ranks needs their P2P channels")
        self.vae, self.ranks, self.channels = vae, list(ranks), channels
        self.index = self.ranks.index(rank)
        self._rows: list[int] = []  # latent rows of every band in the current decode
        self._layer = 0  # communicating layers so far in the current decode (the "step" of its messages)
        self._halo = None  # the posted halo exchange of the convolution running now (send and receive handles)

    @property
    def degree(self) -> int:
        return len(self.ranks)

    def latent_shape(self, batch: int, frames: int, rows: int, cols: int) -> tuple[int, ...]:
        """The latents ``decode`` takes for ``batch`` images of ``rows`` x ``cols`` latent pixels: (B, C, h, w)
        (``frames``: 1 for an image VAE)."""
        return (batch, self.vae.config.latent_channels, rows, cols)

    def _exchange(self, sends: list[Send], recvs: list[Recv] | None = None):
        assert self.channels is not None  # __init__: more than one rank has channels, and one rank sends nothing
        return self.channels.exchange(sends, recvs or [])

    # ------------------------------------------------------------------------------------------------ the decode
    def decode(self, latents: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
        """``vae.decode(latents)``'s sample, exactly, with the work split over the ranks.

        Collective over ``ranks``: the first rank passes the scaled latents (``shape``: (B, C, h, w); a video's
        (B, C, frames, h, w)), the others ``None`` and the same ``shape``. Returns the decoded (B, 3, 8h, 8w) image
        (a video's frames: (B, 3, T, H, W)) on the first rank, ``None`` elsewhere."""
        bands = band_rows(shape[-2], self.degree)
        if min(band.stop - band.start for band in bands) < 1:
            raise ValueError(f"a parallel VAE decode over {self.degree} ranks needs >= {self.degree} latent rows")
        self._rows, self._layer = [band.stop - band.start for band in bands], 0
        dtype = self.vae.dtype
        band = self._scatter(latents, bands, shape, dtype)
        with torch.no_grad(), self._installed():
            decoded = self._decode_band(band)
        image = self._gather_image(decoded)
        if self.channels is not None:  # (after a failure the buffers stay: the channels are dead anyway)
            self.channels.reset_buffers()  # the K/V and image buffers are the size of the request: not kept
        return image

    def _decode_band(self, band: torch.Tensor) -> torch.Tensor:
        """The decoder run on this rank's band of the latent (its layers band-aware: ``_installed``)."""
        # Mirrors ``diffusers.AutoencoderKL._decode`` (tiling off: the bands are the exact alternative).
        if self.vae.post_quant_conv is not None:
            band = self.vae.post_quant_conv(band)
        return self.vae.decoder(band)

    def _scatter(self, latents, bands: list[slice], shape, dtype) -> torch.Tensor:
        """This rank's band of the latent: the first rank cuts and sends the others theirs."""
        mine = bands[self.index]
        if self.index == 0:
            latents = latents.to(dtype)
            sends = [
                Send(self.ranks[j], "vae latent", latents[..., bands[j], :].contiguous(), self._layer, j)
                for j in range(1, self.degree)
            ]
            handles = self._exchange(sends)[0] if sends else []
            for handle in handles:
                handle.wait()
            return latents[..., mine, :]
        band_shape = (*shape[:-2], mine.stop - mine.start, shape[-1])  # (B, C, [frames,] rows, w)
        (recv,) = self._exchange([], [Recv(self.ranks[0], "vae latent", band_shape, dtype, 0, self.index)])[1]
        with recv as received:
            return received.clone()

    def _gather_image(self, image: torch.Tensor) -> torch.Tensor | None:
        """The decoded bands on the first rank, in row order (rows: the second-last dimension); every other rank sends
        its own."""
        scale = image.shape[-2] // self._rows[self.index]  # pixel rows per latent row
        self._layer += 1
        if self.index != 0:
            (send,) = self._exchange([Send(self.ranks[0], "vae image", image.contiguous(), self._layer, self.index)])[0]
            send.wait()
            return None
        *lead, _, width = image.shape  # (B, 3, [frames,] band rows, W)
        recvs = [
            Recv(self.ranks[j], "vae image", (*lead, self._rows[j] * scale, width), image.dtype, self._layer, j)
            for j in range(1, self.degree)
        ]
        handles = self._exchange([], recvs)[1] if recvs else []
        parts = [image] + [handle.wait() for handle in handles]
        whole = torch.cat(parts, dim=-2)  # (B, 3, [frames,] H, W)
        for handle in handles:
            handle.release()
        return whole

    # ------------------------------------------------------------------------------------- the layers' messages
    @contextlib.contextmanager
    def _installed(self) -> Iterator[None]:
        """The decoder's convolutions, norms and attention made band-aware for the duration of one decode."""
        hooks, norms = [], []
        try:
            for module in self.vae.decoder.modules():
                kind = type(module).__name__
                if kind == "Conv2d" and module.kernel_size[0] > 1:
                    hooks.append(module.register_forward_pre_hook(self._post_halo))
                    hooks.append(module.register_forward_hook(self._edge_rows))
                elif kind == "GroupNorm":
                    norms.append(module)
                    module.forward = self._group_norm_of(module)  # the instance's own, removed below
                elif kind == "Attention":
                    hooks.append(module.to_k.register_forward_hook(self._all_tokens))
                    hooks.append(module.to_v.register_forward_hook(self._all_tokens))
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for module in norms:
                del module.forward

    def _post_halo(self, conv: Any, args: tuple) -> None:
        """Forward pre-hook of a convolution that reads p = k // 2 rows either side: post the exchange of the band's
        first and last p rows (as the convolution reads them: ``_input_rows``) with the neighbours; they travel while
        the band's own convolution runs."""
        halo, rows = self._halo_of(conv), args[0].shape[-2]
        if rows < halo:
            raise ValueError(f"a band of {rows} rows cannot lend a {halo}-row halo to its neighbours")
        i, self._layer = self.index, self._layer + 1
        sends, recvs = [], []
        for peer, rows_sent in ((i - 1, slice(0, halo)), (i + 1, slice(rows - halo, rows))):
            if 0 <= peer < self.degree:
                sent = self._input_rows(conv, args, rows_sent).contiguous()  # (B, C, [frames,] p, W)
                sends.append(Send(self.ranks[peer], "vae halo", sent, self._layer, i))
                recvs.append(Recv(self.ranks[peer], "vae halo", sent.shape, sent.dtype, self._layer, peer))
        self._halo = self._exchange(sends, recvs) if sends else None

    def _edge_rows(self, conv: Any, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """Forward hook of a halo convolution: the band's convolution read zeros beyond its first and last rows (its
        own padding); where a neighbour's rows lie there instead, recompute those p output rows from the received
        halo and the band's first (last) 2p rows — what the whole-image convolution computes for them."""
        halo, rows = self._halo_of(conv), args[0].shape[-2]
        if self._halo is None:
            return out
        send_handles, recv_handles = self._halo
        self._halo = None
        received = iter(recv_handles)

        def own(rows_read: slice) -> torch.Tensor:  # (B, C, [frames,] r, W) as the convolution reads them
            return self._input_rows(conv, args, rows_read)

        above = next(received) if self.index > 0 else None
        below = next(received) if self.index < self.degree - 1 else None
        if rows < 2 * halo:  # a band thinner than two halos: every row reads a neighbour's, so recompute it whole
            mine = own(slice(0, rows))
            zeros = mine.new_zeros(*mine.shape[:-2], halo, mine.shape[-1])  # beyond the image's edges

            def rows_of(handle):
                return zeros if handle is None else handle.wait()

            out = self._convolve_rows(conv, torch.cat([rows_of(above), mine, rows_of(below)], dim=-2))
        else:
            if above is not None:
                stacked = torch.cat([above.wait(), own(slice(0, 2 * halo))], dim=-2)  # (.., 3p, W)
                out[..., :halo, :] = self._convolve_rows(conv, stacked)
            if below is not None:
                stacked = torch.cat([own(slice(rows - 2 * halo, rows)), below.wait()], dim=-2)  # (.., 3p, W)
                out[..., rows - halo :, :] = self._convolve_rows(conv, stacked)
        for handle in recv_handles:
            handle.release()
        for handle in send_handles:
            handle.wait()
        return out

    # What a halo convolution reads and computes, by kind (a subclass adds its decoder's convolutions).
    def _halo_of(self, conv: Any) -> int:
        """Rows either side of an output row that ``conv`` reads (a k x k ``Conv2d``: k // 2)."""
        return conv.kernel_size[0] // 2

    def _input_rows(self, conv: Any, args: tuple, rows: slice) -> torch.Tensor:
        """``rows`` of the band's input to ``conv``, as the convolution reads them (a ``Conv2d``: as given)."""
        return args[0][..., rows, :]

    def _convolve_rows(self, conv: Any, stacked: torch.Tensor) -> torch.Tensor:
        """``conv`` of input rows that are all given, (B, C, r + 2p, W) -> (B, C_out, r, W): the columns keep their
        zero padding."""
        width_only = (0, conv.padding[1])
        return F.conv2d(stacked, conv.weight, conv.bias, conv.stride, width_only, conv.dilation, conv.groups)

    def _group_norm_of(self, norm: torch.nn.GroupNorm):
        """``norm``'s forward with the statistics of the whole image."""

        def forward(x: torch.Tensor) -> torch.Tensor:
            # Mirrors torch's CPU group_norm kernel (moments, then one scale and shift per channel: y = x * a + b),
            # the moments merged over every band.
            batch, channels = x.shape[:2]
            per_group = channels // norm.num_groups
            # Channel-major rows: diffusers' mid-block attention hands on a channels-last view, whose reductions over
            # the pixels are strided (4x slower here); one copy at the latent's resolution makes every later layer
            # contiguous (the convolutions are faster so too).
            x = x.contiguous()
            rows = x.view(batch, channels, -1)  # (B, C, pixels)
            mean = rows.sum(dim=-1, dtype=torch.float32) / rows.shape[-1]  # (B, C) float32; torch sums pairwise
            # Squared deviations summed pairwise (torch.sum; vector_norm accumulates straight and loses 1e-4 over a
            # 2048 px band's pixels), in place on one band-sized float32 copy (torch's own kernel needs none, and
            # the output is made after it is freed).
            deviations = rows.to(torch.float32, copy=True).sub_(mean[..., None]).square_()  # (B, C, pixels)
            var = deviations.sum(dim=-1) / rows.shape[-1]  # (B, C)
            del deviations  # freed before the output is made
            pixels = rows.shape[-1]
            mean = mean.double().view(batch, norm.num_groups, per_group)  # (B, G, C/G)
            squares = var.double().view(batch, norm.num_groups, per_group) * pixels  # (B, G, C/G)
            group_mean = mean.mean(dim=-1)  # (B, G)
            group_m2 = squares.sum(dim=-1) + pixels * ((mean - group_mean[..., None]) ** 2).sum(dim=-1)  # (B, G)
            count = torch.full_like(group_mean, pixels * per_group)
            local = torch.stack([count, group_mean, group_m2], dim=-1)  # (B, G, 3)
            mean, var = self._all_gather("vae norm", local, [local.shape] * self.degree, _merged_moments)
            rstd = torch.rsqrt(var + norm.eps).float().repeat_interleave(per_group, dim=1)  # (B, C)
            mean = mean.float().repeat_interleave(per_group, dim=1)  # (B, C)
            scale = rstd if not norm.affine else rstd * norm.weight.float()  # (B, C)
            shift = -scale * mean if not norm.affine else norm.bias.float() - scale * mean  # (B, C)
            shape = (batch, channels) + (1,) * (x.dim() - 2)
            return (x * scale.view(shape).to(x.dtype)).add_(shift.view(shape).to(x.dtype))

        return forward

    def _all_tokens(self, linear: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """Forward hook of the mid-block attention's ``to_k``/``to_v``: (B, my tokens, C) -> (B, the image's
        tokens, C), every band's in row order."""
        return self._every_band(out, dim=1)

    def _every_band(self, tokens: torch.Tensor, dim: int) -> torch.Tensor:
        """This band's tokens (row-major, along ``dim``) -> every band's, in row order (keys and values)."""
        mine, before, after = self._rows[self.index], tokens.shape[:dim], tokens.shape[dim + 1 :]
        shapes = [(*before, tokens.shape[dim] * rows // mine, *after) for rows in self._rows]
        return self._all_gather("vae kv", tokens.contiguous(), shapes, lambda parts: torch.cat(parts, dim=dim))

    def _all_gather(self, kind: str, tensor: torch.Tensor, shapes: list, join: Callable[[list], Any]) -> Any:
        """``join`` of every band's ``tensor`` (band j's of ``shapes[j]``) in band order, called before the received
        buffers go back to the pool."""
        self._layer += 1
        if self.degree == 1:
            return join([tensor])
        peers = [j for j in range(self.degree) if j != self.index]
        send_handles, recv_handles = self._exchange(
            [Send(self.ranks[j], kind, tensor, self._layer, self.index) for j in peers],
            [Recv(self.ranks[j], kind, shapes[j], tensor.dtype, self._layer, j) for j in peers],
        )
        received = dict(zip(peers, (handle.wait() for handle in recv_handles), strict=True))
        try:
            return join([tensor if j == self.index else received[j] for j in range(self.degree)])
        finally:
            for handle in recv_handles:
                handle.release()
            for handle in send_handles:
                handle.wait()
