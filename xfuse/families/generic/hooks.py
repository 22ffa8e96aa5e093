"""The hooks that make one call of a diffusers transformer's ``forward`` one PipeFusion pass (diffusers' own
``HookRegistry``, as its context parallelism applies its plan).

* ``BandSplitHook`` / ``BandGatherHook``: the model's context-parallel plan applied to a patch instead of a rank:
  where diffusers splits a sequence across ranks (``ContextParallelInput``), the pass keeps its band's image tokens,
  and its context (the plan's entries the ``ForwardPlan`` names) whole on the step's first patch, empty on the others;
  where diffusers gathers it (``ContextParallelOutput``), the band's tokens are put back in a whole-image tensor
  (zeros elsewhere), so that the forward's own unpatchify runs on the whole latent's shape.
* ``BlockGateHook``: every block of the chain, run or not as the pass says (``Pass``): blocks before the pass's
  segment return their inputs, its first block takes the hand-off, the block after it ends the forward with its
  inputs (``SegmentEnd``), and an epilogue pass gives the last block's outputs from the hand-off.
* ``AttentionCallHook``: each call of an attention module of the blocks a rank runs made a current ``AttentionCall``;
  ``CallMemo``: a prologue module's output kept while its inputs do not change.

A stage's hooks hold its pass state: a stage is not copied (diffusers' hooks reach their modules' originals).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from xfuse.families.generic.dispatch import current_call

PROLOGUE, SEGMENT, EPILOGUE = "prologue", "segment", "epilogue"


class SegmentEnd(Exception):
    """Raised by the first block after a pass's segment (or, in a prologue pass, by the first block): ``inputs`` are
    that block's streamed inputs (``ForwardPlan.block_returns``), the segment's hand-off."""

    def __init__(self, inputs: dict[str, torch.Tensor]):
        super().__init__("the pass's segment ended")
        self.inputs = inputs


@dataclass
class Pass:
    """One call of the forward as a PipeFusion pass on this rank.

    ``tokens``: the image tokens the pass computes (``None``: all, in the model's order); ``index``: the model's
    index of each of them where the layout orders tokens otherwise (Wan's ``spatial`` video layout), else ``None``;
    ``num_tokens``: the image's. ``text``: the context tokens it carries (``None``: all; a step's later patch none,
    a sequence-parallel rank its chunk); ``text_tokens``: how many tokens of the text stream that is. ``blocks``: the
    segment (first, last) a ``segment`` pass runs. ``inputs``: the streamed tensors its first block takes (a
    ``segment`` pass's hand-off; an ``epilogue`` pass's last-block outputs); ``outputs``: the segment's last block's.
    """

    mode: str
    tokens: slice | None
    num_tokens: int
    text: slice | None
    index: torch.Tensor | None = None  # (tokens,) on the model's device, made once per pass
    blocks: tuple[int, int] = (0, -1)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] | None = None
    text_tokens: int = 0  # the text stream's tokens this pass carries (a joined block's hidden states begin with them)


class PassHolder:
    """The pass in flight on one stage, which every hook reads (``current`` is set around each forward call)."""

    def __init__(self) -> None:
        self.current: Pass | None = None

    def get(self, where: str) -> Pass:
        if self.current is None:
            raise RuntimeError(f"{where}: called outside a PipeFusion pass (the stage's forward is run by the engine)")
        return self.current


def cut_band(x: torch.Tensor, dim: int, p: Pass, where: str) -> torch.Tensor:
    """The pass's image tokens of ``x`` along ``dim`` (all of them in a whole-image pass)."""
    if p.tokens is None:
        return x
    if x.shape[dim] != p.num_tokens:
        raise ValueError(
            f"{where}: {x.shape[dim]} tokens along dim {dim}, but the image has {p.num_tokens}: an input the plan "
            "splits that is not the image's tokens must be named in the family's ForwardPlan.context or .uncut"
        )
    if p.index is None:
        return x.narrow(dim, p.tokens.start, p.tokens.stop - p.tokens.start)
    return x.index_select(dim, p.index)


def put_band(x: torch.Tensor, dim: int, p: Pass) -> torch.Tensor:
    """``x``'s band tokens along ``dim`` placed in a whole-image tensor (zeros at the other tokens); the inverse of
    :func:`cut_band` on the band's tokens."""
    if p.tokens is None:
        return x
    shape = list(x.shape)
    shape[dim] = p.num_tokens
    whole = x.new_zeros(shape)
    if p.index is None:
        whole.narrow(dim, p.tokens.start, p.tokens.stop - p.tokens.start).copy_(x)
    else:
        whole.index_copy_(dim, p.index, x)
    return whole


def _parameters(function) -> dict[str, int]:
    """``name -> position`` of a forward's parameters (``self`` dropped)."""
    names = [n for n in inspect.signature(function).parameters if n != "self"]
    return {name: i for i, name in enumerate(names)}


def _get(positions: dict[str, int], name: str, args: tuple, kwargs: dict) -> Any:
    if name in kwargs:
        return kwargs[name]
    index = positions.get(name)
    return args[index] if index is not None and index < len(args) else None


def _set(positions: dict[str, int], name: str, value, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    index = positions.get(name)
    if name not in kwargs and index is not None and index < len(args):
        return (*args[:index], value, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: value}


class BandSplitHook(ModelHook):
    """A ``ContextParallelInput`` entry of the plan (``entries``: input name or output index -> its spec, or a list of
    them for a tuple input), applied to the pass: image tokens cut to the band, context whole or empty."""

    def __init__(self, module_id: str, entries: dict, context: set[str], uncut: set[str], passes: PassHolder):
        super().__init__()
        self.module_id, self.entries, self.passes = module_id, entries, passes
        self.context, self.uncut = context, uncut
        self.positions: dict[str, int] = {}

    def initialize_hook(self, module):
        self.positions = _parameters(type(module).forward)
        return module

    def _cut(self, x, spec, name) -> Any:
        if not torch.is_tensor(x) or (spec.expected_dims is not None and x.dim() != spec.expected_dims):
            return x  # as diffusers' split hook: an input of other dimensions is not split
        p, entry = self.passes.get(self.module_id), f"{self.module_id}:{name}"
        if entry in self.uncut:
            return x
        if entry in self.context:
            return x if p.text is None else x.narrow(spec.split_dim, p.text.start, p.text.stop - p.text.start)
        return cut_band(x, spec.split_dim, p, f"the context-parallel plan's {entry!r}")

    def _cut_value(self, value, spec, name):
        if isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)):
            return type(value)(self._cut(x, s, f"{name}.{i}") for i, (x, s) in enumerate(zip(value, spec, strict=True)))
        return self._cut(value, spec, name)

    def pre_forward(self, module, *args, **kwargs):
        for name, spec in self.entries.items():
            if isinstance(name, int) or getattr(spec, "split_output", False):
                continue
            value = _get(self.positions, name, args, kwargs)
            if value is not None:
                args, kwargs = _set(self.positions, name, self._cut_value(value, spec, name), args, kwargs)
        return args, kwargs

    def post_forward(self, module, output):
        outputs = [output] if torch.is_tensor(output) else list(output)
        for index, spec in self.entries.items():
            if isinstance(index, int):
                outputs[index] = self._cut_value(outputs[index], spec, str(index))
        return outputs[0] if torch.is_tensor(output) else type(output)(outputs)


class BandGatherHook(ModelHook):
    """A ``ContextParallelOutput`` entry: the band's tokens of the module's output placed in a whole-image tensor."""

    def __init__(self, module_id: str, specs: list, passes: PassHolder):
        super().__init__()
        self.module_id, self.specs, self.passes = module_id, specs, passes

    def post_forward(self, module, output):
        p = self.passes.get(self.module_id)
        outputs = [output] if torch.is_tensor(output) else list(output)
        for i, spec in enumerate(self.specs):
            x = outputs[i]
            if spec.expected_dims is None or x.dim() == spec.expected_dims:
                outputs[i] = put_band(x, spec.gather_dim, p)
        return outputs[0] if torch.is_tensor(output) else type(output)(outputs)


class BlockGateHook(ModelHook):
    """Block ``index`` of the chain under the pass (the module docstring); ``block_class``'s forward says where its
    streamed inputs are in a call; a block this rank does not hold (``nn.Identity``) is never run. ``joined``: the
    block takes the text stream ``returns[0]`` joined in front of the hidden states ``returns[1]`` in one input of
    that name, and returns that tensor (``ForwardPlan.joined``); the pass's hand-offs keep the two apart."""

    def __init__(self, index: int, last: int, block_class: type, returns: tuple[str, ...], holds: bool,
                 passes: PassHolder, joined: bool = False):  # fmt: skip
        super().__init__()
        self.index, self.last, self.returns, self.holds, self.passes = index, last, returns, holds, passes
        self.positions = _parameters(block_class.forward)
        self.joined = joined

    def streamed(self, args, kwargs, p: Pass) -> dict[str, torch.Tensor]:
        if self.joined:
            text, hidden = self.returns
            both = _get(self.positions, hidden, args, kwargs)  # (B, text + image tokens, D)
            return {text: both[:, : p.text_tokens], hidden: both[:, p.text_tokens :]}
        return {name: _get(self.positions, name, args, kwargs) for name in self.returns}

    def returned(self, values: dict[str, torch.Tensor]):
        if self.joined:
            return torch.cat([values[name] for name in self.returns], dim=1)  # [text, image]
        out = tuple(values[name] for name in self.returns)
        return out[0] if len(out) == 1 else out

    def outputs(self, out, p: Pass) -> dict[str, torch.Tensor]:
        if self.joined:
            text, hidden = self.returns
            return {text: out[:, : p.text_tokens], hidden: out[:, p.text_tokens :]}
        return dict(zip(self.returns, (out,) if torch.is_tensor(out) else out, strict=True))

    def passed_on(self, args, kwargs, p: Pass):
        """What a block outside the pass's segment returns: its streamed inputs (a joined block's one tensor as it
        came, not split and joined again)."""
        if self.joined:
            return _get(self.positions, self.returns[1], args, kwargs)
        return self.returned(self.streamed(args, kwargs, p))

    def new_forward(self, module, *args, **kwargs):
        p, index = self.passes.get(f"block {self.index}"), self.index
        if p.mode == PROLOGUE:
            raise SegmentEnd(self.streamed(args, kwargs, p))
        if p.mode == EPILOGUE:
            if index == self.last:
                return self.returned(self.streamed(args, kwargs, p) | p.inputs)
            return self.passed_on(args, kwargs, p)
        first, last = p.blocks
        if index < first:
            return self.passed_on(args, kwargs, p)
        if index > last:
            raise SegmentEnd(self.streamed(args, kwargs, p))
        if not self.holds:
            raise RuntimeError(f"block {index} is in this pass's segment {first}-{last} but this rank does not hold it")
        if index == first:
            if self.joined:  # the hand-off joined as the forward joins it; a later patch's text: none
                hidden = p.inputs[self.returns[1]]
                text = p.inputs.get(self.returns[0], hidden[:, :0])
                args, kwargs = _set(self.positions, self.returns[1], torch.cat([text, hidden], dim=1), args, kwargs)
            else:
                for name, value in p.inputs.items():
                    args, kwargs = _set(self.positions, name, value, args, kwargs)
        out = self.fn_ref.original_forward(*args, **kwargs)
        if index == last:
            p.outputs = self.outputs(out, p)
        return out


def register(module: torch.nn.Module, hook: ModelHook, name: str) -> None:
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)


class AttentionCallHook(ModelHook):
    """Makes each call of one attention module a current ``AttentionCall`` (``xfuse.families.generic.dispatch``):
    ``classify(hidden, context)`` says what the call is from the module's inputs (the stage's ``attention_call``)."""

    def __init__(self, classify):
        super().__init__()
        self.classify = classify

    def new_forward(self, module, *args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        context = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
        with current_call(self.classify(hidden, context)):
            return self.fn_ref.original_forward(*args, **kwargs)


class CallMemo(ModelHook):
    """A prologue module's output, given again while it is called with the same tensors, unchanged (identity and
    version counter, as ``xfuse.families.common.modulation`` memoises a norm's product) and equal other arguments.

    Every pass runs the model's prologue, but within a step most of its inputs are the same tensors (the step's
    timestep, the request's text and pooled embeddings, a video's zero stand-in): the timestep and text embedders then
    run once a step, and their output, one tensor, lets the blocks' adaptive norms find their products memoised."""

    def __init__(self) -> None:
        super().__init__()
        self._memo: tuple | None = None  # the last call's args, kwargs, output and its tensors' versions

    @staticmethod
    def _key(value) -> Any:
        if torch.is_tensor(value):
            return (value, value._version)  # the tensor itself is held: its id cannot be reused meanwhile
        if isinstance(value, (list, tuple)):
            return tuple(CallMemo._key(v) for v in value)
        return value

    @staticmethod
    def _same(a, b) -> bool:
        if isinstance(a, tuple) and len(a) == 2 and torch.is_tensor(a[0]):
            return isinstance(b, tuple) and len(b) == 2 and a[0] is b[0] and a[1] == b[1]
        if isinstance(a, tuple):
            return isinstance(b, tuple) and len(a) == len(b) and all(map(CallMemo._same, a, b))
        return type(a) is type(b) and (a is b or a == b)

    @staticmethod
    def _tensors(value) -> list[torch.Tensor]:
        if torch.is_tensor(value):
            return [value]
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in CallMemo._tensors(v)]
        return []

    def new_forward(self, module, *args, **kwargs):
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.fn_ref.original_forward(*args, **kwargs)
        key_args, key_kwargs = self._key(args), {k: self._key(v) for k, v in kwargs.items()}
        memo = self._memo
        if (memo is not None and self._same(memo[0], key_args) and memo[1].keys() == key_kwargs.keys()
                and all(self._same(memo[1][k], v) for k, v in key_kwargs.items())
                and all(t._version == version for t, version in memo[3])):  # fmt: skip
            return memo[2]
        output = self.fn_ref.original_forward(*args, **kwargs)
        self._memo = (key_args, key_kwargs, output, [(t, t._version) for t in self._tensors(output)])
        return output
