"""What each rank of a layout holds on its device, and whether that fits: the memory side of ``xfuse plan`` and
``xfuse plan --auto``.

Counted, per rank, in the dtype the ranks run in: the transformer parameters it keeps (the family's real sharding
applied to a weightless model: a pipeline rank's blocks and what its stage keeps besides them; every rank of a
sequence- or CFG-parallel group a full copy of its pipeline rank's) and its stale K/V buffers (a sequence-parallel
rank holds its chunk of the tokens' K/V). Not yet counted: activations, the text encoders and the VAE on rank 0;
``xfuse plan --auto`` says so where it prints the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xfuse.families.registry import transformer_count
from xfuse.families.spec import ModelSpec
from xfuse.parallel.costs import kv_buffer_bytes
from xfuse.parallel.patch_grid import PatchGrid
from xfuse.perf.model import Workload

GIB = 1024**3


def stage_parameter_bytes(spec: ModelSpec, model_config: dict, plan, dtype: torch.dtype) -> dict[int, int]:
    """Transformer parameter bytes each rank keeps, from the real sharding applied to a weightless (meta) model."""
    import diffusers

    model_class, stage_class = getattr(diffusers, spec.diffusers_transformer), spec.stage_class()
    element = torch.empty((), dtype=dtype).element_size()
    config = {k: v for k, v in model_config.items() if not k.startswith("_")}
    result = {}
    for rank in range(plan.degree):
        with torch.device("meta"):
            stage = stage_class(model_class(**config), plan, rank)
        result[rank] = sum(p.numel() for p in stage.parameters()) * element
    return result


@dataclass(frozen=True)
class RankMemory:
    """What one pipeline rank of a layout holds (each rank of its SP and CFG groups alike)."""

    pipe_rank: int
    param_bytes: int
    kv_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.kv_bytes

    def describe(self, device_memory: float) -> str:
        """``pipeline rank 0 needs 61.3 GiB (weights 58.7, stale K/V 2.6) of 45.0 GiB``."""
        return (
            f"pipeline rank {self.pipe_rank} needs {self.total / GIB:.1f} GiB (weights {self.param_bytes / GIB:.1f}, "
            f"stale K/V {self.kv_bytes / GIB:.1f}) of {device_memory / GIB:.1f} GiB"
        )


def pipeline_rank_bytes(
    spec: ModelSpec, model_config: dict, plan, grid: PatchGrid, *, batch: int, dtype: torch.dtype, experts: int
) -> tuple[dict[int, int], dict[int, int]]:
    """(parameter bytes, stale K/V buffer bytes) each pipeline rank of ``plan`` keeps: its share of the transformer
    (of each of ``experts`` transformers: Wan 2.2's two) and the whole image's K/V for its blocks, a transformer
    batch of ``batch`` (``xfuse plan`` prints them; a sequence-parallel rank holds 1/sp of the K/V)."""
    element = torch.empty((), dtype=dtype).element_size()
    hidden = model_config["num_attention_heads"] * model_config["attention_head_dim"]
    kv = kv_buffer_bytes(plan, grid, hidden_size=hidden, batch=batch, dtype_bytes=element,
                         attentions=lambda block: spec.attentions_of_block(model_config, block))  # fmt: skip
    params = stage_parameter_bytes(spec, model_config, plan, dtype)
    return {rank: n * experts for rank, n in params.items()}, kv


def rank_memory(model: str, work: Workload, parallel, dtype: torch.dtype) -> list[RankMemory]:
    """Each pipeline rank's memory for ``work`` (the request of model ``model``) under ``parallel`` (a
    ParallelConfig), in ``dtype``: what ``pipeline_rank_bytes`` counts, the K/V shared by the SP group."""
    plan = work.spec.plan(work.num_blocks, parallel)
    params, kv = pipeline_rank_bytes(work.spec, work.config, plan, work.grid(parallel.resolved_num_patches),
                                     batch=work.cfg_batch // parallel.cfg_degree, dtype=dtype,
                                     experts=transformer_count(model))  # fmt: skip
    sp = parallel.ulysses_degree * parallel.ring_degree  # the ranks sharing one pipeline rank's tokens
    return [RankMemory(rank, params[rank], kv[rank] // sp) for rank in range(plan.degree)]
