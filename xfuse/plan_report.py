"""What a configuration will do, computed without any process group: ``xfuse plan``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from xfuse.build import request_size
from xfuse.config import ConfigError, GenerationConfig, XfuseConfig
from xfuse.families.registry import model_spec, resolve, transformer_count, vae_config
from xfuse.families.spec import ModelSpec
from xfuse.parallel.costs import KINDS, comm_volume, keeps_stale_kv, speedup_ceiling
from xfuse.parallel.patch_grid import PatchGrid, patch_grid
from xfuse.parallel.schedule import batch_parts
from xfuse.parallel.stage_plan import StagePlan
from xfuse.parallel.step_cache import always_computed, first_pipelined_step, most_skipped
from xfuse.parallel.vae_decode import (
    VAE_PARALLEL_MIN_PIXELS,
    VIDEO_BAND_DECODED_VAES,
    VIDEO_VAE_PARALLEL_MIN_PIXELS,
    decodes_in_parallel,
    vae_on_every_rank,
)
from xfuse.perf.memory import GIB, Placed, pipeline_rank_bytes, place_text, vae_weight_bytes
from xfuse.perf.model import Machine
from xfuse.perf.vae import (
    DecodeTime,
    RankDecode,
    VaeShape,
    WholeTensor,
    band_rows,
    conv_scratch_on,
    decode_ranks,
    predict_decode,
    whole_image_tensors,
)
from xfuse.perf.video_vae import predict_video_decode, traced_decode_ranks


def _ranges(blocks) -> str:
    """(0, 1, 2, 5, 6) -> '0-2, 5-6'."""
    runs, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            runs.append(f"{start}" if start == b else f"{start}-{b}")
            start = None
    return ", ".join(runs) or "-"


def local_machine(gpus: int, nodes: int = 1, device: str | None = None, link: str | None = None) -> Machine:
    """The machine a plan is costed on: ``device`` (default: this machine's, ``xfuse.perf.planner.local_device``)
    with ``link`` between the devices of a node (default: gloo on a CPU, PCIe for L40 and RTX 4090, NVLink
    otherwise)."""
    from xfuse.perf.model import machine
    from xfuse.perf.planner import local_device

    device = device or local_device()
    return machine(device, link or {"cpu": "gloo", "l40": "pcie", "rtx4090": "pcie"}.get(device, "nvlink"), gpus, nodes)


@dataclass(frozen=True)
class VaePlan:
    """The request's VAE decode (``xfuse.perf.vae``): rank 0 alone and in row bands over every rank of the world
    (``xfuse.parallel.vae_decode``); times on ``where``, memory in the config's dtype."""

    shape: VaeShape
    batch: int  # images decoded per request
    element: int  # bytes per element of the config's dtype
    world: int  # ranks of the world: the band decode's
    parallel: bool  # this config decodes this request over the world (``parallel.vae_parallel``)
    why: str  # the rule that decided it, in words
    holders: tuple[int, ...]  # ranks that load the VAE's weights
    where: Machine | None  # None: this machine's GPU has no profile (no times)
    serial: RankDecode  # rank 0 decoding alone
    bands: list[RankDecode]  # each rank's share over the world; empty with one rank or too few latent rows
    serial_time: DecodeTime | None
    band_time: DecodeTime | None
    whole: list[WholeTensor]  # the whole-image tensors on rank 0, however the decode is split

    @property
    def weight_bytes(self) -> int:
        """The VAE's parameters (encoder and decoder) on each rank that loads it."""
        return self.shape.parameters() * self.element


def vae_plan(config: XfuseConfig, height: int, width: int, where: Machine | None) -> VaePlan | str:
    """The decode of a ``height`` x ``width`` px request of ``config`` on ``where`` (None: no times, the memory as on
    a GPU), or why it is not modelled."""
    from xfuse.perf.calibration import FITTED

    raw = vae_config(config.model)
    if raw is None:
        return "not modelled: the model's folder has no vae/config.json"
    try:
        shape = VaeShape.from_config(raw)
    except ValueError as err:
        return f"not modelled: {err}"
    par, world, batch = config.parallel, config.world_size, 1  # one image per request (generate; serve's n = 1)
    element = torch.empty((), dtype=config.runtime.torch_dtype()).element_size()
    rows = height // shape.scale_factor
    parallel = decodes_in_parallel(par, world, height, width, rows)  # ConfigError where a run would refuse it
    why = _decode_rule(config, height, width, rows, parallel, VAE_PARALLEL_MIN_PIXELS)
    holders = tuple(range(world)) if vae_on_every_rank(par, world, raw.get("_class_name", "AutoencoderKL")) else (0,)
    scratch = conv_scratch_on(where)

    def seconds(ranks: int) -> DecodeTime | None:  # as the performance model costs the device: in its dtype
        if where is None:
            return None
        return predict_decode(shape, height=height, width=width, batch=batch, ranks=ranks, machine=where,
                              calibration=FITTED, element=where.device.dtype_bytes)  # fmt: skip

    # Memory in the config's dtype.
    (serial,) = decode_ranks(shape, height=height, width=width, batch=batch, element=element, conv_scratch=scratch)
    bands: list[RankDecode] = []
    if 1 < world <= rows:
        bands = decode_ranks(shape, height=height, width=width, batch=batch, ranks=world, element=element,
                             conv_scratch=scratch)  # fmt: skip
    whole = whole_image_tensors(shape, height=height, width=width, batch=batch, element=element)
    return VaePlan(shape, batch, element, world, parallel, why, holders, where, serial, bands, seconds(1),
                   seconds(world) if bands else None, whole)  # fmt: skip


def _decode_rule(config: XfuseConfig, height: int, width: int, rows: int, parallel: bool, least: int) -> str:
    """Why a request decodes over the world or on rank 0 alone, in words (``least``: auto's pixels per image)."""
    par, world = config.parallel, config.world_size
    if world == 1:
        return "one rank"
    if par.vae_parallel == "off":
        return "parallel.vae_parallel off"
    if rows < world:
        return f"auto, and the latent's {rows} rows are fewer than the {world} ranks"
    if par.vae_parallel == "on":
        return "parallel.vae_parallel on"
    side = round(least**0.5)
    return f"auto: {height}x{width} px is {'at least' if parallel else 'below'} {side}x{side}"


@dataclass(frozen=True)
class VideoVaePlan:
    """A clip's decode by a causal 3-D VAE, each rank's share traced (``xfuse.perf.video_vae``): rank 0 alone and
    in row bands over every rank of the world (``xfuse.parallel.video_vae_decode``); times on ``where``, memory in
    the config's dtype."""

    vae_class: str
    latent: tuple[int, int, int]  # latent frames, rows, columns of one clip
    pixels: tuple[int, int, int]  # its frames, height, width
    weight_bytes: int  # the VAE's parameters (encoder and decoder) on each rank that loads it
    world: int
    parallel: bool  # this config decodes this request over the world (``parallel.vae_parallel``)
    why: str
    holders: tuple[int, ...]  # ranks that load the VAE's weights
    where: Machine | None
    serial: RankDecode  # rank 0 decoding alone
    bands: list[RankDecode]  # each rank's share over the world; empty with one rank or too few latent rows
    serial_time: DecodeTime | None
    band_time: DecodeTime | None
    clip_bytes: int  # the decoded clip, (1, 3, frames, H, W) in the config's dtype: on rank 0 however it is split


def video_vae_plan(config: XfuseConfig, height: int, width: int, frames: int, where: Machine | None) -> VideoVaePlan:
    """The decode of one ``frames``-latent-frame clip of ``height`` x ``width`` px of ``config``'s model (a causal 3-D
    VAE the bands run) on ``where`` (None: no times)."""
    from xfuse.perf.calibration import FITTED

    model, par, world = config.model, config.parallel, config.world_size
    spec, dtype = model_spec(model), config.runtime.torch_dtype()
    rows, cols = height // spec.vae_scale_factor, width // spec.vae_scale_factor
    parallel = decodes_in_parallel(par, world, height, width, rows, video=True)  # ConfigError as a run would
    why = _decode_rule(config, height, width, rows, parallel, VIDEO_VAE_PARALLEL_MIN_PIXELS)
    raw = vae_config(model) or {}
    holders = tuple(range(world)) if vae_on_every_rank(par, world, raw.get("_class_name")) else (0,)
    trace = partial(traced_decode_ranks, model, frames=frames, rows=rows, cols=cols, dtype=dtype)
    (serial,), bands = trace(ranks=1), list(trace(ranks=world)) if 1 < world <= rows else []

    def seconds(ranks: int) -> DecodeTime | None:
        if where is None:
            return None
        return predict_video_decode(model, frames=frames, rows=rows, cols=cols, ranks=ranks, machine=where,
                                    calibration=FITTED, dtype=dtype)  # fmt: skip

    pixel_frames = spec.pixel_frames(frames)
    clip = 3 * pixel_frames * height * width * torch.empty((), dtype=dtype).element_size()
    return VideoVaePlan(raw.get("_class_name", "?"), (frames, rows, cols), (pixel_frames, height, width),
                        vae_weight_bytes(model, dtype), world, parallel, why, holders, where, serial, bands,
                        seconds(1), seconds(world) if bands else None, clip)  # fmt: skip


@dataclass(frozen=True)
class PlanReport:
    """What ``config`` will do on its world, computed without one (``xfuse plan`` prints it)."""

    config: XfuseConfig
    generation: GenerationConfig  # the request planned for: config.generation, or its defaults when it has none
    spec: ModelSpec
    num_blocks: int
    hidden_size: int
    patch_size: int
    height: int  # pixels
    width: int
    frames: int  # a video's latent frames (stacked into the grid's rows); 1 for an image
    grid: PatchGrid
    plan: StagePlan
    batch: int  # transformer batch of one CFG group
    volume: dict[int, dict[str, int]]  # rank -> kind -> bytes it sends per denoising step
    kv_bytes: dict[int, int]  # rank -> stale K/V buffer bytes
    param_bytes: dict[int, int]  # rank -> transformer parameter bytes it keeps
    ceiling: float  # the schedule's speedup over one rank when only the blocks cost (``speedup_ceiling``)
    experts: int = 1  # transformers each rank keeps its blocks of (Wan 2.2's two experts: 2)
    vae: VaePlan | VideoVaePlan | str = "not modelled"  # the decode, or why it is not modelled
    controlnet_layers: int = 0  # a ControlNet of that many blocks run with the request (0: none)
    control_counts: dict[int, int] | None = None  # rank -> ControlNet residuals it receives per patch
    memory: Placed | None = None  # each pipeline rank's device memory with the text encoders placed
    device_memory: float | None = None  # bytes of ``where``'s device (None: not known, not limited)
    device_name: str = ""


def plan_report(
    config: XfuseConfig, where: Machine | None = None, controlnet_layers: int = 0, text_tokens: int | None = None
) -> PlanReport:
    """Blocks, patches, skips, bytes per step and memory per rank for ``config`` (validated first), and its VAE
    decode costed on ``where`` (default: this machine's device, :func:`local_machine`; a GPU without a profile
    leaves the decode's times out). ``controlnet_layers``: a ControlNet of that many blocks runs with the request
    (its residuals counted as ``control`` bytes). ``text_tokens``: the tokens the first patch's stream carries, where
    the family keeps a prompt at its own length (``ModelSpec.text_padded`` False) and the prompt is known; default
    ``sum(spec.text_lengths)``, the most."""
    if where is None:
        try:
            where = local_machine(config.world_size)
        except ConfigError:  # this machine's GPU has no profile in xfuse.perf.hardware
            where = None
    resolved = resolve(config.model)
    spec, model = resolved.spec, resolved.transformer
    patch_size, num_blocks, vae = spec.token_patch(model), spec.num_blocks(model), spec.latent_scale
    hidden = spec.width(model)
    # A config built in Python without a request section plans the default request, as a YAML file without one does.
    generation = config.generation if config.generation is not None else GenerationConfig()
    width, height, num_frames = request_size(config, resolved)  # the image or clip xfuse generate would make
    frames = spec.latent_frames(num_frames)  # a video's latent frames, stacked into the grid's rows
    spec.check_layout(config.parallel, num_blocks=num_blocks, patch_size=patch_size, height=height, width=width,
                      num_heads=spec.num_heads(model), latent_frames=frames)  # fmt: skip
    par = config.parallel
    plan = spec.plan(num_blocks, par, controlnet_layers)
    experts = transformer_count(config.model)
    video_vae = (vae_config(config.model) or {}).get("_class_name") in VIDEO_BAND_DECODED_VAES
    text = sum(spec.text_lengths) if text_tokens is None else text_tokens
    stream_tokens = {stream: text for stream in plan.streams}  # the text the first patch carries
    lead = sum(stream_tokens.values())
    grid = patch_grid(frames * (height // vae), width // vae, par.resolved_num_patches, patch_size, lead)
    dtype = config.runtime.torch_dtype()
    element = torch.empty((), dtype=dtype).element_size()
    # diffusers batches [uncond, cond] for classifier-free guidance; FLUX.1-dev embeds its guidance_scale instead
    cfg_batch = spec.cfg_batch(generation.guidance_scale, generation.negative_prompt)
    batch = cfg_batch // par.cfg_degree  # each CFG group runs its half
    control_counts = None
    if controlnet_layers:
        from xfuse.perf.planner import workload

        control = workload(config, _controlnet(controlnet_layers)).control()
        control_counts = None if control is None else control.counts(plan)
    stale_kv = keeps_stale_kv(grid.num_patches, par.warmup_steps, generation.num_inference_steps,
                              config.cache.enabled)  # fmt: skip
    held = pipeline_rank_bytes(spec, model, plan, grid, batch=batch, dtype=dtype, experts=experts, stale_kv=stale_kv,
                               adapter=par.adapter)  # fmt: skip
    device_memory = where.device.memory if where is not None else None
    from xfuse.perf.planner import workload

    memory = place_text(config.model, workload(config), par, dtype, device_memory, conv_scratch=conv_scratch_on(where))
    volume = comm_volume(
        plan,
        grid,
        hidden_size=hidden,
        batch=batch,
        latent_batch=1,
        in_channels=model["in_channels"],
        dtype_bytes=element,
        stream_tokens=stream_tokens,
        control_residuals=control_counts,
    )
    return PlanReport(
        config=config,
        generation=generation,
        spec=spec,
        num_blocks=num_blocks,
        hidden_size=hidden,
        patch_size=patch_size,
        height=height,
        width=width,
        frames=frames,
        grid=grid,
        plan=plan,
        batch=batch,
        volume=volume,
        kv_bytes=held[1],
        param_bytes=held[0],
        experts=experts,
        ceiling=speedup_ceiling(
            plan,
            grid.cost_tokens,
            num_steps=generation.num_inference_steps,
            warmup_steps=par.warmup_steps,
            batch_parts=batch_parts(batch, par.pipefusion_degree, config.cache.enabled),
        ),
        vae=video_vae_plan(config, height, width, frames, where)
        if video_vae
        else vae_plan(config, height, width, where),
        controlnet_layers=controlnet_layers,
        control_counts=control_counts,
        memory=memory,
        device_memory=device_memory,
        device_name=where.device.name if where is not None else "",
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def predicted_latency(r: PlanReport, link: str) -> str:
    """The performance model's latency for this plan on ``link`` (``<device>-<link>``, e.g. ``a100-nvlink``), on one
    node: ``xfuse plan --predict``."""
    from xfuse.perf.calibration import FITTED
    from xfuse.perf.hardware import DEVICES, LINKS
    from xfuse.perf.model import machine, predict
    from xfuse.perf.planner import workload

    known = [k for k in LINKS if k.split("-")[0] in DEVICES]
    if link not in known:
        raise ConfigError("--predict", f"must be one of {', '.join(known)} (got {link!r})")
    device, kind = link.split("-")
    where = machine(device, kind, r.config.world_size)
    controlnet = _controlnet(r.controlnet_layers) if r.controlnet_layers else None
    p = predict(workload(r.config, controlnet), r.config.parallel, where, FITTED)
    outside = f" + {p.outside:.2f} s outside it" if where.device.gpu else " (the loop only on a CPU)"
    # the model's patch passes are the eager curve (gpu.md, gpu_h200.md): a captured pass is not measured yet
    mode = r.config.compile.mode
    priced = "eager stage passes" + (f"; compile.mode {mode} priced as eager, unmeasured" if mode != "off" else "")
    return (
        f"predicted latency ({where.device.name}, {where.link.name}): {p.seconds:.2f} s per "
        f"{'clip' if r.spec.video else 'image'}: loop "
        f"{p.loop:.2f} s{outside} ({priced}; xfuse.perf; its error on published points: docs/performance.md)"
    )


def _row(token: int, token_cols: int) -> str:
    """A token's place in rows: ``14`` at a row's start, ``14.56`` inside row 14 (a patch cut by cost)."""
    rows, cols = divmod(token, token_cols)
    return str(rows) if not cols else f"{token / token_cols:.2f}"


def _geometry(r: PlanReport) -> str:
    """The request's pixels, latent and tokens; a video's latent frames stacked into the patch grid's rows."""
    grid = r.grid
    if not r.spec.video:
        return (
            f"image {r.height}x{r.width} px -> latent {grid.latent_height}x{grid.latent_width} -> "
            f"{grid.token_rows}x{grid.token_cols} tokens"
        )
    frames, rows = r.frames, grid.latent_height // r.frames
    num_frames = r.spec.pixel_frames(frames)
    return (
        f"video {num_frames} frames of {r.height}x{r.width} px -> latent {frames}x{rows}x{grid.latent_width} -> "
        f"{frames}x{rows // r.patch_size}x{grid.token_cols} = {grid.num_tokens} tokens, patches "
        f"{r.config.parallel.video_patches} ({grid.token_rows} stacked token rows)"
    )


def _cache_lines(config: XfuseConfig, steps: int, num_patches: int) -> list[str]:
    """What step caching does with this plan (which steps it skips depends on the request: xfuse generate and serve's
    /metrics count them)."""
    cache = config.cache
    if not cache.enabled:
        return []
    always = always_computed(cache, steps, config.parallel.warmup_steps, num_patches)
    most = most_skipped(cache, steps, always)
    stages = config.parallel.pipefusion_degree
    # a skipped step cannot start its last patch before the step before left the route (docs/design.md §11)
    refill = (
        f"; pipelined over {stages} stages and {num_patches} patches, a run of skipped steps drains and refills the "
        f"pipeline: it saves its steps less {(stages - 1) / num_patches:.3g} of a pipelined step"
        if stages > 1 and first_pipelined_step(steps, config.parallel.warmup_steps, num_patches) is not None
        else ""
    )
    return [
        f"step cache: {cache.method}, threshold {cache.threshold}: block 0 always runs; each step's first patch "
        f"decides after it and carries the decision with its hand-offs (a 1-element message); steps "
        f"{_ranges(always)} always computed, at most {most} of {steps} skipped (which ones depends on the "
        f"request: xfuse generate prints them, serve counts them in /metrics){refill}"
    ]


def format_plan_report(r: PlanReport) -> str:
    """The report as the text ``xfuse plan`` prints."""
    config, plan, grid = r.config, r.plan, r.grid
    par = config.parallel
    shares = [tokens / sum(grid.cost_tokens) for tokens in grid.cost_tokens]  # a patch's work is its tokens'
    carried = f"; patch 0 also carries the {grid[0].lead_tokens} text tokens" if grid[0].lead_tokens else ""
    lines = [
        f"model {config.model} ({r.spec.name}): {r.num_blocks} blocks, hidden {r.hidden_size}, "
        f"patch size {r.patch_size}"
        + (
            f"; {r.experts} experts (each rank keeps its blocks of every one; a step runs one)" if r.experts > 1 else ""
        ),
        _geometry(r) + f"; transformer batch {r.batch}; {config.runtime.dtype}",
        f"world {config.world_size} = pipefusion {par.pipefusion_degree} x cfg {par.cfg_degree}"
        + (f" x ulysses {par.ulysses_degree} x ring {par.ring_degree}" if par.sequence_degree > 1 else "")
        + "; placement "
        f"{plan.placement}; {grid.num_patches} patches; warm-up {par.warmup_steps} of "
        f"{r.generation.num_inference_steps} steps",
        *_cache_lines(config, r.generation.num_inference_steps, grid.num_patches),
        "patches (token rows, tokens, share of the work): "
        + "  ".join(
            f"{b.index}:[{_row(b.token_start, grid.token_cols)},{_row(b.token_stop, grid.token_cols)}) "
            f"{b.num_tokens} {s:.1%}"
            for b, s in zip(grid, shares, strict=True)
        )
        + carried,
        f"schedule's ceiling: {r.ceiling:.2f}x the loop of one rank (blocks only: no communication, no per-pass "
        "costs; xfuse.parallel.costs.speedup_ceiling)",
        "route of a patch: " + " -> ".join(f"r{s.rank}[{_ranges(s.blocks)}]" for s in plan.route),
        f"what crosses ranks per patch ({r.spec.name}): {r.spec.crosses_per_patch}",
        "cross-rank skips: "
        + (
            ", ".join(f"{s.producer}->{s.consumer} (r{s.src_rank}->r{s.dst_rank})" for s in plan.cross_rank_skips)
            or "none"
        ),
        *_control_lines(r),
        "",
        f"{'rank':>4}  {'blocks':<22} {'params':>12} {'K/V buffers':>12}  "
        + "  ".join(f"{'sent ' + k:>12}" for k in _kinds(r))
        + "   (bytes sent per denoising step)",
    ]
    kinds = _kinds(r)
    for rank in range(plan.degree):
        vol = r.volume[rank]
        lines.append(
            f"{rank:>4}  {_ranges(plan.blocks_of(rank)):<22} {_mib(r.param_bytes[rank]):>12} "
            f"{_mib(r.kv_bytes[rank]):>12}  " + "  ".join(f"{_mib(vol[k]):>12}" for k in kinds)
        )
    total = sum(sum(v.values()) for v in r.volume.values())
    lines.append(f"total sent per denoising step (one pipeline group): {_mib(total)}")
    if par.sequence_degree > 1:
        sp = par.sequence_degree
        lines.append(
            f"sequence parallelism: each rank above is a group of {sp} ranks (ulysses {par.ulysses_degree} x ring "
            f"{par.ring_degree}); each holds about 1/{sp} of its K/V buffers and sends about 1/{sp} of its "
            "hand-offs (its chunk of the tokens); the attention's own messages (Ulysses all-to-all, Ring K/V "
            "blocks) are not counted here"
        )
    return "\n".join([*lines, "", *_memory_lines(r), "", *_vae_lines(r.vae)])


def _memory_lines(r: PlanReport) -> list[str]:
    """What each pipeline rank's device holds (``xfuse.perf.memory``), the text encoders placed, against the device."""
    m = r.memory
    if m is None:
        return []
    sp = r.config.parallel.sequence_degree
    lines = [
        f"memory per pipeline rank, {r.config.runtime.dtype} (each rank of its SP and CFG groups alike; K/V: one "
        f"rank's{f' 1/{sp}' if sp > 1 else ''}; text encoders and VAE: the rank of rank 0's pipeline group):",
        f"{'rank':>4}  {'transformer':>12} {'stale K/V':>12} {'text enc':>12} {'VAE':>12} {'activations':>12} "
        f"{'total':>12}",
    ]
    for rank in m.ranks:
        lines.append(f"{rank.pipe_rank:>4}  {_mib(rank.param_bytes):>12} {_mib(rank.kv_bytes):>12} "
                     f"{_mib(rank.text_bytes):>12} {_mib(rank.vae_bytes):>12} {_mib(rank.activation_bytes):>12} "
                     f"{_mib(rank.total):>12}")  # fmt: skip
    text = m.words(r.config.parallel.text_encoder)
    if any(rank.activation_bytes for rank in m.ranks):
        decode = "xfuse.perf.video_vae: traced" if isinstance(r.vae, VideoVaePlan) else "xfuse.perf.vae"
        how = ("activations: the request traced on the meta device (xfuse.perf.activations) and the decode "
               f"({decode}); a kernel's own workspace not counted")  # fmt: skip
    else:
        how = "activations not counted (a model folder is not traced)"
    if r.device_memory is None:
        lines.append(f"{text}; the device's memory is not known here (give --device); {how}")
    else:
        verdict = "fits" if m.fits else f"does not fit: {m.busiest.describe(r.device_memory)}"
        lines.append(f"{text}; against {r.device_name}'s {r.device_memory / GIB:.1f} GiB: {verdict}; {how}")
    return lines


def _controlnet(layers: int) -> dict:
    """A ControlNet's block counts (``Workload.controlnet``) for ``--controlnet-layers``: double-stream blocks only
    for FLUX, as its ControlNets ship."""
    return {"num_layers": layers, "num_single_layers": 0}


def _kinds(r: PlanReport) -> tuple[str, ...]:
    """The kinds of bytes the report's table has a column for."""
    return KINDS + r.plan.streams + (("control",) if r.controlnet_layers else ())


def _control_lines(r: PlanReport) -> list[str]:
    """Where a ControlNet runs and where its residuals go (``xfuse plan --controlnet-layers``)."""
    if not r.controlnet_layers:
        return []
    plan = r.plan
    takes = ", ".join(f"r{rank} {n}" for rank, n in (r.control_counts or {}).items()) or "none"
    return [
        f"ControlNet: {r.controlnet_layers} blocks on rank {plan.embed_rank} (the embedding rank), once per patch "
        f"with its own stale K/V; its residuals go with each patch to the ranks whose blocks add them, "
        f"(B, patch tokens, hidden) each: {takes}"
    ]


def _seconds(t: float) -> str:
    return f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.1f} ms"


def _tensor(t: WholeTensor) -> str:
    return f"{t.name} {tuple(t.shape)} {_mib(t.nbytes)}"


def _decode_timing(where: Machine | None, serial: DecodeTime | None, bands: DecodeTime | None, world: int,
                   source: str) -> str:  # fmt: skip
    """The plan's line of predicted decode times: rank 0 alone and over the world's ranks."""
    if where is None or serial is None:
        return "predicted decode: none (this machine's GPU has no profile in xfuse.perf.hardware; give --device)"
    timing = f"predicted decode ({where.device.name}, {where.link.name}): rank 0 alone {_seconds(serial.seconds)}"
    if bands is not None:
        timing += (
            f"; over {world} ranks {_seconds(bands.seconds)} = compute {_seconds(bands.compute)} + {bands.layers} "
            f"exchanges {_seconds(bands.exchange)} ({_mib(bands.sent)} sent by the busiest rank)"
        )
    elif world > 1:
        timing += f"; not over {world} ranks: a band needs a latent row"
    return timing + f" ({source}; not fitted to decodes)"


def _video_vae_lines(v: VideoVaePlan) -> list[str]:
    """The plan's VAE decode section for a clip."""
    (frames, rows, cols), (pixel_frames, height, width), world = v.latent, v.pixels, v.world
    lines = [
        f"VAE decode: {v.vae_class} (causal 3-D), latent {frames}x{rows}x{cols} -> {pixel_frames} frames of "
        f"{height}x{width} px; {v.serial.flops / 1e12:.2f} TFLOP per clip; weights {_mib(v.weight_bytes)} on "
        f"rank(s) {_ranges(v.holders)}",
        f"this request decodes {f'in row bands over the {world} ranks' if v.parallel else 'on rank 0 alone'} "
        f"({v.why}; xfuse.parallel.video_vae_decode)",
    ]
    lines.append(_decode_timing(v.where, v.serial_time, v.band_time, world, "traced: xfuse.perf.video_vae"))
    lines.append(f"{'rank':>4}  {'latent rows':<12} {'weights':>12} {'alone':>12} {'in bands':>12}   "
                 "(activation peak of the decode, traced; alone: rank 0 decoding the whole clip)")  # fmt: skip
    start = 0
    for rank in range(world):
        span = "-"
        if v.bands:
            span, start = f"[{start},{start + v.bands[rank].rows})", start + v.bands[rank].rows
        weights = _mib(v.weight_bytes) if rank in v.holders else "-"
        alone = _mib(v.serial.peak) if rank == 0 else "-"
        banded = _mib(v.bands[rank].peak) if v.bands else "-"
        lines.append(f"{rank:>4}  {span:<12} {weights:>12} {alone:>12} {banded:>12}")
    joined = " (twice while rank 0 joins the bands: counted in its peak)" if v.bands else ""
    lines.append(f"the decoded clip (1, 3, {pixel_frames}, {height}, {width}) {_mib(v.clip_bytes)} on rank 0 "
                 f"only{joined}; a kernel's workspace not counted")  # fmt: skip
    return lines


def _vae_lines(v: VaePlan | VideoVaePlan | str) -> list[str]:
    """The plan's VAE decode section."""
    if isinstance(v, VideoVaePlan):
        return _video_vae_lines(v)
    if isinstance(v, str):
        return [f"VAE decode: {v}"]
    shape, world, where = v.shape, v.world, v.where
    lines = [
        f"VAE decode: AutoencoderKL {list(shape.block_out_channels)}, layers_per_block {shape.layers_per_block}, "
        f"{shape.latent_channels} latent channels, x{shape.scale_factor}; {v.serial.flops / 1e9:.2f} GFLOP per image; "
        f"weights {_mib(v.weight_bytes)} on rank(s) {_ranges(v.holders)}",
        f"this request decodes {f'in row bands over the {world} ranks' if v.parallel else 'on rank 0 alone'} "
        f"({v.why}; xfuse.parallel.vae_decode)",
    ]
    lines.append(_decode_timing(where, v.serial_time, v.band_time, world, "xfuse.perf.vae"))
    lines.append(f"{'rank':>4}  {'latent rows':<12} {'weights':>12} {'alone':>12} {'in bands':>12}   "
                 "(activation peak of the decode; alone: rank 0 decoding the whole image)")  # fmt: skip
    bands = band_rows(v.whole[0].shape[2], world) if v.bands else []
    start = 0
    for rank in range(world):
        rows = "-"
        if bands:
            rows, start = f"[{start},{start + bands[rank]})", start + bands[rank]
        weights = _mib(v.weight_bytes) if rank in v.holders else "-"
        alone = _mib(v.serial.peak) if rank == 0 else "-"
        banded = _mib(v.bands[rank].peak) if v.bands else "-"
        lines.append(f"{rank:>4}  {rows:<12} {weights:>12} {alone:>12} {banded:>12}")
    peaks = [f"alone at {v.serial.peak_at}"] + ([f"in bands at {v.bands[0].peak_at}"] if v.bands else [])
    cpu = where is not None and not where.device.gpu
    lines.append(f"largest live tensors: {'; '.join(peaks)}" + ("; oneDNN's working copies counted (a CPU)"
                 if cpu else "; convolution workspaces not counted"))  # fmt: skip
    joined = " (twice while rank 0 joins the bands)" if v.bands else ""
    lines.append(
        "whole-image tensors, on rank 0 only however the decode is split: "
        + "; ".join(_tensor(t) + (joined if t.name == "decoded image" else "") for t in v.whole)
    )
    return lines
