"""A DiT block's adaptive-norm modulation computed once per denoising step, not once per patch.

diffusers' adaptive norms turn the step's conditioning into the block's scales, shifts and gates with
``linear(silu(emb))`` (``ADAPTIVE_NORMS``), a product that depends on the conditioning alone. The engine builds one
conditioning per step, so without help every patch pass of a step recomputes the same products: with M patches, M
times a step, each reading the whole weight (for the released FLUX.1 these linears hold 3.2B of its 12B parameters;
on one CPU core the ~19 MB of ``flux-small``'s take about 1 ms a pass).

``memoize_modulation`` gives a norm's ``silu`` and ``linear`` a memo keyed on the *identity* of their input: the
same conditioning tensor gives the same ``silu`` output tensor, which gives the same ``linear`` output. Identity,
not value: comparing values would wait for the device on every call. The memo holds its input, so the id cannot be
reused while it lives, and it checks both tensors' version counters, so an in-place change of either (or of a view
of the output, e.g. a chunk) recomputes; nothing is memoised under autograd or for inference tensors, which have no
version counter (a call inside ``torch.inference_mode()`` recomputes per pass, as before). Parameters and state-dict
names are unchanged, and the modules are still ``nn.SiLU`` / ``nn.Linear`` (PEFT wraps the linear as it would any
other: a LoRA layer's own path is not memoised). A new request builds new conditioning tensors, so weights changed
between requests (LoRA fused, adapters set) are never served from a memo.

Which pass pays: without help the step's first. With M = N = 2 a step lasts twice its heaviest patch (the first
patch's round trip through both ranks paces the next step), so per-step work in the first patch costs twice. The engine
therefore calls ``prefetch_modulation`` (through ``Stage.prepare_step``) with the *next* step's conditioning once this
rank's last task of a step has sent its messages, and the next step's passes all find their products memoised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.models.normalization import (
    AdaLayerNorm,
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
    SD35AdaLayerNormZeroX,
)
from diffusers.models.transformers.hunyuan_transformer_2d import AdaLayerNormShift
from torch import nn

# The diffusers norms whose modulation is ``self.linear(self.silu(conditioning))`` (each ``forward``; with a dtype
# cast between in AdaLayerNormContinuous and AdaLayerNormShift, a no-op where the dtypes already agree).
ADAPTIVE_NORMS = (
    AdaLayerNorm,
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
    SD35AdaLayerNormZeroX,
    AdaLayerNormShift,
)


class _IdentityMemo(nn.Module):
    """``forward`` of the base class, returned again while called with the same, unchanged input tensor."""

    _memo: tuple[torch.Tensor, int, torch.Tensor, int] | None = None  # input, its version, output, its version
    # one request's step (``xfuse.parallel.request_state``): requests streamed together keep their own products
    REQUEST_STATE = ("_memo",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # not memoised: under autograd (an output belongs to one graph), or for inference tensors (no version
        # counter to see an in-place change by)
        if torch.compiler.is_compiling() or torch.is_grad_enabled() or x.is_inference():
            return super().forward(x)
        memo = self._memo
        if memo is not None and memo[0] is x and memo[1] == x._version and memo[3] == memo[2]._version:
            return memo[2]
        out = super().forward(x)
        self._memo = (x, x._version, out, out._version)
        return out


class MemoSiLU(_IdentityMemo, nn.SiLU):
    pass


class MemoLinear(_IdentityMemo, nn.Linear):
    pass


@dataclass(frozen=True)
class Modulation:
    """One memoised norm's product: its ``silu`` and ``linear`` (the memo modules themselves, which a PEFT layer
    put in the norm later wraps), and the dtype its ``forward`` hands ``silu`` the conditioning in (``None``: as
    given)."""

    silu: MemoSiLU | None  # None: the linear takes the conditioning itself
    linear: MemoLinear
    cast: torch.dtype | None  # AdaLayerNormShift: float32


def prefetch_modulation(modulations: list[Modulation], emb: torch.Tensor) -> None:
    """Compute each norm's ``linear(silu(emb))`` ahead of the pass that needs it, as its ``forward`` does
    (``ADAPTIVE_NORMS``): the blocks then find it memoised for ``emb``. Only where their call will pass this very
    tensor: not a norm that casts ``emb`` to another dtype first (AdaLayerNormShift to float32,
    AdaLayerNormContinuous to the hidden states'), which makes a new tensor each time and is left to its pass."""
    for m in modulations:
        if emb.dtype == (m.cast or m.linear.weight.dtype):
            m.linear(emb if m.silu is None else m.silu(emb))


def memoize_sequential(modules: list[nn.Module]) -> list[Modulation]:
    """The same memo for modulations written as ``nn.Sequential([nn.SiLU(),] nn.Linear(...))`` outside an adaptive
    norm (Qwen-Image's per-block ``img_mod`` and ``txt_mod``; Z-Image's blocks' ``adaLN_modulation``, a linear of the
    step's embedding alone, and its final layer's); returns what it memoised."""
    modulations = []
    for sequential in modules:
        *silu, linear = sequential
        if len(silu) > 1 or type(linear) is not nn.Linear or (silu and type(silu[0]) is not nn.SiLU):
            continue
        linear.__class__ = MemoLinear
        if silu:
            silu[0].__class__ = MemoSiLU
        modulations.append(Modulation(silu[0] if silu else None, linear, None))
    return modulations


def memoize_modulation(root: nn.Module) -> list[Modulation]:
    """Give every adaptive norm in ``root`` (``ADAPTIVE_NORMS``) the per-step memo; returns what it memoised, for
    ``prefetch_modulation`` (found once here, not by a walk of the model every step). A norm that embeds a timestep
    itself first (``norm.emb``) gets none: its ``silu`` sees a new tensor every call, so a memo would only hold an
    output no call reuses."""
    modulations = []
    for norm in root.modules():
        if not isinstance(norm, ADAPTIVE_NORMS) or getattr(norm, "emb", None) is not None:
            continue
        silu, linear = getattr(norm, "silu", None), getattr(norm, "linear", None)
        if type(silu) is nn.SiLU and type(linear) is nn.Linear:  # not, e.g., a PEFT layer already in place
            silu.__class__, linear.__class__ = MemoSiLU, MemoLinear
            cast = torch.float32 if isinstance(norm, AdaLayerNormShift) else None
            modulations.append(Modulation(silu, linear, cast))
    return modulations
