"""PipeFusion's attention at diffusers' attention dispatcher: where a pass's queries meet the whole image's K/V.

Every modern diffusers attention processor computes its queries, keys and values and hands them to
``diffusers.models.attention_dispatch.dispatch_attention_fn`` (as (B, S, heads, head_dim) each). ``route_dispatcher``
points the name a processor's module calls at :func:`_dispatch` once per module; outside a PipeFusion pass (no
:class:`AttentionCall` current: a plain diffusers pipeline in the same process) it is diffusers' own function, called
with the same arguments. Inside one, the stage's hook on the attention module (``xfuse.families.generic.stage``) has
said what the call is:

* ``self``: the pass's image tokens attend to each other: the keys and values go through the stage's stale K/V buffers
  (``PassAttention``), fresh for the pass's tokens, the previous step's for the rest;
* ``joint``: the text shares the softmax (an MMDiT's [text, image] sequence): the image part as ``self``, the text's
  K/V recorded by the step's first patch and attended to by every later one (``JointKV``), as the hand-written MMDiT
  families do;
* ``cross``: the queries attend to a context the pass does not cut (Wan's text): diffusers' own attention.
"""

from __future__ import annotations

import sys
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from xfuse.families.common.joint import JointKV

KINDS = ("self", "joint", "cross")
_CALL: ContextVar[AttentionCall | None] = ContextVar("xfuse_attention_call", default=None)
_ROUTED: dict[str, Any] = {}  # module name -> the dispatch_attention_fn it had


@dataclass(frozen=True)
class AttentionCall:
    """What one attention module's call in a PipeFusion pass is (the module docstring's kinds).

    ``key`` names the module's K/V buffers (its block's global index and its name in the block); ``text_tokens``: the
    text at the front (``text_first``) or back of a joint call's sequence (zero for a patch that reuses its step's).
    """

    key: tuple[int, str]
    kind: str
    state: JointKV
    text_tokens: int = 0
    text_first: bool = True

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(B, S, heads, head_dim) q/k/v of this call -> the attention output, (B, S, heads, head_dim)."""
        heads = query.shape[2]
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))  # -> (B, heads, S, head_dim)
        if self.kind == "self":
            out, _ = self.state.attention.attend(self.key, (query, key, value))  # (B, S, heads * head_dim)
            return out.unflatten(-1, (heads, -1))  # -> (B, S, heads, head_dim)
        text_len = self.text_tokens
        parts = [x.split((text_len, x.shape[2] - text_len) if self.text_first else
                         (x.shape[2] - text_len, text_len), dim=2) for x in (query, key, value)]  # fmt: skip
        text, image = zip(*(p if self.text_first else p[::-1] for p in parts), strict=True)
        attention = self.state.text_attention(self.key, *text, self.text_first)
        image_out, text_out = self.state.attention.attend(self.key, image, attention)  # (B, n, heads * d) each
        joined = (text_out, image_out) if self.text_first else (image_out, text_out)
        return torch.cat(joined, dim=1).unflatten(-1, (heads, -1))  # -> (B, S, heads, head_dim)


class current_call:
    """``with current_call(call):`` the dispatcher's calls inside are ``call``'s (a context variable: a thread or task
    of its own sees its own)."""

    def __init__(self, call: AttentionCall):
        self.call = call

    def __enter__(self) -> AttentionCall:
        self.token = _CALL.set(self.call)
        return self.call

    def __exit__(self, *exc) -> None:
        _CALL.reset(self.token)


def route_dispatcher(processor: object) -> None:
    """Make the module that defines ``processor``'s class call :func:`_dispatch` for ``dispatch_attention_fn`` (once per
    module); raise ``TypeError`` for a processor that computes its attention another way."""
    cls = type(processor)
    if "dispatch_attention_fn" not in getattr(cls.__call__, "__code__", None).co_names:
        raise TypeError(
            f"{cls.__name__} does not call diffusers' dispatch_attention_fn: the generic family places its stale K/V "
            "there (a model whose processors call SDPA themselves needs a hand-written family)"
        )
    module = sys.modules[cls.__module__]
    if cls.__module__ not in _ROUTED:
        _ROUTED[cls.__module__] = module.dispatch_attention_fn
        module.dispatch_attention_fn = _routed(_ROUTED[cls.__module__])


def _routed(original):
    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None,
                              parallel_config=None):  # fmt: skip
        """diffusers' ``dispatch_attention_fn``, or inside a PipeFusion pass the call's attention (module docstring)."""
        call = _CALL.get()
        if call is None or call.kind == "cross":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs, backend=backend,
                            parallel_config=parallel_config)  # fmt: skip
        options = {"attn_mask": attn_mask, "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa,
                   "dropout_p": dropout_p, "attention_kwargs": attention_kwargs,
                   "parallel_config": parallel_config}  # fmt: skip
        given = sorted(
            name for name, value in options.items() if value is not None and (torch.is_tensor(value) or value)
        )
        if given:
            raise ValueError(
                f"attention {call.key}: the generic family's stale K/V attention takes no {', '.join(given)} "
                "(a masked, causal, scaled or already context-parallel attention needs a hand-written family)"
            )
        return call.attend(query, key, value)

    dispatch_attention_fn.__wrapped__ = original  # type: ignore[attr-defined]
    return dispatch_attention_fn
