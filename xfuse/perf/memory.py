"""What each rank of a layout holds on its device, and whether that fits: the memory side of ``xfuse plan`` and
``xfuse plan --auto``, and the rule that places the text encoders (``parallel.text_encoder``).

Counted, per rank, in the dtype the ranks run in, each from the real sharding applied to a weightless (meta) model:
the transformer parameters it keeps (a pipeline rank's blocks and what its stage keeps besides them; every rank of a
sequence- or CFG-parallel group a full copy of its pipeline rank's), its stale K/V buffers (a sequence-parallel rank
holds its chunk of the tokens' K/V), the text encoders' weights on its device (:func:`text_encoder_bytes`: whole on
rank 0, split by layers over the pipeline group, or offloaded: one module at a time), the VAE's weights where it
loads them, and what a request makes beside them at its peak (:func:`activation_bytes`: the request traced through
xfuse's own pipeline on the meta device, ``xfuse.perf.activations``, and the VAE decode's peak, ``xfuse.perf.vae``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache, partial

import torch

from xfuse.families.registry import PRESET_MODELS, text_encoder_configs, transformer_count, vae_config
from xfuse.families.spec import ModelSpec
from xfuse.parallel.costs import keeps_stale_kv, kv_buffer_bytes, receive_buffer_bytes
from xfuse.parallel.patch_grid import PatchGrid
from xfuse.parallel.schedule import batch_parts
from xfuse.parallel.text_encoder_split import decoder_layers, shard_text_encoder
from xfuse.parallel.vae_decode import (
    BAND_DECODED_VAES,
    IMAGE_BAND_DECODED_VAES,
    VIDEO_BAND_DECODED_VAES,
    decodes_in_parallel,
    vae_on_every_rank,
)
from xfuse.perf.activations import RequestActivations, request_activations
from xfuse.perf.model import Workload
from xfuse.perf.trace_cache import on_disk
from xfuse.perf.vae import ConvScratch, VaeShape, decode_ranks
from xfuse.perf.video_vae import traced_decode_ranks

GIB = 1024**3


def stage_parameter_bytes(spec: ModelSpec, model_config: dict, plan, dtype: torch.dtype,
                          adapter: str = "family") -> dict[int, int]:  # fmt: skip
    """Transformer parameter bytes each rank keeps, from the real sharding applied to a weightless (meta) model by
    ``adapter``'s stage (``parallel.adapter``: the generic one keeps the non-block modules on every rank)."""
    element = torch.empty((), dtype=dtype).element_size()
    config = json.dumps({k: v for k, v in model_config.items() if not k.startswith("_")}, sort_keys=True)
    return {rank: n * element for rank, n in enumerate(_stage_parameter_counts(spec, config, plan, adapter))}


@lru_cache(maxsize=256)
@on_disk(lambda spec, config, plan, adapter: (spec.name, config, plan, adapter))
def _stage_parameter_counts(spec: ModelSpec, config: str, plan, adapter: str) -> tuple[int, ...]:
    """Parameters each rank of ``plan`` keeps of the transformer of ``config`` (its JSON): once per model, plan and
    adapter, as ``xfuse plan --auto`` ranks dozens of layouts whose plans repeat (building a weightless model still
    runs every layer's initialiser: 0.4 s for FLUX.1-dev)."""
    import diffusers

    model_class = getattr(diffusers, spec.diffusers_transformer)
    stage_class = spec.forward_stage_class() if adapter == "generic" else spec.stage_class()
    counts = []
    for rank in range(plan.degree):
        with torch.device("meta"):
            stage = stage_class(model_class(**json.loads(config)), plan, rank)
        counts.append(sum(p.numel() for p in stage.parameters()))
    return tuple(counts)


def _meta_text_encoder(config: dict) -> torch.nn.Module:
    """A weightless text encoder of ``config`` (its transformers config.json, naming its class)."""
    import transformers

    model_class = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        return model_class(model_class.config_class.from_dict(config))


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@lru_cache(maxsize=64)
@on_disk(lambda model, placement, pipe_degree: (model, placement, pipe_degree) if model in PRESET_MODELS else None)
def _text_encoder_counts(model: str, placement: str, pipe_degree: int) -> tuple[int, ...]:
    """Parameters each pipeline rank's device holds of ``model``'s text encoders under ``placement`` (an encoder
    that cannot be split stays whole on rank 0 under ``split``)."""
    counts = [0] * pipe_degree
    for config in text_encoder_configs(model).values():
        encoder = _meta_text_encoder(config)
        if placement == "offload":  # accelerate's cpu_offload: one module's own weights on the device while it runs
            largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in encoder.modules())
            counts[0] = max(counts[0], largest)
            continue
        found = decoder_layers(encoder)
        if placement == "rank0" or pipe_degree == 1 or found is None or len(found[1]) < pipe_degree:
            counts[0] += _numel(encoder)
            continue
        for index in range(pipe_degree):  # the real sharding, on a fresh weightless copy per rank
            share = encoder if index == 0 else _meta_text_encoder(config)
            shard_text_encoder(share, index, pipe_degree)
            counts[index] += _numel(share)
    return tuple(counts)


def text_encoder_bytes(model: str, placement: str, pipe_degree: int, dtype: torch.dtype) -> dict[int, int]:
    """Bytes of ``model``'s text-encoder weights on each pipeline rank's device under ``placement`` (``rank0``,
    ``split`` or ``offload``; ``split`` over ``pipe_degree`` ranks)."""
    element = torch.empty((), dtype=dtype).element_size()
    counts = _text_encoder_counts(model, placement, pipe_degree)
    return {rank: n * element for rank, n in enumerate(counts)}


@lru_cache(maxsize=64)
def vae_weight_bytes(model: str, dtype: torch.dtype) -> int:
    """The VAE's parameters in ``dtype``: its diffusers class (the config's ``_class_name``) built weightless from
    its config (0 where the model has no VAE config)."""
    import diffusers

    raw = vae_config(model)
    if raw is None:
        return 0
    vae_class = getattr(diffusers, raw.get("_class_name", "AutoencoderKL"))
    with torch.device("meta"):
        vae = vae_class(**{key: value for key, value in raw.items() if not key.startswith("_")})
    return _numel(vae) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class RankMemory:
    """What one pipeline rank of a layout holds (each rank of its SP and CFG groups as much, but the text encoders
    and the VAE: those are counted for the rank of the pipeline group of global rank 0, which holds the most)."""

    pipe_rank: int
    param_bytes: int  # its share of the transformer
    kv_bytes: int  # its stale K/V buffers
    text_bytes: int = 0  # text-encoder weights on its device
    vae_bytes: int = 0  # the VAE's weights, where it loads them
    activation_bytes: int = 0  # what a request makes beside all these at its peak (activation_bytes)

    @property
    def total(self) -> int:
        return self.param_bytes + self.kv_bytes + self.text_bytes + self.vae_bytes + self.activation_bytes

    def describe(self, device_memory: float) -> str:
        """``pipeline rank 0 needs 61.3 GiB (transformer 58.7, stale K/V 2.6, text encoders 0.0, VAE 0.0,
        activations 1.2) of 45.0 GiB``."""
        return (
            f"pipeline rank {self.pipe_rank} needs {self.total / GIB:.1f} GiB (transformer {self.param_bytes / GIB:.1f}"
            f", stale K/V {self.kv_bytes / GIB:.1f}, text encoders {self.text_bytes / GIB:.1f}, VAE "
            f"{self.vae_bytes / GIB:.1f}, activations {self.activation_bytes / GIB:.1f}) of {device_memory / GIB:.1f} "
            "GiB"
        )


def pipeline_rank_bytes(
    spec: ModelSpec, model_config: dict, plan, grid: PatchGrid, *, batch: int, dtype: torch.dtype, experts: int,
    stale_kv: bool = True, adapter: str = "family",
) -> tuple[dict[int, int], dict[int, int]]:  # fmt: skip
    """(parameter bytes, stale K/V buffer bytes) each pipeline rank of ``plan`` keeps: its share of the transformer
    (of each of ``experts`` transformers: Wan 2.2's two) and, where the request keeps them at all (``stale_kv``:
    ``xfuse.parallel.costs.keeps_stale_kv``), the whole image's K/V for its blocks, a transformer batch of ``batch``
    (``xfuse plan`` prints them; a sequence-parallel rank holds 1/sp of the K/V)."""
    element = torch.empty((), dtype=dtype).element_size()
    hidden = spec.width(model_config)
    kv = kv_buffer_bytes(plan, grid, hidden_size=hidden, batch=batch, dtype_bytes=element,
                         attentions=lambda block: spec.attentions_of_block(model_config, block))  # fmt: skip
    params = stage_parameter_bytes(spec, model_config, plan, dtype, adapter)
    return {rank: n * experts for rank, n in params.items()}, (kv if stale_kv else dict.fromkeys(kv, 0))


def rank_memory(model: str, work: Workload, parallel, dtype: torch.dtype, text: str = "rank0", *,
                conv_scratch: ConvScratch | None = None) -> list[RankMemory]:  # fmt: skip
    """Each pipeline rank's memory for ``work`` (the request of model ``model``) under ``parallel`` (a
    ParallelConfig), in ``dtype``, with the text encoders placed by ``text`` (``rank0``, ``split``, ``offload``);
    ``conv_scratch``: what a convolution allocates beside its output on the ranks' device (``xfuse.perf.vae``)."""
    made = layout_activations(model, work, parallel, dtype, conv_scratch=conv_scratch)
    return _with_text(_without_text(model, work, parallel, dtype), made, model, text, dtype)


def _with_text(ranks: list[RankMemory], made: LayoutActivations | None, model: str, text: str,
               dtype: torch.dtype) -> list[RankMemory]:  # fmt: skip
    """``ranks`` with the text encoders' weights each holds under placement ``text``, and its activations."""
    texts = text_encoder_bytes(model, text, len(ranks), dtype)
    return [replace(rank, text_bytes=texts[rank.pipe_rank],
                    activation_bytes=0 if made is None else made.on(rank.pipe_rank, text))
            for rank in ranks]  # fmt: skip


def _request_traced(model: str, work: Workload, dtype: torch.dtype) -> RequestActivations | None:
    """The request traced (``xfuse.perf.activations``); ``None`` for a model folder (only presets are traced)."""
    if model not in PRESET_MODELS:
        return None
    spec = work.spec
    frames = None if not spec.video else spec.pixel_frames(work.frames)
    negative = spec.negative_prompt_guides and work.cfg_batch == 2
    raw = vae_config(model)
    traced_decode = raw is not None and raw.get("_class_name", "AutoencoderKL") not in BAND_DECODED_VAES
    return request_activations(model, work.height, work.width, frames, negative_prompt=negative, dtype=dtype,
                               trace_decode=traced_decode)  # fmt: skip


def decode_bytes(model: str, work: Workload, parallel, dtype: torch.dtype, *,
                 conv_scratch: ConvScratch | None = None) -> dict[int, int]:  # fmt: skip
    """Pipeline rank -> the activation peak of its part of the VAE decode (one image or clip): rank 0 decoding
    alone, or each rank its band where the request decodes over the world (``xfuse.perf.vae``: the image VAEs the
    bands run; ``xfuse.perf.video_vae``: Wan's 3-D VAE, traced); empty where the model has no VAE or the bands cannot
    run its VAE (Qwen-Image's 3-D VAE: traced with the request instead, :func:`layout_activations`)."""
    raw = vae_config(model)
    vae_class = None if raw is None else raw.get("_class_name", "AutoencoderKL")
    if vae_class in VIDEO_BAND_DECODED_VAES:
        return _video_decode_bytes(model, work, parallel, dtype)
    if raw is None or vae_class not in IMAGE_BAND_DECODED_VAES:
        return {}
    shape, world = VaeShape.from_config(raw), parallel.world_size
    walk = partial(decode_ranks, shape, height=work.height, width=work.width, conv_scratch=conv_scratch,
                   element=torch.empty((), dtype=dtype).element_size())  # fmt: skip
    if not decodes_in_parallel(parallel, world, work.height, work.width, work.height // shape.scale_factor):
        return {0: walk()[0].peak}
    return _by_pipeline_rank(walk(ranks=world), parallel)


def _video_decode_bytes(model: str, work: Workload, parallel, dtype: torch.dtype) -> dict[int, int]:
    """:func:`decode_bytes` of a 3-D VAE the bands run: each rank's band traced where the clip decodes over the world
    (rank 0's with the latent it scatters and the clip it gathers), else rank 0's whole decode."""
    factor, world = work.spec.vae_scale_factor, parallel.world_size
    rows, cols = work.height // factor, work.width // factor
    trace = partial(traced_decode_ranks, model, frames=work.frames, rows=rows, cols=cols, dtype=dtype)
    if not decodes_in_parallel(parallel, world, work.height, work.width, rows, video=True):
        return {0: trace(ranks=1)[0].peak}
    return _by_pipeline_rank(trace(ranks=world), parallel)


def _by_pipeline_rank(bands, parallel) -> dict[int, int]:
    """The decode peaks of global rank 0's pipeline group, by pipeline rank, from every global rank's band."""
    sp = parallel.sequence_degree  # pipeline rank r of the first group is global rank r * sp
    return {rank: bands[rank * sp].peak for rank in range(parallel.pipefusion_degree)}


@dataclass(frozen=True)
class LayoutActivations:
    """A layout's activations per pipeline rank before its text encoders are placed (:func:`layout_activations`)."""

    kept: dict[int, int]  # bytes held through the request: its blocks' records, the rest's, its receive buffers
    peaks: dict[int, int]  # its largest transient but a text encoder's: its blocks', the loop's, its decode's
    encode: int  # a text encoder's peak, on each rank that runs one

    def on(self, rank: int, text: str) -> int:
        """Pipeline rank ``rank``'s activations with the text encoders placed by ``text`` (they run on rank 0, or
        on every rank of a split: an upper bound there, the whole encoder's peak)."""
        runs_text = rank == 0 or text == "split"
        return self.kept[rank] + max(self.peaks[rank], self.encode if runs_text else 0)


def layout_activations(model: str, work: Workload, parallel, dtype: torch.dtype, *,
                       conv_scratch: ConvScratch | None = None) -> LayoutActivations | None:  # fmt: skip
    """What a request makes on each pipeline rank beside the weights and the stale K/V buffers at its peak, from
    the request traced on one rank (``xfuse.perf.activations``): what its blocks leave alive through the request
    (their text K/V records), what the rest leaves and its receive buffers (``receive_buffer_bytes``), plus the
    largest of: its blocks' peak in its largest pass, the loop's outside the blocks on the embedding and output
    ranks, its part of the decode (``decode_bytes``, or the traced decode of a 3-D VAE) and, where they run, the
    text encoders'. What a pass makes is per token and sample: this CFG group's batch, 1/sp of the tokens under
    sequence parallelism. Checked against real worlds in ``tests/multirank/test_memory.py``. ``None`` for a model
    folder (not traced)."""
    acts = _request_traced(model, work, dtype)
    if acts is None:
        return None
    plan = work.spec.plan(work.num_blocks, parallel)
    sp, model_batch = parallel.sequence_degree, max(1, work.cfg_batch // parallel.cfg_degree)  # a CFG group's
    element, grid = torch.empty((), dtype=dtype).element_size(), work.grid(parallel.resolved_num_patches)
    received = receive_buffer_bytes(plan, grid, hidden_size=work.hidden,
                                    batch=model_batch, latent_batch=1, in_channels=work.config["in_channels"],
                                    dtype_bytes=element,
                                    stream_tokens=dict.fromkeys(plan.streams, work.text_tokens))  # fmt: skip
    kept_share = model_batch / acts.batch / sp
    # A rank's largest pass: a warm-up step's whole image in batch parts (one with step caching), or a pipelined
    # step's largest patch (the first carries the whole text) at the whole batch; what a pass makes is per token and
    # sample.
    whole = grid.num_tokens + grid[0].lead_tokens
    pipelined = parallel.warmup_steps < work.steps and grid.num_patches > 1
    largest = max(1 / batch_parts(model_batch, plan.degree, work.cached),
                  max(grid.cost_tokens) / whole if pipelined else 0)  # fmt: skip
    pass_share = kept_share * largest
    decode = decode_bytes(model, work, parallel, dtype, conv_scratch=conv_scratch) or {0: acts.decode}
    kept, peaks = {}, {}
    for rank in range(plan.degree):
        blocks = plan.blocks_of(rank)
        mine = [max((acts.blocks[b] for b in blocks), default=0) * pass_share, decode.get(rank, 0)]
        if rank in (plan.embed_rank, plan.output_rank):
            mine.append(acts.outside * pass_share)
        kept[rank] = int(sum(acts.kept[b] for b in blocks) * kept_share + acts.kept_rest + received[rank] / sp)
        peaks[rank] = int(max(mine))
    return LayoutActivations(kept, peaks, acts.encode)


def _without_text(model: str, work: Workload, parallel, dtype: torch.dtype) -> list[RankMemory]:
    """Each pipeline rank's transformer share, stale K/V and VAE weights: what no text placement changes."""
    plan, grid = work.spec.plan(work.num_blocks, parallel), work.grid(parallel.resolved_num_patches)
    params, kv = pipeline_rank_bytes(work.spec, work.config, plan, grid,
                                     batch=work.cfg_batch // parallel.cfg_degree, dtype=dtype,
                                     experts=transformer_count(model),
                                     stale_kv=keeps_stale_kv(grid.num_patches, parallel.warmup_steps, work.steps,
                                                             work.cached), adapter=parallel.adapter)  # fmt: skip
    sp = parallel.ulysses_degree * parallel.ring_degree  # the ranks sharing one pipeline rank's tokens
    vae, raw = vae_weight_bytes(model, dtype), vae_config(model)
    vae_class = None if raw is None else raw.get("_class_name", "AutoencoderKL")
    every = vae_on_every_rank(parallel, parallel.world_size, vae_class)
    return [RankMemory(rank, params[rank], kv[rank] // sp, vae_bytes=vae if every or rank == 0 else 0)
            for rank in range(plan.degree)]  # fmt: skip


TEXT_PLACEMENTS = ("rank0", "split", "offload")  # the order ``parallel.text_encoder: auto`` tries them in


@dataclass(frozen=True)
class Placed:
    """A layout's memory with its text encoders placed: the placement, each pipeline rank's memory, and whether the
    busiest rank fits the device (always, where the device's memory is not known)."""

    text: str
    ranks: list[RankMemory]
    fits: bool

    @property
    def busiest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    def words(self, wanted: str) -> str:
        """How the text encoders were placed, for ``parallel.text_encoder`` = ``wanted``."""
        where = {"rank0": "whole on rank 0", "split": "split by layers over the pipeline group",
                 "offload": "offloaded (rank 0 streams one module at a time)"}[self.text]  # fmt: skip
        if wanted != "auto":
            return f"text encoders {where} (parallel.text_encoder: {wanted})"
        why = "the first that fits" if self.fits else "none fits; the placement needing least"
        return f"text encoders {where} (parallel.text_encoder auto: {why})"


def place_text(model: str, work: Workload, parallel, dtype: torch.dtype, memory: float | None, *,
               conv_scratch: ConvScratch | None = None) -> Placed:  # fmt: skip
    """``parallel.text_encoder`` resolved for a layout: as configured, or (``auto``) the first of ``rank0``,
    ``split``, ``offload`` with which every rank fits ``memory`` bytes (``rank0`` where ``memory`` is ``None``: not
    known); where none fits, the placement whose busiest rank needs the least, not fitting."""
    wanted = parallel.text_encoder
    tries = TEXT_PLACEMENTS if wanted == "auto" else (wanted,)
    held = _without_text(model, work, parallel, dtype)  # the same under every placement
    made = layout_activations(model, work, parallel, dtype, conv_scratch=conv_scratch)  # and these but the encode
    placed = []
    for text in tries:
        ranks = _with_text(held, made, model, text, dtype)
        option = Placed(text, ranks, memory is None or max(r.total for r in ranks) <= memory)
        if option.fits:
            return option
        placed.append(option)
    return min(placed, key=lambda p: p.busiest.total)
