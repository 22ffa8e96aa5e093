"""``ForwardStage``: one rank's share of any diffusers DiT whose blocks are sequential ``ModuleList``s, run by calling
the model's own ``forward`` — no hand-written stage.

Each engine call (``embed``, ``run_segment``, ``head``) is one call of the untouched transformer's ``forward`` under a
``Pass`` (``xfuse.families.generic.hooks``): the prologue (patch embedding, timestep and text embedders, RoPE) runs as
the model wrote it, its context-parallel plan cuts the pass's tokens where diffusers would cut a rank's, the blocks
outside the pass's segment return their inputs, the segment's first block takes the hand-off, the block after it ends
the call with its own inputs (the next rank's hand-off), and on the output rank the forward goes on into its own
epilogue (norm, projection, unpatchify), whose output the plan's gather entry puts back at the band's tokens of the
whole latent. Attention goes through the stale K/V at diffusers' dispatcher (``xfuse.families.generic.dispatch``).

Every rank keeps the model's non-block modules (the embedders and the output layer, a few tens of MB at the released
sizes): each pass runs the prologue, which the blocks' per-step inputs (timestep embedding, RoPE) come from. A rank
that does not embed the latent runs it on a zero stand-in of the latent's shape, whose embedding the hand-off replaces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar

import torch
from diffusers.hooks.context_parallel import _get_submodule_by_name
from diffusers.models._modeling_parallel import ContextParallelOutput
from torch import nn

from xfuse.families.common.joint import JointKV
from xfuse.families.common.packed import grid_to_packed, packed_to_grid
from xfuse.families.common.sharding import ShardedStage
from xfuse.families.generic.dispatch import KINDS, AttentionCall, route_dispatcher
from xfuse.families.generic.forward_plan import ForwardPlan
from xfuse.families.generic.hooks import (
    EPILOGUE,
    PROLOGUE,
    SEGMENT,
    AttentionCallHook,
    BandGatherHook,
    BandSplitHook,
    BlockGateHook,
    CallMemo,
    Pass,
    PassHolder,
    SegmentEnd,
    register,
)
from xfuse.parallel.patch_grid import PatchBand, PatchGrid
from xfuse.parallel.stage import BatchPart
from xfuse.parallel.stage_plan import Segment, StagePlan
from xfuse.parallel.video_layout import VideoLayout

TEXT = "text"  # the plan stream of an MMDiT's text (``ModelSpec.streams``)


@dataclass
class ForwardConditioning:
    """One step's arguments of the transformer's forward, but its latent input (which each pass makes).

    ``kwargs``: the forward's keyword arguments (the timestep among them); ``batched``: those indexed by the
    transformer batch (a batch part takes their rows); ``input_shape``: the whole latent input's, for the transformer
    batch; ``text_tokens``: the text stream's tokens (0 without one); ``layout``: a video's frames as the engine's
    grid (``video`` layout; ``None``: an image)."""

    kwargs: dict[str, Any]
    batched: tuple[str, ...]
    input_shape: tuple[int, ...]
    text_tokens: int = 0
    layout: VideoLayout | None = None
    part: BatchPart | None = None


class ForwardStage(ShardedStage):
    """The part of a diffusers transformer that one pipeline rank runs, through the model's own forward (the module
    docstring); the family's ``ModelSpec.forward`` says what the model's forward and plan do not."""

    spec: ClassVar  # the family's ModelSpec, whose ``forward`` is a ForwardPlan
    REQUEST_STATE: ClassVar[tuple[str, ...]] = (*ShardedStage.REQUEST_STATE, "_task_cond", "_task_step",
                                                "_step_conds", "_stash", "_latent_height", "_order")  # fmt: skip
    embed_modules: ClassVar[tuple[str, ...]] = ()  # every rank keeps them: each pass runs the model's prologue
    output_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, transformer: nn.Module, plan: StagePlan, rank: int):
        forward: ForwardPlan = self.spec.forward
        self.forward_plan = forward
        self.blocks_attrs = forward.blocks
        block_classes = [type(block) for name in forward.blocks for block in getattr(transformer, name)]
        cp_plan = getattr(transformer, "_cp_plan", None)
        if not cp_plan:
            raise ValueError(f"{type(transformer).__name__} has no context-parallel plan (_cp_plan)")
        if plan.skips:
            raise ValueError("the generic family runs a plain chain of blocks: its stage plan cannot have long skips")
        self.joint = JointKV()
        self.passes = PassHolder()
        self._joint_keys: set[tuple[int, str]] = set()  # attention modules whose sequence holds the text
        super().__init__(transformer, plan, rank)
        self.kv_cache, self.attention = self.joint.image, self.joint.attention
        self.kv_cache.text_first = forward.text_first
        self._task_cond: ForwardConditioning | None = None  # a batch part's (``batch_part``)
        self._task_step = 0
        self._step_conds: dict[int, ForwardConditioning] = {}
        self._stash: tuple[torch.Tensor, torch.Tensor] | None = None  # (last block's hidden, the forward's output)
        self._stand_ins: dict[tuple, torch.Tensor] = {}
        self._latent_height = 0
        self._order: tuple[VideoLayout, torch.Tensor] | None = None  # a video layout's token order
        last = len(block_classes) - 1
        joined = [name in forward.joined for name in forward.blocks for _ in getattr(transformer, name)]
        for index, block in enumerate(self.blocks):
            holds = index in self.block_ids
            returns = (forward.text_stream, forward.hidden) if joined[index] else forward.block_returns
            gate = BlockGateHook(index, last, block_classes[index], returns, holds, self.passes, joined[index])
            register(block, gate, "xfuse_gate")
        for name, module in transformer.named_children():  # the prologue's modules (the epilogue's too: harmless);
            if name not in forward.blocks:  # inside the plan's hooks, so a cut or gather is made for each pass
                register(module, CallMemo(), "xfuse_memo")
        context, uncut = set(forward.context), set(forward.uncut)
        for module_id, entry in cp_plan.items():
            modules = _get_submodule_by_name(transformer, module_id)
            for module in modules if isinstance(modules, list) else [modules]:
                if isinstance(entry, dict):
                    hook = BandSplitHook(module_id, entry, context, uncut, self.passes)
                else:
                    specs = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
                    hook = BandGatherHook(module_id, specs, self.passes)
                register(module, hook, f"xfuse_band:{module_id}")  # a block may have two entries (0 and *)
        for index, block in enumerate(self.blocks):  # the attention of the blocks this rank runs: through xfuse's
            if index in self.block_ids:  # dispatcher, each call classified by the stage
                for name, module in block.named_modules():
                    if hasattr(module, "processor") and hasattr(module, "set_processor"):
                        route_dispatcher(module.processor)
                        register(module, AttentionCallHook(partial(self.attention_call, (index, name))), "xfuse_call")

    def install_processors(self, block: nn.Module, index: int) -> None:
        """Nothing to swap: the model's own processors run, their attention routed at the dispatcher."""

    # --- the attention of a pass ------------------------------------------------------------------------------------
    def attention_call(self, key: tuple[int, str], hidden: torch.Tensor, context: torch.Tensor | None) -> AttentionCall:
        """What attention module ``key``'s call on ``hidden`` (and ``context``, the module's second input) is in the
        current pass: ``joint`` where the text stream shares the softmax (beside the image: ``context`` is the pass's
        text; or in front of it in ``hidden``), ``cross`` where the module attends to another context, else
        ``self``. A later patch carries no text: its modules are those the step's first patch found joint."""
        p = self.passes.get(f"attention {key}")
        text = self.joint.text_tokens  # this pass's (a sequence-parallel rank's chunk)
        image = self._pass_image_tokens(p)
        if context is not None:
            kind = "joint" if self.forward_plan.text_stream and context.shape[1] == text else "cross"
        elif text and hidden.shape[1] == image + text:
            kind = "joint"
        elif hidden.shape[1] == image:
            kind = "joint" if key in self._joint_keys else "self"
        else:
            raise RuntimeError(
                f"attention {key}: {hidden.shape[1]} tokens in a pass of {image} image and {text} text tokens"
            )
        if kind == "joint" and text:
            self._joint_keys.add(key)
        assert kind in KINDS
        return AttentionCall(key, kind, self.joint, text if kind == "joint" else 0, self.forward_plan.text_first)

    def _pass_image_tokens(self, p: Pass) -> int:
        return p.num_tokens if p.tokens is None else p.tokens.stop - p.tokens.start

    # --- the engine's calls -----------------------------------------------------------------------------------------
    def begin_request(self, grid: PatchGrid) -> None:
        super().begin_request(grid)
        self.joint.begin_request(self.attention.begin_request(grid))  # every image K/V, or a Ring rank's chunks
        self._latent_height = grid.latent_height  # the whole grid's rows (a video's: every frame's)
        self._step_conds.clear()
        self._task_cond, self._stash = None, None

    def request_state_holders(self) -> tuple[object, ...]:
        return (*super().request_state_holders(), self.joint)

    def note_conditioning(self, step: int, cond: ForwardConditioning) -> ForwardConditioning:
        """Keep ``cond`` as step ``step``'s (``forward_request`` calls it): ``embed`` takes no conditioning, and its
        pass runs the model's prologue, which needs it."""
        self._step_conds.pop(step - 2, None)  # at most two steps are in flight on a rank
        self._step_conds[step] = cond
        return cond

    def begin_task(self, step: int, patch: int | None) -> None:
        """The engine computes the task's conditioning next (``note_conditioning``), maybe a batch part of it."""
        self._task_step, self._task_cond = step, None

    def batch_part(self, cond: ForwardConditioning, part: BatchPart) -> ForwardConditioning:
        kwargs = {k: (v[part.rows] if k in cond.batched else v) for k, v in cond.kwargs.items()}
        shape = (part.size, *cond.input_shape[1:])
        self._task_cond = replace(cond, kwargs=kwargs, input_shape=shape, part=part)
        return self._task_cond

    def prepare_step(self, cond: Any) -> None:
        """Nothing ahead: the step's conditioning is computed by the model's prologue in each pass."""

    def _begin(self, mode: str, cond: ForwardConditioning, band: PatchBand | None, keep_kv: bool = True, **fields):
        """Point the K/V buffers and the hooks at a pass over ``band`` (``None``: the whole image). A segment pass
        under sequence parallelism computes this rank's chunk of the band's tokens and of the text; the prologue
        (``embed``) and the epilogue (``head``) the whole band, as ``SequenceParallelStage`` hands them."""
        owner = band is None or band.index == 0
        self.begin_pass(cond, band, keep_kv)
        total = cond.text_tokens
        sequence = mode == SEGMENT and self.attention.sequence is not None
        text: slice | None = None if owner else slice(0, 0)
        if sequence and owner:
            text = self.attention.hidden_tokens(slice(0, total))  # this rank's chunk of the text
        self.joint.reuse_text, self.joint.text_total = not owner, total
        self.joint.text_tokens = total if text is None else text.stop - text.start
        # the K/V buffers keep the text's beside the image's; under sequence parallelism the group joins its chunks
        self.kv_cache.text_slots = 0 if self.attention.sequence is not None else total
        tokens = None if band is None else band.tokens
        if sequence:
            tokens = self.hidden_tokens(band)
        index = None
        if cond.layout is not None and cond.layout.direction != "temporal":
            if self._order is None or self._order[0] != cond.layout:  # once per request's layout
                self._order = (cond.layout, cond.layout.token_order(self.transformer.device))
            # the layout's token order everywhere, whole-image passes too: the K/V buffers hold it
            tokens = slice(0, self.num_tokens) if tokens is None else tokens
            index = self._order[1][tokens]
        self.passes.current = Pass(mode, tokens, self.num_tokens, text, index, **fields,
                                   text_tokens=self.joint.text_tokens)  # fmt: skip
        return self.passes.current

    def stream_shape(self, kind: str, shape: tuple) -> tuple:
        """The shape this rank holds of the text stream (B, T, hidden): under sequence parallelism its chunk."""
        tokens = self.attention.hidden_tokens(slice(0, shape[1]))
        return (shape[0], tokens.stop - tokens.start, *shape[2:])

    def _forward(self, cond: ForwardConditioning, latent_input: torch.Tensor):
        """The transformer's forward on one pass; the pass's end (``SegmentEnd``) or the model's output."""
        kwargs = cond.kwargs | {self.forward_plan.latent_input: latent_input}
        try:
            return None, self.transformer(**kwargs, return_dict=False)[0]
        except SegmentEnd as end:
            return end.inputs, None
        finally:
            self.passes.current = None

    def _stand_in(self, cond: ForwardConditioning, like: torch.Tensor) -> torch.Tensor:
        """A zero latent input of the pass's shape: what a rank that does not embed runs the prologue on."""
        key = (cond.input_shape, like.dtype, like.device)
        if key not in self._stand_ins:
            self._stand_ins.clear()
            self._stand_ins[key] = torch.zeros(cond.input_shape, dtype=like.dtype, device=like.device)
        return self._stand_ins[key]

    def _latent_input(self, grid: torch.Tensor, cond: ForwardConditioning) -> torch.Tensor:
        """The engine's (B, C, rows, W) grid -> the transformer's latent input (``ForwardPlan.latent_layout``)."""
        if self.forward_plan.latent_layout == "packed":
            return grid_to_packed(grid)  # (B, C, rows, cols) -> (B, rows * cols, C)
        assert cond.layout is not None, "a video request carries its layout"
        return cond.layout.from_grid(grid)  # (B, C, F*H, W) -> (B, C, F, H, W)

    def _output_grid(self, output: torch.Tensor, cond: ForwardConditioning, token_rows: int) -> torch.Tensor:
        """The transformer's output -> the engine's (B, C_out, rows, W) grid (inverse of ``_latent_input``)."""
        if self.forward_plan.latent_layout == "packed":
            return packed_to_grid(output, token_rows)  # (B, rows * cols, C) -> (B, C, rows, cols)
        assert cond.layout is not None
        return cond.layout.to_grid(output)  # (B, C, F, H, W) -> (B, C, F*H, W)

    def _cond(self) -> ForwardConditioning:
        """The conditioning of the task in flight: its batch part's, or its step's."""
        if self._task_cond is not None:
            return self._task_cond
        if self._task_step not in self._step_conds:
            raise RuntimeError("no conditioning for this task: the request was not built by forward_request")
        return self._step_conds[self._task_step]

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C, rows, W) latent rows covering ``band`` -> (B, band tokens, hidden): the model's prologue on the
        whole latent's shape with these rows in place, cut to the band by its plan, up to its first block."""
        cond = self._cond()
        whole = latent_rows
        if band is not None:
            grid_shape = (*latent_rows.shape[:2], self._latent_height, latent_rows.shape[3])
            whole = latent_rows.new_zeros(grid_shape)  # (B, C, rows, W) of the whole image, the band's rows set
            whole[:, :, band.latent_rows] = latent_rows
        self._begin(PROLOGUE, cond, band)
        inputs, _ = self._forward(cond, self._latent_input(whole, cond))
        assert inputs is not None, "a prologue pass ends at the first block"
        return inputs[self.forward_plan.hidden]

    def run_segment(
        self,
        hidden: torch.Tensor,
        segment: Segment,
        cond: ForwardConditioning,
        band: PatchBand | None,
        skips: dict[int, torch.Tensor],
        keep_kv: bool = True,
        streams: dict[str, torch.Tensor] | None = None,
        *,
        controls: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``segment``'s blocks on (B, tokens, hidden) inside the model's forward: the hand-off goes into its
        first block (with the text stream where the step's first patch carries it), the next block's inputs come
        out; on the output rank the forward's epilogue runs too and ``head`` takes its output."""
        forward = self.forward_plan
        blocks = segment.blocks
        inputs = {forward.hidden: hidden}
        owner = band is None or band.index == 0
        if forward.text_stream is not None and owner and blocks[0] > 0:
            if streams is None or TEXT not in streams:
                raise RuntimeError(f"segment {blocks}: the first patch arrived without its text stream")
            inputs[forward.text_stream] = streams[TEXT]
        p = self._begin(SEGMENT, cond, band, keep_kv, blocks=(blocks[0], blocks[-1]), inputs=inputs)
        ended, output = self._forward(cond, self._stand_in(cond, hidden))
        out = ended if ended is not None else p.outputs
        assert out is not None, "the segment's last block ran"
        if forward.text_stream is not None and owner and streams is not None:
            streams[TEXT] = out[forward.text_stream]
        self._stash = None if output is None else (out[forward.hidden], output)
        return out[forward.hidden]

    def head(
        self, hidden: torch.Tensor, cond: ForwardConditioning, token_cols: int, band: PatchBand | None = None
    ) -> torch.Tensor:
        """(B, band tokens, hidden) -> (B, C_out, rows, W) of the rows covering the band: the forward's epilogue
        (run with the segment on this rank, or here on the hidden states given), from its whole-latent output."""
        if self._stash is not None and self._stash[0] is hidden:
            output = self._stash[1]
        else:
            self._begin(EPILOGUE, cond, band, inputs={self.forward_plan.hidden: hidden})
            _, output = self._forward(cond, self._stand_in(cond, hidden))
        self._stash = None
        grid = self._output_grid(output, cond, self.num_tokens // token_cols)  # (B, C_out, rows, W)
        return grid if band is None else grid[:, :, band.latent_rows]


def forward_stage(spec) -> type:
    """The ``ForwardStage`` of a family's ``ModelSpec`` (whose ``forward`` is its ``ForwardPlan``), its ``spec`` a class
    attribute as the hand-written stages have: ``ModelSpec.forward_stage_class``."""
    return type(f"{spec.diffusers_transformer}ForwardStage", (ForwardStage,), {"spec": spec})
