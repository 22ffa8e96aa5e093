"""Regional ``torch.compile`` of one pipeline rank's blocks: each kept block compiled in place (``nn.Module.compile``,
as diffusers' ``compile_repeated_blocks`` compiles a model's repeated blocks), so that every block of one class shares
its compiled graphs: a rank compiles a few graphs per block class and shape, not one per block.

What keeps the graphs shared is the eager region of xfuse's attention processors: the K/V bookkeeping is keyed by
the block (``StaleKVSelfAttnProcessor.attend``, ``JointAttention.attend``; the cross-attention's per-request text
K/V, ``CachedCrossAttnProcessor.cached``), and traced, that key would become a guard and each block a graph of its
own. Those methods run under ``torch.compiler.disable``: the projections, norms, RoPE and MLP around them compile.
Nothing here runs at import or when a pipeline is built: only ``compile_blocks`` compiles, at the first call of each
shape.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["EAGER_REGIONS", "compile_blocks"]

EAGER_REGIONS = ("attend", "cached")  # the methods of xfuse's processors that stay eager inside a compiled block


def _eager_regions(block: nn.Module) -> None:
    """Wrap the eager regions of the xfuse processors in ``block`` in ``torch.compiler.disable`` (once each)."""
    for module in block.modules():
        processor = getattr(module, "processor", None)
        if processor is None or not type(processor).__module__.startswith("xfuse."):
            continue
        for name in EAGER_REGIONS:
            method = getattr(processor, name, None)
            if method is not None and name not in vars(processor):  # an instance attribute: wrapped already
                setattr(processor, name, torch.compiler.disable(method))


def compile_blocks(stage, backend: str = "inductor", dynamic: bool | None = False) -> None:
    """Compile each block ``stage`` keeps (its ``block_ids``) in place with ``torch.compile(backend=..., dynamic=...)``,
    its processors' eager regions left out. The graphs are made at the first call of each shape."""
    for index in stage.block_ids:
        block = stage.blocks[index]
        _eager_regions(block)
        block.compile(backend=backend, dynamic=dynamic)
