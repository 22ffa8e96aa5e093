"""Rank functions for the engine tests (importable by spawned ranks)."""

import copy

import torch
import torch.distributed as dist

from tests.support.schedulers import use_scheduler
from xfuse.comm.p2p import P2PChannels
from xfuse.config import cache_config
from xfuse.families.hunyuandit.reference import prepare_inputs, request_from_inputs
from xfuse.families.hunyuandit.stage import HunyuanDiTStage
from xfuse.families.registry import HUNYUANDIT
from xfuse.parallel.engine import PipeFusionEngine
from xfuse.parallel.patch_grid import patch_grid
from xfuse.parallel.stage_plan import stage_plan
from xfuse.parallel.stale_kv import StaleKVCache

_PIPES = {}


def tiny_pipe(scheduler="DDPMScheduler", dtype=torch.float32, preset="tiny"):
    """A preset pipeline (``tiny``: 16 blocks; ``bytes40``: 40), built once per process, scheduler and dtype (stages
    copy its transformer)."""
    key = (scheduler, dtype, preset)
    if key not in _PIPES:
        from xfuse.families.hunyuandit.presets import build_tiny_pipeline

        pipe = use_scheduler(build_tiny_pipeline(preset, seed=0), scheduler)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[key] = pipe.to(dtype=dtype) if dtype != torch.float32 else pipe
    return _PIPES[key]


def run_engine(
    degree,
    placement,
    num_patches,
    warmup,
    *,
    height=128,
    width=96,
    steps=3,
    scheduler="DDPMScheduler",
    dtype=torch.float32,
    prompt="a red house by a lake",
    seed=0,
    timeout_s=60.0,
    max_inflight=2,
    requests=1,
    preset="tiny",
    on_stage=None,
    cache=None,
):
    """Run PipeFusion on ranks 0 … degree-1 of the world (the others idle); return rank 0's final latents of the
    last request plus every rank's byte counters. ``on_stage(stage)``: called once the rank's stage is built.
    ``cache``: step caching (a ``CacheConfig`` dict); every rank also returns its decisions (``cache_decisions``)."""
    rank = dist.get_rank()
    if rank >= degree:
        return None
    pipe = tiny_pipe(scheduler, dtype, preset)
    plan = stage_plan(
        pipe.transformer.config.num_layers,
        degree,
        placement,
        skips=HUNYUANDIT.skip_pairs(pipe.transformer.config.num_layers),
    )
    stage = HunyuanDiTStage(copy.deepcopy(pipe.transformer), plan, rank)
    if on_stage is not None:
        on_stage(stage)
    channels = P2PChannels(rank=rank, timeout_s=timeout_s, max_inflight=max_inflight, device=torch.device("cpu"))
    engine = PipeFusionEngine(
        stage,
        plan,
        channels,
        pipe_rank=rank,
        group_ranks=list(range(degree)),
        warmup_steps=warmup,
        max_inflight=max_inflight,
        cache=None if cache is None else cache_config(cache),
    )
    grid = patch_grid(height // 8, width // 8, num_patches, pipe.transformer.config.patch_size)
    outputs = []
    for request_prompt in [prompt] if requests == 1 else requests:
        inputs = prepare_inputs(
            pipe, prompt=request_prompt, height=height, width=width, num_inference_steps=steps, seed=seed
        )
        channels.counters.reset()
        request = request_from_inputs(stage, inputs, copy.deepcopy(pipe.scheduler))
        outputs.append(engine.denoise(request, grid))
    return dict(
        latents=outputs if requests != 1 else outputs[0],
        counters=channels.counters.as_dict(),
        num_buffers=channels.num_buffers,
        cache_decisions=engine.cache_decisions,
    )


def inject_unrefreshed_kv(monkeypatch) -> None:
    """An injected bug for the oracle tests: patch passes read the warm-up K/V and never write theirs."""
    original = StaleKVCache.update

    def update_without_refresh(cache, layer, key, value):
        if cache.tokens is None:
            return original(cache, layer, key, value)
        k, v = cache._buffers(layer, key, key.shape[0])  # the buffers the warm-up step filled: (B, heads, tokens, D)
        return k[:, :, : cache._valid[layer]], v[:, :, : cache._valid[layer]]

    monkeypatch.setattr(StaleKVCache, "update", update_without_refresh)


def run_engine_refreshing_skipped_kv(*args, **kwargs):
    """``run_engine`` with an injected caching bug: a skipped segment runs its blocks anyway (writing their K/V for
    the patch's tokens) before adding its cached residual as a skip does."""
    from unittest import mock

    from xfuse.parallel.step_cache import CachedSegments

    run, skip = CachedSegments.run, CachedSegments._skip

    def running(segments, task, hidden, cond, band, skips, keep_kv, streams, flag):
        def refreshing(task, hidden, rest, tokens, skips, streams):  # the pass's cond and band, as the engine's
            segments.stage.run_segment(hidden, rest, cond, band, dict(skips), True, dict(streams))
            return skip(segments, task, hidden, rest, tokens, skips, streams)

        segments._skip = refreshing  # this pass's skips
        try:
            return run(segments, task, hidden, cond, band, skips, keep_kv, streams, flag)
        finally:
            del segments._skip

    with mock.patch.object(CachedSegments, "run", running):
        return run_engine(*args, **kwargs)


def calls_with_a_flipped_decision(folder, parallel, calls, step, cache):
    """``run_calls`` of a HunyuanDiT folder where global rank 1 takes the opposite caching decision at ``step`` (an
    injected bug: it ignores the decision its first task carries)."""
    from unittest import mock

    from tests.support.pipeline_fns import run_calls
    from xfuse.parallel.step_cache import StepCache

    note = StepCache.note

    def flipped(cache, at, compute):
        return note(cache, at, not compute if at == step else compute)

    if dist.get_rank() != 1:
        return run_calls(folder, parallel, calls, cache=cache)
    with mock.patch.object(StepCache, "note", flipped):
        return run_calls(folder, parallel, calls, cache=cache)
