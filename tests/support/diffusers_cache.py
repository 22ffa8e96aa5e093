"""diffusers' own First-Block Cache on a diffusers pipeline: the reference xfuse's step caching is compared with at
degree 1 (``diffusers.hooks.apply_first_block_cache``)."""

import contextlib

from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.hooks.hooks import CacheContext, _set_cache_context


def register_hunyuandit_block() -> None:
    """diffusers' hooks know no ``HunyuanDiTBlock``: describe it as they describe ``BasicTransformerBlock`` (it returns
    the hidden states alone)."""
    from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiTBlock

    try:
        TransformerBlockRegistry.get(HunyuanDiTBlock)
    except ValueError:
        TransformerBlockRegistry.register(
            model_class=HunyuanDiTBlock,
            metadata=TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=None),
        )


def with_first_block_cache(pipe, threshold: float):
    """``pipe`` with diffusers' First-Block Cache on its transformer; returns ``run(**call)``. Pipelines that set no
    cache context (HunyuanDiT, PixArt-Σ, SD3: one batched [uncond, cond] call per step) run inside one, as a user
    of the hook would wrap them."""
    register_hunyuandit_block()
    apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=threshold))
    sets_context = type(pipe).__name__ in ("FluxPipeline", "WanPipeline", "WanImageToVideoPipeline")

    def run(**call):
        context = contextlib.nullcontext() if sets_context else _context(pipe.transformer)
        with context:
            return pipe(**call)

    return run


@contextlib.contextmanager
def _context(module):
    _set_cache_context(module, CacheContext("cond"))
    try:
        yield
    finally:
        _set_cache_context(module, None)
