"""Rank functions for the sequence-parallel tests: every family's engine under Ulysses and Ring (and PipeFusion)."""

import copy

import torch
import torch.distributed as dist


def inputs_of(preset, *, height, width, steps, cfg):
    """(diffusers pipeline, the loop's inputs as that pipeline prepares them): the oracle's arguments. ``cfg``: the
    family's guidance scale (FLUX: ``true_cfg_scale`` with a negative prompt), batched [uncond, cond] when > 1."""
    from xfuse.families.registry import model_spec

    family = model_spec(preset).name
    if family == "hunyuandit":
        from tests.support.engine_fns import tiny_pipe
        from xfuse.families.hunyuandit.reference import prepare_inputs

        pipe = tiny_pipe(preset=preset)
        return pipe, prepare_inputs(pipe, height=height, width=width, num_inference_steps=steps, guidance_scale=cfg)
    if family == "pixart-sigma":
        from tests.support.pixart_fns import prepare_inputs, tiny_pixart

        pipe = tiny_pixart()
        return pipe, prepare_inputs(pipe, height=height, width=width, steps=steps, guidance_scale=cfg)
    from tests.support.mmdit_fns import prepare_inputs, tiny

    pipe = tiny(preset)
    return pipe, prepare_inputs(pipe, height=height, width=width, steps=steps, cfg=cfg)


def _request(preset, stage, pipe, inputs, grid):
    """The engine request built with the family's own stage (its conditioning), and the latents' unpacking."""
    from xfuse.families.registry import model_spec

    family, scheduler = model_spec(preset).name, copy.deepcopy(pipe.scheduler)
    if family == "hunyuandit":
        from xfuse.families.hunyuandit.reference import request_from_inputs

        return request_from_inputs(stage, inputs, scheduler), lambda x: x
    if family == "pixart-sigma":
        from tests.support.pixart_fns import request_of

        return request_of(stage, inputs, scheduler), lambda x: x
    from tests.support.mmdit_fns import request_of

    return request_of(stage, inputs, scheduler, grid)


def run_sequence(preset, *, pp=1, ulysses=1, ring=1, num_patches=1, warmup, height, width, steps, cfg, fault=None,
                 cache=None):  # fmt: skip
    """The engine on ranks 0 … pp * ulysses * ring - 1 (the others idle), global rank ``pipe_rank * sp + sp_index``;
    every rank of pipeline rank 0 returns its final latents (the diffusers pipeline's layout). ``fault``:
    ``"misplaced_kv"`` writes every patch's K/V at the start of the buffers (a shard bookkeeping bug). ``cache``:
    step caching (a ``CacheConfig`` dict); every working rank then returns (its latents or None, its decisions)."""
    from xfuse.comm.p2p import P2PChannels
    from xfuse.config import ParallelConfig, cache_config
    from xfuse.families.registry import model_spec
    from xfuse.parallel.engine import PipeFusionEngine
    from xfuse.parallel.patch_grid import patch_grid
    from xfuse.parallel.sequence import SequenceParallel
    from xfuse.parallel.sequence_stage import SequenceParallelStage

    rank, sp = dist.get_rank(), ulysses * ring
    if rank >= pp * sp:
        return None
    pipe_rank, sp_index = divmod(rank, sp)
    pipe, inputs = inputs_of(preset, height=height, width=width, steps=steps, cfg=cfg)
    spec = model_spec(preset)
    plan = spec.plan(spec.num_blocks(pipe.transformer.config), ParallelConfig(pipefusion_degree=pp))
    stage = spec.stage_class()(copy.deepcopy(pipe.transformer), plan, pipe_rank)
    channels = P2PChannels(rank=rank, timeout_s=60, max_inflight=2, device=torch.device("cpu"))
    right = SequenceParallel.cache_range
    if fault == "misplaced_kv":  # every patch's K/V at the start of the buffers (its length unchanged)

        def misplaced(self, tokens):
            place = right(self, tokens)
            return slice(0, place.stop - place.start)

        SequenceParallel.cache_range = misplaced
    try:
        engine_stage = stage
        if sp > 1:
            group = [pipe_rank * sp + index for index in range(sp)]
            sequence = SequenceParallel(
                ulysses=ulysses, ring=ring, index=sp_index, group_ranks=group, channels=channels
            )
            engine_stage = SequenceParallelStage(stage, sequence)
        scale = spec.latent_scale
        grid = patch_grid(height // scale, width // scale, num_patches, pipe.transformer.config.patch_size)
        request, unpack = _request(preset, stage, pipe, inputs, grid)
        engine = PipeFusionEngine(
            engine_stage,
            plan,
            channels if pp > 1 else None,
            pipe_rank=pipe_rank,
            group_ranks=[p * sp + sp_index for p in range(pp)],
            warmup_steps=warmup,
            cache=None if cache is None else cache_config(cache),
        )
        out = engine.denoise(request, grid)
        latents = None if out is None else unpack(out)
        return latents if cache is None else (latents, engine.cache_decisions)
    finally:
        SequenceParallel.cache_range = right  # the world's next test runs in these processes
        channels.close()
