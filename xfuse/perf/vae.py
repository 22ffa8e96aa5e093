"""The VAE decode of one request, from the ``AutoencoderKL`` config alone: FLOPs, activation memory, the whole-image
tensors rank 0 holds, and the predicted time, rank 0 alone and in row bands over N ranks (``xfuse.parallel.vae_decode``
runs the bands).

The decoder is walked op by op as diffusers' ``Decoder.forward`` runs it (``UNetMidBlock2D``, ``UpDecoderBlock2D``,
``ResnetBlock2D``, ``AttnProcessor2_0``), once per rank on its band of latent rows (the serial decode: one band of
every row, diffusers' own ops). Each op adds

- its FLOPs, counted as torch's ``FlopCounterMode`` counts them: convolutions and matrix products, two per
  multiply-add, the attention's scores and their product with V as ``xfuse.families.common.flops`` counts them;
  norms, activations and up-sampling left out. A band adds its convolutions' edge rows, recomputed from the
  neighbours' halos. Equal to the counter on real decodes, serial and banded (``tests/unit/test_vae_model.py``);
- its memory traffic at the tensor level (each tensor it reads and writes, once);
- the tensors alive while it runs: what its callers still reference, its inputs, its output and its own temporaries;
  the peak is the largest such sum. Besides diffusers' tensors this counts the band decode's (its GroupNorm's copy of
  a channels-last input and float32 copy of a bf16/fp16 one; the edge rows' small stacks; the gathered keys and
  values and their receive buffers; on rank 0 the image's bands joined) and, on a CPU, what a padded convolution
  allocates for an NCHW input (``ConvScratch``: oneDNN's reordered copy in blocks of 16 or 8 channels, or torch's
  unfolded input; none for 1x1 convolutions), as the machine's kernels choose it. What a GPU's convolution workspace
  adds is not modelled. Within 1 % of the CPU allocator's peak of real decodes, given the machine's scratch;
- on the band decode, its messages: a k x k convolution's halo rows to and from each neighbour (travelling while
  the band's own convolution runs), a GroupNorm's (count, mean, squared deviations) to every other rank, the
  mid-block attention's keys and values to every other rank; rank 0 scatters the latent's bands before and gathers
  the image's after.

The predicted time of a rank is its FLOPs over the device's fitted throughput (the rate the performance model fits
for FLUX's blocks: ``Calibration.throughput``) plus its traffic over the memory bandwidth; the band decode adds, per
communicating layer, the slowest rank's exchange: its larger direction over the link's bandwidth shared by the
world plus a latency per message, less what the link hides behind the band's own work (a halo, behind the
convolution, where the link overlaps; gloo's copies take the rank's own core). Not fitted to decodes, and no cost
per kernel launch: a tiny VAE's decode on a GPU (the presets', ``shapes``) is launch-bound, and its predicted time a
floor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from xfuse.families.common.flops import attention_flops, linear_flops
from xfuse.parallel.patch_grid import even_split
from xfuse.parallel.vae_decode import IMAGE_BAND_DECODED_VAES
from xfuse.perf.hardware import Link
from xfuse.perf.measured import REFERENCE
from xfuse.perf.model import Calibration, Machine

FLOAT32 = 4
# The image VAEs with AutoencoderKL's encoder and decoder, which this model describes: those the band decode runs.
_IMAGE_VAES = IMAGE_BAND_DECODED_VAES
NORM_STATS = 3 * 8  # a GroupNorm's (count, mean, squared deviations) per (image, group), float64: vae_decode


@dataclass(frozen=True)
class ConvScratch:
    """What a CPU's k x k convolution (k > 1) of an NCHW input allocates beside its input and output, per pixel:
    oneDNN's reordered copy in blocks of ``block`` channels (16 with AVX-512, 8 with AVX2) of ``element`` bytes
    (float32; the input's own bf16 where the CPU has AVX-512 BF16), or, with ``unfold``, torch's unfolded input (k * k
    values per input channel: a bf16 convolution without oneDNN's bf16 kernels). Which one a machine uses is its
    kernels' choice, not the model's: ``tests/unit/test_vae_model.py`` reads it off the machine before comparing."""

    block: int
    element: int
    unfold: bool = False

    def bytes(self, pixels: int, cin: int, k: int) -> int:
        if self.unfold:
            return pixels * cin * k * k * self.element
        return pixels * -(-cin // self.block) * self.block * self.element


# A CPU rank as xfuse plan prices it: oneDNN's float32 copy in blocks of 16 channels (AVX-512, float32 runs).
CPU_CONV_SCRATCH = ConvScratch(block=16, element=FLOAT32)


def conv_scratch_on(where) -> ConvScratch | None:
    """What a convolution allocates beside its output on ``where``'s device (a ``Machine``; ``None``: not known, as
    on a GPU): a CPU's copy of its input (``CPU_CONV_SCRATCH``), nothing counted on a GPU."""
    return CPU_CONV_SCRATCH if where is not None and not where.device.gpu else None


@dataclass(frozen=True)
class VaeShape:
    """The sizes of an ``AutoencoderKL`` that its costs depend on (diffusers' defaults for missing keys)."""

    block_out_channels: tuple[int, ...]
    layers_per_block: int
    latent_channels: int
    norm_num_groups: int
    in_channels: int = 3
    out_channels: int = 3
    quant_conv: bool = True
    post_quant_conv: bool = True
    mid_attention: bool = True

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> VaeShape:
        """From a diffusers ``vae/config.json`` dict; ``ValueError`` for a VAE this model does not describe."""
        name = config.get("_class_name", "AutoencoderKL")
        if name not in _IMAGE_VAES:  # e.g. Wan's causal 3-D AutoencoderKLWan
            raise ValueError(f"the VAE model covers diffusers' {' and '.join(_IMAGE_VAES)} only (got {name})")
        decoder_channels = config.get("decoder_block_out_channels")
        if decoder_channels is not None and list(decoder_channels) != list(config.get("block_out_channels", ())):
            raise ValueError(f"the VAE model covers a decoder as wide as the encoder only (got {name} with "
                             f"decoder_block_out_channels {list(decoder_channels)})")  # fmt: skip
        levels = len(config.get("block_out_channels", (64,)))
        for key, kind in (("up_block_types", "UpDecoderBlock2D"), ("down_block_types", "DownEncoderBlock2D")):
            blocks = tuple(config.get(key, (kind,) * levels))
            if any(b != kind for b in blocks) or len(blocks) != levels:
                raise ValueError(
                    f"the VAE model covers diffusers' AutoencoderKL with {kind}s only (got {name}: {blocks})"
                )
        return cls(
            block_out_channels=tuple(int(c) for c in config.get("block_out_channels", (64,))),
            layers_per_block=int(config.get("layers_per_block", 1)),
            latent_channels=int(config.get("latent_channels", 4)),
            norm_num_groups=int(config.get("norm_num_groups", 32)),
            in_channels=int(config.get("in_channels", 3)),
            out_channels=int(config.get("out_channels", 3)),
            quant_conv=bool(config.get("use_quant_conv", True)),
            post_quant_conv=bool(config.get("use_post_quant_conv", True)),
            mid_attention=bool(config.get("mid_block_add_attention", True)),
        )

    @property
    def scale_factor(self) -> int:
        """Pixels per latent row (and column): one 2x up-sampling per level but the last."""
        return 2 ** (len(self.block_out_channels) - 1)

    def parameters(self) -> int:
        """Parameters of the whole ``AutoencoderKL`` (encoder and decoder: a pipeline loads both)."""

        def conv(cin: int, cout: int, k: int) -> int:
            return cin * cout * k * k + cout

        def resnet(cin: int, cout: int) -> int:
            return (
                2 * cin
                + conv(cin, cout, 3)
                + 2 * cout
                + conv(cout, cout, 3)
                + (conv(cin, cout, 1) if cin != cout else 0)
            )

        channels, layers, top = self.block_out_channels, self.layers_per_block, self.block_out_channels[-1]
        attention = 2 * top + 4 * (top * top + top) if self.mid_attention else 0
        mid = 2 * resnet(top, top) + attention
        encoder = conv(self.in_channels, channels[0], 3) + mid + 2 * top + conv(top, 2 * self.latent_channels, 3)
        previous = channels[0]
        for i, c in enumerate(channels):
            encoder += (
                resnet(previous, c) + (layers - 1) * resnet(c, c) + (conv(c, c, 3) if i < len(channels) - 1 else 0)
            )
            previous = c
        decoder = conv(self.latent_channels, top, 3) + mid + 2 * channels[0] + conv(channels[0], self.out_channels, 3)
        previous = top
        for i, c in enumerate(reversed(channels)):
            decoder += resnet(previous, c) + layers * resnet(c, c) + (conv(c, c, 3) if i < len(channels) - 1 else 0)
            previous = c
        quant = conv(2 * self.latent_channels, 2 * self.latent_channels, 1) if self.quant_conv else 0
        post_quant = conv(self.latent_channels, self.latent_channels, 1) if self.post_quant_conv else 0
        return encoder + decoder + quant + post_quant


def band_rows(latent_rows: int, parts: int) -> list[int]:
    """Latent rows of each rank's band (``xfuse.parallel.vae_decode.band_rows``: the first ``rows % parts`` one
    row taller)."""
    return even_split(latent_rows, parts)


@dataclass(frozen=True)
class Exchange:
    """One communicating layer of the band decode, seen from one rank."""

    kind: str  # vae latent, vae halo, vae norm, vae kv, vae image (xfuse.parallel.vae_decode's message kinds)
    sent: int  # bytes this rank sends in it
    received: int  # bytes it receives
    messages: int  # messages it sends or receives, whichever is more
    behind_flops: float = 0.0  # the band's own work it travels behind (a halo: the band's convolution), FLOPs
    behind_traffic: float = 0.0  # and bytes


@dataclass
class RankDecode:
    """One rank's share of a decode (the whole decode for a serial one), as :func:`decode_ranks` counts it."""

    rows: int  # latent rows of its band
    flops: float = 0.0
    traffic: float = 0.0  # bytes its ops read and write
    peak: int = 0  # bytes of its activation peak (the latents it is given excluded; the image it returns included)
    peak_at: str = ""  # the op at the peak
    exchanges: list[Exchange] = field(default_factory=list)


class _Walk:
    """Diffusers' decoder forward on one band, op by op: FLOPs, traffic, live tensors and messages."""

    def __init__(self, vae: VaeShape, *, batch: int, rows: int, latent_rows: int, latent_cols: int,
                 element: int, bands: list[int] | None, index: int, conv_scratch: ConvScratch | None):  # fmt: skip
        self.vae, self.batch, self.element, self.conv_scratch = vae, batch, element, conv_scratch
        self.rows, self.latent_rows, self.latent_cols = rows, latent_rows, latent_cols
        self.bands, self.index = bands, index  # bands None: the serial decode
        self.out = RankDecode(rows)
        self.live: dict[str, int] = {}
        self._names = 0
        # The band decode's activations are channels-last after the mid-block attention (diffusers reshapes its
        # output as a view) until vae_decode's next GroupNorm makes them contiguous; torch's group_norm does not
        # keep the layout either.
        self.channels_last = False

    # ----------------------------------------------------------------------------------------- bookkeeping
    def pixels(self, level: int) -> int:
        """Elements per channel of a tensor of this band at ``level`` (0: the latent; each level doubles a side)."""
        return self.batch * (self.rows << level) * (self.latent_cols << level)

    def new(self, channels: int, level: int, element: int | None = None) -> str:
        """A new tensor held from now on; returns its name."""
        self._names += 1
        name = f"t{self._names}"
        self.live[name] = channels * self.pixels(level) * (self.element if element is None else element)
        return name

    def drop(self, *names: str) -> None:
        for name in names:
            del self.live[name]

    def mark(self, where: str, *temporaries: int) -> None:
        """The live tensors (and ``temporaries`` of the running op) at one op."""
        total = sum(self.live.values()) + sum(temporaries)
        if total > self.out.peak:
            self.out.peak, self.out.peak_at = total, where

    def exchange(self, kind: str, sent: int, received: int, messages: int, flops: float = 0.0,
                 traffic: float = 0.0) -> None:  # fmt: skip
        if self.bands is not None and len(self.bands) > 1:
            self.out.exchanges.append(Exchange(kind, sent, received, messages, flops, traffic))

    # ------------------------------------------------------------------------------------------------ ops
    def conv(self, x: str, cin: int, cout: int, k: int, level: int, where: str) -> str:
        pixels, weights = self.pixels(level), (cin * cout * k * k + cout) * self.element
        flops = 2.0 * cin * cout * k * k * pixels
        y = self.new(cout, level)
        traffic = self.live[x] + self.live[y] + weights
        self.out.flops += flops
        self.out.traffic += traffic
        temporaries = []
        if k > 1 and self.conv_scratch is not None and not self.channels_last:  # a CPU's copy of an NCHW input
            temporaries.append(self.conv_scratch.bytes(self.live[x] // (self.element * cin), cin, k))
        if k > 1 and self.bands is not None and len(self.bands) > 1:
            # The halo: the band's first and last p rows to its neighbours while its own convolution runs (behind
            # it); then the p output rows at each inner edge recomputed from (B, cin, 3p, W) stacks of received and
            # own rows; a band thinner than two halos is recomputed whole from (B, cin, rows + 2p, W).
            halo, rows, cols = k // 2, self.rows << level, self.latent_cols << level
            row = cin * self.batch * halo * cols * self.element
            neighbours = (self.index > 0) + (self.index < len(self.bands) - 1)
            self.exchange("vae halo", neighbours * row, neighbours * row, neighbours, flops, traffic)
            self.live.setdefault(f"halo receive buffers {cin}x{cols}", neighbours * row)  # the pool's, kept
            stacked, recomputed = (rows + 2 * halo, rows) if rows < 2 * halo else (3 * halo, halo)
            times = 1 if rows < 2 * halo else neighbours
            out_rows = cout * self.batch * recomputed * cols * self.element
            self.out.flops += times * 2.0 * cin * cout * k * k * self.batch * recomputed * cols
            self.out.traffic += times * (2 * stacked * row // halo + 2 * out_rows + weights)
            temporaries += [stacked * row // halo, out_rows]
        self.mark(where, *temporaries)
        return y

    def norm(self, x: str, channels: int, level: int, where: str) -> str:
        if self.bands is None:  # torch's group_norm: reads its input twice (statistics, normalisation)
            y = self.new(channels, level)
            self.out.traffic += 2 * self.live[x] + self.live[y]
            self.mark(where)
            return y
        # vae_decode's GroupNorm: x made contiguous (a copy where it is channels-last: the first norm after the
        # mid-block attention, after which every tensor is contiguous again), the per-channel sum (float32), then
        # the deviations from the mean (one float32 temporary whatever x's dtype, squared in place) summed;
        # the whole image's moments from every rank's (B, G, 3) float64; then y = x * scale + shift per channel (the
        # addition in place). The contiguous copy lives until the norm returns.
        copy = self.live[x] if self.channels_last else 0
        self.channels_last = False
        deviations = self.live[x] // self.element * FLOAT32  # bf16 rows less a float32 mean: float32
        peers = len(self.bands) - 1
        stats = NORM_STATS * self.batch * self.vae.norm_num_groups
        self.exchange("vae norm", peers * stats, peers * stats, peers)
        self.mark(where, copy, deviations)
        y = self.new(channels, level)
        self.mark(where, copy)
        self.out.traffic += 2 * copy + 3 * self.live[x] + 3 * deviations + self.live[x]
        self.out.traffic += 3 * self.live[y]
        return y

    def pointwise(self, inputs: tuple[str, ...], channels: int, level: int, where: str) -> str:
        """SiLU, the residual sum, the division by the output scale factor: a new tensor of the same shape."""
        y = self.new(channels, level)
        self.out.traffic += sum(self.live[x] for x in inputs) + self.live[y]
        self.mark(where)
        return y

    def resnet(self, x: str, cin: int, cout: int, level: int, where: str) -> str:
        """``ResnetBlock2D.forward`` (no time embedding, no resampling); ``x`` stays referenced by the caller."""
        n1 = self.norm(x, cin, level, f"{where}.norm1")
        s1 = self.pointwise((n1,), cin, level, f"{where}.nonlinearity")
        self.drop(n1)
        c1 = self.conv(s1, cin, cout, 3, level, f"{where}.conv1")
        self.drop(s1)
        n2 = self.norm(c1, cout, level, f"{where}.norm2")
        self.drop(c1)
        s2 = self.pointwise((n2,), cout, level, f"{where}.nonlinearity")
        self.drop(n2)
        c2 = self.conv(s2, cout, cout, 3, level, f"{where}.conv2")
        self.drop(s2)
        shortcut = self.conv(x, cin, cout, 1, level, f"{where}.conv_shortcut") if cin != cout else x
        total = self.pointwise((shortcut, c2), cout, level, f"{where} (input + h)")
        out = self.pointwise((total,), cout, level, f"{where} (/ output_scale_factor)")
        self.drop(total, c2, *((shortcut,) if shortcut != x else ()))
        return out

    def attention(self, x: str, channels: int, where: str) -> str:
        """``AttnProcessor2_0`` on the latent's tokens (one head of ``channels``): the band's queries, every
        band's keys and values (gathered by the band decode)."""
        queries = self.batch * self.rows * self.latent_cols
        keys = self.batch * self.latent_rows * self.latent_cols
        # q, k, v and the output projection on the band's tokens; its queries' scores over every token, times V
        self.out.flops += 4 * linear_flops(queries, channels, channels)
        self.out.flops += self.batch * attention_flops(queries // self.batch, keys // self.batch, channels)
        normed = self.norm(x, channels, 0, f"{where}.group_norm")
        q = self.new(channels, 0)
        k = self.new(channels, 0)
        v = self.new(channels, 0)
        token_bytes = channels * self.element
        self.out.traffic += 4 * self.live[normed] + 3 * self.live[q]
        if self.bands is not None and len(self.bands) > 1:
            peers, others = len(self.bands) - 1, keys - queries
            for name in (k, v):  # the gathered keys (values) replace the band's: every band's in row order
                self.exchange("vae kv", peers * queries * token_bytes, others * token_bytes, peers)
                self.live[name] = keys * token_bytes
            self.live["kv receive buffers"] = others * token_bytes  # the pool's, one per peer, kept for the decode
        self.out.traffic += 2 * self.live[k] + 2 * self.live[q]
        o = self.new(channels, 0)  # the attention's output, then its (B, tokens, C) copy, to_out, (B, C, h, w) copy
        for step in ("scaled_dot_product_attention", "transpose", "to_out", "reshape", "+ residual", "/ rescale"):
            following = self.new(channels, 0)
            self.out.traffic += self.live[o] + self.live[following] + (self.live[x] if step == "+ residual" else 0)
            self.mark(f"{where} ({step})")
            self.drop(o)
            o = following
        self.drop(normed, q, k, v)
        self.channels_last = self.bands is not None
        return o

    # --------------------------------------------------------------------------------------------- the decode
    def decode(self) -> RankDecode:
        """``AutoencoderKL.decode`` of the band (the band decode: ``ParallelVAEDecode.decode`` on this rank)."""
        vae, channels = self.vae, self.vae.block_out_channels
        z = self.new(vae.latent_channels, 0)  # the latents given (the band, received or a view of rank 0's)
        if self.bands is not None and len(self.bands) > 1:
            row = vae.latent_channels * self.batch * self.latent_cols * self.element
            others = sum(self.bands) - self.rows
            if self.index == 0:
                self.exchange("vae latent", others * row, 0, len(self.bands) - 1)
            else:
                self.exchange("vae latent", 0, self.rows * row, 1)
        given = self.live[z]
        if vae.post_quant_conv:
            z = self.conv(z, vae.latent_channels, vae.latent_channels, 1, 0, "post_quant_conv")
        top = channels[-1]
        x = self.conv(z, vae.latent_channels, top, 3, 0, "decoder.conv_in")
        h = self.resnet(x, top, top, 0, "decoder.mid_block.resnets.0")
        if vae.mid_attention:
            a = self.attention(h, top, "decoder.mid_block.attentions.0")
            self.drop(h)
            h = a
        m = self.resnet(h, top, top, 0, "decoder.mid_block.resnets.1")
        self.drop(h, x)
        block_input, previous, level = m, top, 0
        for i, c in enumerate(reversed(channels)):
            where = f"decoder.up_blocks.{i}"
            h = block_input
            for j in range(vae.layers_per_block + 1):
                out = self.resnet(h, previous if j == 0 else c, c, level, f"{where}.resnets.{j}")
                if h != block_input:
                    self.drop(h)
                h = out
            if i < len(channels) - 1:  # nearest x2, then a 3x3 convolution at the next level
                up = self.new(c, level + 1)
                self.out.traffic += self.live[h] + self.live[up]
                self.mark(f"{where}.upsamplers.0 (interpolate)")
                y = self.conv(up, c, c, 3, level + 1, f"{where}.upsamplers.0.conv")
                self.drop(up, h)
                h, level = y, level + 1
            self.drop(block_input)
            block_input, previous = h, c
        n = self.norm(h, channels[0], level, "decoder.conv_norm_out")
        self.drop(h)
        s = self.pointwise((n,), channels[0], level, "decoder.conv_act")
        self.drop(n)
        image = self.conv(s, channels[0], vae.out_channels, 3, level, "decoder.conv_out")
        self.drop(s)
        if self.bands is not None and len(self.bands) > 1:
            row = vae.out_channels * self.batch * (self.latent_cols << level) * self.element * (1 << level)
            if self.index == 0:  # the received bands (pool buffers) and the whole image they are joined into
                whole = sum(self.bands) * row
                self.exchange("vae image", 0, whole - self.live[image], len(self.bands) - 1)
                self.out.traffic += 2 * whole
                self.mark("the image's bands joined on rank 0", whole - self.live[image], whole)
            else:
                self.exchange("vae image", self.live[image], 0, 1)
        self.out.peak -= given
        return self.out


def decode_ranks(vae: VaeShape, *, height: int, width: int, batch: int = 1, ranks: int = 1, element: int = FLOAT32,
                 conv_scratch: ConvScratch | None = None, band: bool | None = None) -> list[RankDecode]:  # fmt: skip
    """Every rank's share of decoding a batch of ``batch`` ``height`` x ``width`` px images over ``ranks`` ranks in
    row bands (one rank: the serial decode, ``vae.decode``). ``element``: bytes per element of the VAE's dtype;
    ``conv_scratch``: what a padded convolution allocates on a CPU (``ConvScratch``; None on a GPU); ``band``: walk
    the band decode's ops (``ParallelVAEDecode``) even on one rank (default: on more than one)."""
    factor = vae.scale_factor
    if height % factor or width % factor or height < factor or width < factor:
        raise ValueError(f"{height}x{width} px is not a whole latent at the VAE's factor {factor}")
    rows, cols = height // factor, width // factor
    if ranks > rows:
        raise ValueError(f"{rows} latent rows cannot be cut into {ranks} bands (one row each at least)")
    bands = band_rows(rows, ranks) if (ranks > 1 if band is None else band) else None
    return [
        _Walk(vae, batch=batch, rows=bands[i] if bands else rows, latent_rows=rows, latent_cols=cols, element=element,
              bands=bands, index=i, conv_scratch=conv_scratch).decode()
        for i in range(ranks)
    ]  # fmt: skip


@dataclass(frozen=True)
class DecodeTime:
    """Predicted seconds of one decode: the slowest rank's compute plus the exchanges of every layer."""

    seconds: float
    compute: float  # the slowest rank's FLOPs over the throughput and traffic over the memory bandwidth
    exchange: float  # the band decode's messages: per communicating layer, its slowest rank's (0 for a serial one)
    layers: int  # communicating layers, the latent's scatter and the image's gather included
    sent: int  # bytes the rank that sends the most sends


def decode_time(
    ranks: list[RankDecode], *, flops_rate: float, memory_bandwidth: float, link: Link | None
) -> DecodeTime:
    """Seconds of the decode whose ranks' shares are ``ranks`` (:func:`decode_ranks`) on a device computing
    ``flops_rate`` FLOP/s with ``memory_bandwidth`` bytes/s, the ranks over ``link`` (all of them exchange at once:
    ``Link.group_bandwidth``). A layer's exchange costs its larger direction over the bandwidth plus a latency per
    message, less the band's own work it travels behind (a halo: the convolution) where the link overlaps."""
    compute = max(r.flops / flops_rate + r.traffic / memory_bandwidth for r in ranks)
    exchange, layers = 0.0, 0
    if len(ranks) > 1:
        if link is None:
            raise ValueError("a decode over several ranks needs the link between them")
        bandwidth = link.group_bandwidth(len(ranks))

        def exposed(e: Exchange) -> float:
            seconds = max(e.sent, e.received) / bandwidth + e.messages * link.latency
            if not link.overlap:  # gloo's copies take the rank's own core: nothing hides behind its compute
                return seconds
            return max(seconds - e.behind_flops / flops_rate - e.behind_traffic / memory_bandwidth, 0.0)

        for layer in zip(*(r.exchanges for r in ranks), strict=True):  # every rank takes part in every layer
            exchange += max(exposed(e) for e in layer)
            layers += 1
    sent = max(sum(e.sent for e in r.exchanges) for r in ranks)
    return DecodeTime(compute + exchange, compute, exchange, layers, sent)


def predict_decode(vae: VaeShape, *, height: int, width: int, batch: int, ranks: int, machine: Machine,
                   calibration: Calibration, element: int) -> DecodeTime:  # fmt: skip
    """Seconds of the decode on ``machine``: rank 0 alone (``ranks`` 1) or in bands over ``ranks`` ranks (a latent
    row each at least: ``ValueError`` otherwise), ``element`` bytes per element. The throughput is the one the
    performance model fits for FLUX's blocks on the device (a VAE's convolutions are dense products too); a CPU's
    is one torch thread's."""
    rate = calibration.throughput(machine.device_key, machine.device, REFERENCE)
    link = calibration.link(machine.link_key, machine.between(0, ranks - 1))
    shares = decode_ranks(
        vae,
        height=height,
        width=width,
        batch=batch,
        ranks=ranks,
        element=element,
        conv_scratch=conv_scratch_on(machine),
    )
    return decode_time(shares, flops_rate=rate, memory_bandwidth=machine.device.memory_bandwidth, link=link)


@dataclass(frozen=True)
class WholeTensor:
    """A tensor of the whole image that exists on rank 0 alone."""

    name: str
    shape: tuple[int, ...]
    nbytes: int


def whole_image_tensors(vae: VaeShape, *, height: int, width: int, batch: int, element: int) -> list[WholeTensor]:
    """What rank 0 holds of the whole image, however the decode is split: the final latents (the transformer's
    output, scaled), the decoded image, diffusers' post-processing of it (``VaeImageProcessor.postprocess``:
    float32 NHWC in [0, 1]) and the uint8 pixels the PIL images (and the PNG) are made of."""
    h, w = height // vae.scale_factor, width // vae.scale_factor
    pixels = batch * height * width * vae.out_channels
    return [
        WholeTensor("final latents", (batch, vae.latent_channels, h, w), batch * vae.latent_channels * h * w * element),
        WholeTensor("decoded image", (batch, vae.out_channels, height, width), pixels * element),
        WholeTensor("post-processed (float32, NHWC)", (batch, height, width, vae.out_channels), pixels * FLOAT32),
        WholeTensor("uint8 pixels (PIL, PNG)", (batch, height, width, vae.out_channels), pixels),
    ]
