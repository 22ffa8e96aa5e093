"""The decode of a causal 3-D VAE (Wan's ``AutoencoderKLWan``), each rank's share traced: memory, work and messages.

The image VAEs' decode is walked op by op from the decoder's shape (``xfuse.perf.vae``); a 3-D VAE's runs diffusers'
frame-by-frame loop through causal caches, which is not written down again here. Instead each rank's share of the
band decode (``xfuse.parallel.video_vae_decode.ParallelWanDecode``) is rehearsed on a weightless VAE on the meta
device: the rank runs its band alone, the messages it would send are recorded and what it would receive lands in
buffers of the channels' pool (so its receive buffers count), under a dispatch mode that counts the bytes alive
(``xfuse.perf.activations.LiveBytes``), the FLOPs (``torch.utils.flop_counter``) and the bytes every op reads and
writes. Rank 0's share includes the latent it scatters and the whole clip it gathers; one rank is the serial decode
(``vae.decode``: the same ops on the whole latent).

The result is the image model's per-rank record (:class:`~xfuse.perf.vae.RankDecode`), so the time of a decode is
predicted by the same :func:`~xfuse.perf.vae.decode_time`: each rank's FLOPs over the device's throughput and its
traffic over its memory bandwidth, plus every communicating layer's messages over the link. Not seen: a kernel's
workspace (cuDNN's, oneDNN's working copies on a CPU) and the allocator's rounding.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from xfuse.comm.buffers import RecvBufferPool
from xfuse.comm.p2p import Recv, Send
from xfuse.families.registry import vae_config
from xfuse.parallel.vae_decode import band_rows
from xfuse.parallel.video_vae_decode import ParallelWanDecode
from xfuse.perf.activations import LiveBytes, traced
from xfuse.perf.measured import REFERENCE
from xfuse.perf.model import Calibration, Machine
from xfuse.perf.trace_cache import on_disk
from xfuse.perf.vae import DecodeTime, Exchange, RankDecode, decode_time


class _Costs(LiveBytes):
    """:class:`LiveBytes` that also adds up the bytes each op reads and writes (its tensor inputs and outputs; a
    view moves none)."""

    def __init__(self):
        super().__init__()
        self.traffic = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not func.is_view:
            tensors = [t for t in tree_leaves((args, kwargs or {}, out)) if isinstance(t, torch.Tensor)]
            self.traffic += sum(t.numel() * t.element_size() for t in tensors)
        return out


class _Sent:
    def wait(self) -> None:
        return None


class _Arrival:
    """A receive in a rehearsal: a buffer of the channels' pool (``xfuse.comm.buffers``: kept per peer, kind and
    shape until the decode ends, as the real channels keep theirs), on the meta device."""

    def __init__(self, pool: RecvBufferPool, recv: Recv):
        self.pool, self.slot = pool, pool.acquire(recv.peer, recv.kind, recv.shape, recv.dtype)

    def wait(self) -> torch.Tensor:
        return self.slot.tensor

    def release(self) -> None:
        self.pool.release(self.slot)

    def __enter__(self) -> torch.Tensor:
        return self.wait()

    def __exit__(self, *exc) -> None:
        self.release()


class _Channels:
    """What a rehearsal has of the channels: their receive buffers, dropped at the end of a decode."""

    def __init__(self):
        self.pool = RecvBufferPool(torch.device("meta"))

    def reset_buffers(self) -> None:
        self.pool.clear()


class _Rehearsal(ParallelWanDecode):
    """One rank's share of the band decode run alone: its messages recorded (one :class:`Exchange` per
    communicating layer), what it receives in pooled buffers of the meta device."""

    def __init__(self, vae, index: int, degree: int):
        self.rehearsed = _Channels()
        super().__init__(vae, ranks=list(range(degree)), rank=index, channels=self.rehearsed)  # type: ignore[arg-type]
        self.exchanges: list[Exchange] = []

    def _exchange(self, sends: list[Send], recvs: list[Recv] | None = None):
        recvs = recvs or []
        sent = sum(s.tensor.numel() * s.tensor.element_size() for s in sends)
        received = sum(torch.Size(r.shape).numel() * torch.empty((), dtype=r.dtype).element_size() for r in recvs)
        kinds = {s.kind for s in sends} | {r.kind for r in recvs}
        self.exchanges.append(Exchange(" / ".join(sorted(kinds)), sent, received, max(len(sends), len(recvs))))
        return [_Sent() for _ in sends], [_Arrival(self.rehearsed.pool, r) for r in recvs]


def _meta_vae(config: str, dtype: torch.dtype):
    """The 3-D VAE of ``config`` (its ``vae/config.json``, as JSON) on the meta device in ``dtype``."""
    import diffusers

    raw = json.loads(config)
    with torch.device("meta"):
        vae = getattr(diffusers, raw["_class_name"])(**{k: v for k, v in raw.items() if not k.startswith("_")})
    return torch.nn.Module.to(vae.eval(), dtype=dtype)  # (ModelMixin.to warns of a cast it would not make)


def traced_decode_ranks(model: str, *, frames: int, rows: int, cols: int, ranks: int = 1,
                        dtype: torch.dtype = torch.float32) -> tuple[RankDecode, ...]:  # fmt: skip
    """Every rank's share of decoding one clip of ``frames`` latent frames of ``rows`` x ``cols`` latent pixels of
    ``model``'s 3-D VAE in ``dtype`` over ``ranks`` ranks in row bands (one rank: the serial decode): its activation
    peak (the latents it is given excluded; what it receives, and on rank 0 the whole clip, included), FLOPs, traffic
    and messages. Same-sized bands are traced once, and a long clip from two short ones (:func:`_share`)."""
    if ranks > rows:
        raise ValueError(f"{rows} latent rows cannot be cut into {ranks} bands (one row each at least)")
    raw = vae_config(model)
    if raw is None:
        raise ValueError(f"{model!r} has no VAE")
    return _shares(json.dumps(raw, sort_keys=True), dtype, frames, rows, cols, ranks)


@lru_cache(maxsize=64)
@on_disk(lambda config, dtype, frames, rows, cols, ranks: (config, str(dtype), frames, rows, cols, ranks))
def _shares(config: str, dtype: torch.dtype, frames: int, rows: int, cols: int, ranks: int) -> tuple[RankDecode, ...]:
    vae = _meta_vae(config, dtype)
    bands = [band.stop - band.start for band in band_rows(rows, ranks)]
    shares: list[RankDecode] = []
    seen: dict[tuple, RankDecode] = {}
    for index, band in enumerate(bands):
        key = (band, index == 0, index == ranks - 1)  # rank 0 scatters and gathers; the last band has one neighbour
        if key not in seen:
            seen[key] = _share(vae, index, ranks, frames, rows, cols)
        shares.append(replace(seen[key], exchanges=list(seen[key].exchanges)))
    return tuple(shares)


# A clip of more latent frames than this is traced at FIT_FRAMES - 1 and FIT_FRAMES frames and extended: from the third
# latent frame on, every frame runs the same ops on the same shapes (the causal caches hold two frames), so FLOPs,
# traffic and messages grow by one frame's each, and so do the peak while the decoder runs (the frames decoded so far
# held beside the last one's work) and the peak outside it (the frames joined into the clip, gathered on rank 0).
FIT_FRAMES = 4


def _share(vae, index: int, degree: int, frames: int, rows: int, cols: int) -> RankDecode:
    """Band ``index``'s share of a clip of ``frames`` latent frames (module docstring), extended from two short clips
    where it is longer than ``FIT_FRAMES`` (``tests/unit/test_video_vae.py`` checks the extension against tracing)."""
    if frames <= FIT_FRAMES:
        return _rehearse(vae, index, degree, frames, rows, cols)[0]
    (short, short_in, short_out), (long, long_in, long_out) = (
        _rehearse(vae, index, degree, n, rows, cols) for n in (FIT_FRAMES - 1, FIT_FRAMES)
    )
    more = frames - FIT_FRAMES

    def ahead(at_short: float, at_long: float) -> float:
        return at_long + more * (at_long - at_short)

    exchanges = long.exchanges
    if exchanges:  # the latent's scatter first, the clip's gather last: their sizes grow with the frames
        frame = exchanges[len(short.exchanges) - 1 : -1]  # the last frame's layers
        ends = [
            replace(b, sent=int(ahead(a.sent, b.sent)), received=int(ahead(a.received, b.received)))
            for a, b in ((short.exchanges[0], exchanges[0]), (short.exchanges[-1], exchanges[-1]))
        ]
        exchanges = [ends[0], *exchanges[1:-1], *frame * more, ends[1]]
    peak = max(ahead(short_in, long_in), ahead(short_out, long_out))
    return RankDecode(long.rows, ahead(short.flops, long.flops), ahead(short.traffic, long.traffic), int(peak), "",
                      exchanges)  # fmt: skip


def _rehearse(vae, index: int, degree: int, frames: int, rows: int, cols: int) -> tuple[RankDecode, int, int]:
    """Band ``index``'s share traced, with its peaks while the decoder runs and outside it."""
    rehearsal = _Rehearsal(vae, index, degree)
    shape = rehearsal.latent_shape(1, frames, rows, cols)
    latents = torch.zeros(shape, device="meta", dtype=vae.dtype) if index == 0 else None
    costs, flops = _Costs(), FlopCounterMode(display=False)

    def enter(*_):
        costs.label = "decoder"

    def leave(*_):
        costs.label = None

    hooks = [vae.decoder.register_forward_pre_hook(enter), vae.decoder.register_forward_hook(leave)]
    try:
        with traced(), flops, costs:
            rehearsal.decode(latents, shape)
    finally:
        for hook in hooks:
            hook.remove()
    band = band_rows(rows, degree)[index]
    share = RankDecode(band.stop - band.start, float(flops.get_total_flops()), float(costs.traffic), costs.peak, "",
                       rehearsal.exchanges)  # fmt: skip
    return share, costs.peaks.get("decoder", 0), costs.peaks.get(None, 0)


def predict_video_decode(model: str, *, frames: int, rows: int, cols: int, ranks: int, machine: Machine,
                         calibration: Calibration, dtype: torch.dtype) -> DecodeTime:  # fmt: skip
    """Seconds of a clip's decode on ``machine`` (:func:`traced_decode_ranks`' shares, as
    ``xfuse.perf.vae.predict_decode`` costs an image's): rank 0 alone (``ranks`` 1) or in bands over ``ranks``."""
    rate = calibration.throughput(machine.device_key, machine.device, REFERENCE)
    link = calibration.link(machine.link_key, machine.between(0, ranks - 1))
    shares = traced_decode_ranks(model, frames=frames, rows=rows, cols=cols, ranks=ranks, dtype=dtype)
    return decode_time(list(shares), flops_rate=rate, memory_bandwidth=machine.device.memory_bandwidth, link=link)
