"""What every family adapter shares: keeping only one rank's blocks of a diffusers transformer, reading only those
from a checkpoint, and PipeFusion's attention processors on their ``attn1`` (self) and ``attn2`` (cross to text).

Blocks a rank does not run are replaced by ``nn.Identity``, so the kept parameters keep their names
(``blocks.12.attn1.to_q.weight``) and their global index (long skips and K/V buffers are keyed by it). The patch
embedding stays on the plan's embedding rank and the output layer on its output rank; the small conditioning
embedders stay on every rank, so that no rank needs ``temb`` or text states sent to it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any, ClassVar

import torch
from torch import nn

from xfuse.families.common.attention import CachedCrossAttnProcessor, StaleKVSelfAttnProcessor, check_attention
from xfuse.families.common.modulation import memoize_modulation, prefetch_modulation
from xfuse.families.spec import ModelSpec
from xfuse.parallel.pass_attention import PassAttention
from xfuse.parallel.patch_grid import PatchBand, PatchGrid
from xfuse.parallel.stage import BatchPart
from xfuse.parallel.stage_plan import StagePlan
from xfuse.parallel.stale_kv import StaleKVCache


class ShardedStage(nn.Module):
    """Base of a family's ``Stage``: the sharded transformer; the subclass adds the per-patch forward.

    Class attributes a family sets: ``spec`` (its ``ModelSpec``), ``blocks_attrs`` (the ``nn.ModuleList``s of blocks,
    indexed as one chain in this order: FLUX's double then single blocks), ``embed_modules`` and ``output_modules``
    (attributes only the embedding / output rank keeps). ``install_processors`` puts PipeFusion's attention
    processors into a kept block (default: self-attention ``attn1`` and cross-attention ``attn2``).
    """

    spec: ClassVar[ModelSpec]
    # attributes of the request in flight (``xfuse.parallel.request_state``); the K/V cache and the cross-attention
    # processors keep the rest (``request_state_holders``)
    REQUEST_STATE: ClassVar[tuple[str, ...]] = ("num_tokens", "_request_rows")
    blocks_attrs: ClassVar[tuple[str, ...]]
    embed_modules: ClassVar[tuple[str, ...]]
    output_modules: ClassVar[tuple[str, ...]]

    def __init__(self, transformer: nn.Module, plan: StagePlan, rank: int):
        super().__init__()
        num_blocks = self.spec.num_blocks(transformer.config)
        if num_blocks != plan.num_blocks:
            raise ValueError(f"stage plan is for {plan.num_blocks} blocks but the transformer has {num_blocks}")
        self.plan, self.rank = plan, rank
        self.block_ids = plan.blocks_of(rank)
        lists = [getattr(transformer, name) for name in self.blocks_attrs]
        places = [(blocks, i) for blocks in lists for i in range(len(blocks))]  # global index -> (list, local)
        for index, (blocks, local) in enumerate(places):
            if index not in self.block_ids:
                blocks[local] = nn.Identity()
        for names, keeper in ((self.embed_modules, plan.embed_rank), (self.output_modules, plan.output_rank)):
            if rank != keeper:
                for name in names:
                    setattr(transformer, name, None)
        self.transformer = transformer
        self.blocks = tuple(blocks[local] for blocks, local in places)  # by global index (plain tuple: no copies)
        self.kv_cache = StaleKVCache()
        self.attention = PassAttention(self.kv_cache)  # what the self-attention processors call
        self.num_tokens = 0  # image tokens of the current request
        self._request_rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # see batch_part
        self._cross = []
        for index in self.block_ids:
            self.install_processors(self.blocks[index], index)
        self.modulation = memoize_modulation(transformer)  # kept blocks' and output layer's: once a step

    def install_processors(self, block: nn.Module, index: int) -> None:
        """PipeFusion's processors for block ``index``: stale-K/V self-attention, cross-attention to static text."""
        check_attention(block.attn1, cross=False)
        check_attention(block.attn2, cross=True)
        block.attn1.set_processor(StaleKVSelfAttnProcessor(self.attention, index))
        self._cross.append(CachedCrossAttnProcessor(self.kv_cache))
        block.attn2.set_processor(self._cross[-1])

    def begin_request(self, grid: PatchGrid) -> None:
        """Start a request: forget every K/V of the previous one."""
        self.num_tokens = grid.num_tokens
        self.kv_cache.reset(self.attention.begin_request(grid))
        self._request_rows.clear()
        for cross in self._cross:
            cross.reset()

    def request_state_holders(self) -> tuple[object, ...]:
        """The objects that keep the request in flight's state, each naming it in ``REQUEST_STATE`` (the ``Stage``
        method): this stage, its K/V cache, its cross-attention processors and its modulation memos (a request's
        step's products, kept while another request's tasks run)."""
        memos = [memo for mod in self.modulation for memo in (mod.silu, mod.linear) if memo is not None]
        return (self, self.kv_cache, *self._cross, *memos)

    def batch_part(self, cond: Any, part: BatchPart) -> Any:
        """``cond`` for ``part``'s rows of the batch (the ``Stage`` method). A family's conditioning names its
        batch-indexed tensors: ``STEP_FIELDS`` (new every step) and ``REQUEST_FIELDS`` (one tensor for the whole
        request, e.g. the text): those are sliced once per request, so every step's part passes the same tensor
        and the cross-attention K/V cache, keyed on it, computes a part's text K/V once."""
        steps = {name: getattr(cond, name) for name in cond.STEP_FIELDS}  # None: a field this rank does not use
        fields = {name: tensor[part.rows] for name, tensor in steps.items() if tensor is not None}
        for name in cond.REQUEST_FIELDS:
            tensor = getattr(cond, name)
            if tensor is not None:
                key = (id(tensor), part.index)  # the tensor is held below: its id is not reused this request
                if key not in self._request_rows:
                    self._request_rows[key] = (tensor, tensor[part.rows])
                fields[name] = self._request_rows[key][1]
        return dataclasses.replace(cond, part=part, **fields)

    def begin_pass(self, cond: Any, band: PatchBand | None, keep_kv: bool) -> None:
        """Point the K/V buffers at this pass: the band's tokens (``None``: the whole image), the conditioning's batch
        part, and whether a whole-image pass stores its K/V (``keep_kv``)."""
        self.kv_cache.store_whole = keep_kv
        self.kv_cache.tokens = None if band is None else self.attention.cache_range(band.tokens)
        self.kv_cache.part = cond.part

    def hidden_tokens(self, band: PatchBand | None) -> slice:
        """Positions in the image of the hidden states this rank holds in a pass over ``band`` (``None``: the
        whole image): the band's tokens, or under sequence parallelism this rank's chunk of them."""
        return self.attention.hidden_tokens(slice(0, self.num_tokens) if band is None else band.tokens)

    def stream_shape(self, kind: str, shape: tuple) -> tuple:
        """The shape this rank holds of stream ``kind`` (families with streams shard them: ``JointStage``)."""
        return shape

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the ranks sharing this pass's tokens: this rank alone (``SequenceParallelStage``
        sums over its SP group)."""
        return values

    def begin_task(self, step: int, patch: int | None) -> None:
        """The engine is about to compute a task of (step, patch): only sequence parallelism labels its messages
        with it (``xfuse.parallel.sequence_stage``)."""

    def prepare_step(self, cond: Any) -> None:
        """The step's adaptive-norm products (``xfuse.families.common.modulation``) of the tensor the family's
        conditioning names as its blocks' modulation input (``MODULATION``; none: nothing to prepare)."""
        name = getattr(cond, "MODULATION", None)
        if name is not None and cond.part is None:
            prefetch_modulation(self.modulation, getattr(cond, name))

    @property
    def config(self):
        return self.transformer.config

    @property
    def patch_size(self) -> int:
        """Latent rows (and columns) per token: the engine's ``patch_size`` (``ModelSpec.token_patch``)."""
        return self.spec.token_patch(self.transformer.config)

    @property
    def hidden_size(self) -> int:
        return self.spec.width(self.transformer.config)

    @classmethod
    def from_pretrained(cls, folder: str, plan: StagePlan, rank: int, torch_dtype=None, subfolder: str = "transformer"):
        """Load only what ``rank`` runs from a diffusers folder's ``<subfolder>/*.safetensors`` (``transformer``, or
        a second expert's ``transformer_2``).

        The model is built without memory (accelerate's ``init_empty_weights``), sharded, and only the remaining
        tensors are read from the checkpoint, so a rank's peak memory is its share, not the whole transformer.
        """
        import diffusers
        from accelerate import init_empty_weights
        from accelerate.utils import set_module_tensor_to_device
        from safetensors import safe_open

        model_class = getattr(diffusers, cls.spec.diffusers_transformer)
        config = model_class.load_config(folder, subfolder=subfolder, local_files_only=True)
        with init_empty_weights():
            model = model_class.from_config(config)
        stage = cls(model, plan, rank)
        wanted = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
        files = sorted(glob.glob(os.path.join(folder, subfolder, "*.safetensors")))
        if not files:
            raise ValueError(f"{folder!r}: no {subfolder}/*.safetensors (xfuse loads safetensors checkpoints)")
        loaded = set()
        for file in files:
            with safe_open(file, framework="pt") as checkpoint:
                for key in checkpoint.keys():
                    if key in wanted:
                        tensor = checkpoint.get_tensor(key)
                        dtype = torch_dtype if torch_dtype is not None and tensor.is_floating_point() else None
                        # Without a dtype accelerate casts to the empty model's (float32) dtype.
                        set_module_tensor_to_device(model, key, "cpu", value=tensor, dtype=dtype or tensor.dtype)
                        loaded.add(key)
        missing = {name for name, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(
                f"{folder!r}: the checkpoint lacks {len(missing)} tensors of rank {rank}'s stage, "
                f"e.g. {sorted(missing)[:3]}"
            )
        return stage.eval()
