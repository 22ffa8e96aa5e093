"""What a rank allocates while it works: the activation peaks of one request, traced through xfuse's own pipeline of
the family on a weightless model.

The other terms of a rank's memory are counted from the sharded model (``xfuse.perf.memory``). Activations depend
on every op of a forward, so they are not written down per family: the family's diffusers pipeline is built on the
meta device (no weights, no arithmetic, only shapes), wrapped in its xfuse pipeline on one rank (every step a
whole-image pass, the largest a rank runs) and called at the request's size under :class:`LiveBytes`, a dispatch
mode that holds the bytes of every tensor an op makes until Python frees it, as the allocator would. Peaks
(:class:`RequestActivations`): while each text encoder runs, while each block of the chain runs (what the call
holds beside it included), the rest of the denoising loop, and on request the VAE decode.

Values a pipeline reads back from its own small tensors (the tokenizer's mask, the schedule) are kept beside their
meta copies, so that a prompt keeps its own length (Qwen-Image, Z-Image); other data-dependent scalars read as for
an unpadded prompt (every token attended). Attention is counted as a flash kernel allocates it (the output and its
log-sum-exp). Not seen: a kernel's own workspace (a CPU attention's per-thread blocks, cuDNN's) and the allocator's
rounding. ``xfuse.perf.memory.activation_bytes`` turns these into each rank's share of a layout.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, replace
from functools import lru_cache
from unittest import mock

import torch
from torch.fx.experimental import _config as fx_config
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from xfuse.families.registry import PRESET_MODELS, model_spec, text_encoder_configs
from xfuse.families.spec import ModelSpec
from xfuse.parallel.engine import PipeFusionEngine
from xfuse.perf.trace_cache import on_disk

PROMPT = "a photo of a red house by a lake at sunset"  # the request a plan is for: one prompt, unpadded


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors made by ops while the mode is on and still alive, after every op: the peak overall and
    per ``label`` (set by the caller: the block that runs). Views and in-place results share a storage and count
    once; tensors made before the mode count nothing.

    Small values a pipeline moves to the meta device (token ids, masks, timesteps) keep a CPU copy beside them, and
    ops whose meta inputs all have one are computed on the copies too, so that what a pipeline reads back (a mask's
    lengths, a schedule's values) is the real value; other meta scalars read back as 1 (a mask: all attended)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int, object]] = {}  # storage -> (weak reference, bytes, label)
        self.current = self.peak = self.base = 0
        self.label: object = None
        self.peaks: dict[object, int] = {}
        self.values = WeakIdKeyDictionary()  # meta tensor -> its CPU copy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        metas = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_meta]
        known = bool(metas) and all(t in self.values for t in metas)
        if known and (func is torch.ops.aten._local_scalar_dense.default or _to_cpu(func, kwargs)):
            return func(*tree_map(self._value, args), **tree_map(self._value, kwargs))
        if func is torch.ops.aten._local_scalar_dense.default and metas:  # not known: a mask's all(), attended
            return True if args[0].dtype == torch.bool else 1
        if known:  # computed on the copies too (on the CPU); the result on the meta device, with its copy
            on_cpu = {k: torch.device("cpu") if k == "device" else self._value(v) for k, v in kwargs.items()}
            value = func(*tree_map(self._value, args), **on_cpu)
            out = tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, value)
            for meta, cpu in zip(tree_leaves(out), tree_leaves(value), strict=True):
                if isinstance(meta, torch.Tensor):
                    self.values[meta] = cpu
        else:
            if func is torch.ops.aten.index.Tensor:  # a known mask selects the tokens it keeps, not all of them
                args = (args[0], [self._positions(i) for i in args[1]], *args[2:])
                args = (args[0], [i for group in args[1] for i in (group if isinstance(group, tuple) else (group,))])
            out = _made_from_shapes(func, args, kwargs)
            if out is None:
                out = func(*args, **kwargs)
            if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and out.is_meta:
                source = args[0]
                if not source.is_meta and source.numel() <= SMALL:
                    self.values[out] = source.to(out.dtype)
        given = {t.untyped_storage()._cdata for t in leaves if isinstance(t, torch.Tensor)}  # a view or an in-place
        for t in tree_leaves(out):  # result is not a new tensor
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live and key not in given:
                    nbytes = storage.nbytes()
                    self.live[key] = (StorageWeakRef(storage), nbytes, self.label)
                    self.current += nbytes  # an upper bound until the next count (frees are seen by counting)
        if self.current - self.base > self.peaks.get(self.label, -1):  # only then may this op be a new peak
            self._count()
        return out

    def _positions(self, index):
        """A known bool index as the positions it selects (one long tensor per dimension), on the meta device."""
        if index is None or index.dtype != torch.bool or index not in self.values:
            return index
        return tuple(p.to("meta") for p in self.values[index].nonzero().unbind(1))

    def _value(self, x):
        return self.values[x] if isinstance(x, torch.Tensor) and x.is_meta else x

    def _count(self) -> None:
        expired = torch.UntypedStorage._expired  # StorageWeakRef.expired without its two Python layers
        for key in [k for k in self.live if expired(k)]:
            del self.live[key]
        self.current = sum(n for _, n, _ in self.live.values())
        self.peak = max(self.peak, self.current - self.base)
        self.peaks[self.label] = max(self.peaks.get(self.label, 0), self.current - self.base)

    def alive_by_label(self) -> dict[object, int]:
        """Bytes alive now, by the label that was current when each tensor was made."""
        self._count()
        alive: dict[object, int] = {}
        for _, nbytes, label in self.live.values():
            alive[label] = alive.get(label, 0) + nbytes
        return alive

    def restart(self) -> None:
        """Peaks from now on, above what is alive now (a tensor alive now and freed later lowers the count, as the
        allocator's would)."""
        self._count()
        self.base, self.peak, self.peaks = self.current, 0, {}


SMALL = 1 << 16  # elements of a CPU tensor moved to the meta device whose values are kept (ids, masks, timesteps)

_aten = torch.ops.aten
_MATMULS = {_aten.addmm.default: (1, 2), _aten.mm.default: (0, 1), _aten.bmm.default: (0, 1)}  # the two factors
_BROADCAST = {_aten.add.Tensor, _aten.mul.Tensor, _aten.sub.Tensor, _aten.div.Tensor, _aten.pow.Tensor_Scalar}
_FLOAT_UNARY = {_aten.neg.default, _aten.gelu.default, _aten.rsqrt.default, _aten.silu.default, _aten.clamp_min.default}
_REDUCTIONS = {_aten.mean.dim: 1, _aten.linalg_vector_norm.default: 2}  # where the reduced dims are
_FROM_SHAPES = _MATMULS.keys() | _BROADCAST | _FLOAT_UNARY


def _made_from_shapes(func, args, kwargs) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
    """The output of one of a trace's commonest ops (matmuls, broadcast arithmetic, activations, layer norm, means and
    norms, concatenation) on meta inputs, made from their shapes and dtypes alone: torch's meta kernels for these run
    its Python references (0.1-1 ms an op, most of a trace's time). The output is what those kernels make: a new
    contiguous tensor of the result's shape and dtype (a matmul's and a layer norm's of any input layout; the others'
    of contiguous inputs). ``None``: not such an op, or inputs torch's own kernel is left to judge (another layout
    where it matters; mixed dtypes; integers beside a CPU scalar, whose promotion a wrapped number changes; a
    ``dtype`` argument)."""
    if func is _aten.native_layer_norm.default:
        return _layer_norm_from_shapes(*args)
    if func in _REDUCTIONS:
        return _reduced_from_shapes(args, _REDUCTIONS[func], kwargs)
    if func is _aten.cat.default:
        return _cat_from_shapes(*args)
    if func not in _FROM_SHAPES:
        return None
    metas = [a for a in args if isinstance(a, torch.Tensor) and a.is_meta]
    scalars = [a for a in args if isinstance(a, torch.Tensor) and not a.is_meta]  # a Python number, wrapped
    if not metas or any(t.dim() for t in scalars):
        return None
    if func in _MATMULS:  # the product is a new contiguous tensor whatever the factors' layout
        return _matmul_from_shapes(func, args) if not scalars else None
    if not all(t.is_contiguous() and t.is_floating_point() for t in metas) or any(t.is_complex() for t in scalars):
        return None
    if func in _FLOAT_UNARY:
        return torch.empty(args[0].shape, dtype=args[0].dtype, device="meta")
    shape = torch.broadcast_shapes(*(t.shape for t in metas))
    return torch.empty(shape, dtype=torch.result_type(args[0], args[1]), device="meta")


def _matmul_from_shapes(func, args) -> torch.Tensor | None:
    """``addmm``'s, ``mm``'s or ``bmm``'s product of factors of one dtype (``addmm``'s bias too, broadcast to it)."""
    first, second = (args[i] for i in _MATMULS[func])
    if first.dtype != second.dtype:
        return None
    shape: tuple[int, ...]
    if func is _aten.bmm.default:  # (b, n, m) @ (b, m, p) -> (b, n, p)
        if first.dim() != 3 or second.dim() != 3 or (first.shape[0], first.shape[2]) != second.shape[:2]:
            return None
        shape = (first.shape[0], first.shape[1], second.shape[2])
    else:  # (n, m) @ (m, p) -> (n, p)
        if first.dim() != 2 or second.dim() != 2 or first.shape[1] != second.shape[0]:
            return None
        shape = (first.shape[0], second.shape[1])
    if func is _aten.addmm.default:
        bias = args[0]
        if not bias.is_meta or bias.dtype != first.dtype or bias.dim() > 2:
            return None
        if any(b not in (1, s) for b, s in zip(reversed(bias.shape), reversed(shape), strict=False)):
            return None
    return torch.empty(shape, dtype=first.dtype, device="meta")


def _layer_norm_from_shapes(x, normalized_shape, weight, bias, eps) -> tuple[torch.Tensor, ...] | None:
    """``native_layer_norm``'s (output, mean, rstd) as its meta kernel makes them, of any input layout: the output
    like the input but contiguous, the statistics over the leading dimensions (the normalised ones kept as 1) in
    float32 for a half-precision input, else in its dtype."""
    if not (x.is_meta and x.is_floating_point()):
        return None
    if any(t is not None and not t.is_meta for t in (weight, bias)):
        return None
    stats_shape = (*x.shape[: x.dim() - len(normalized_shape)], *(1,) * len(normalized_shape))
    stats_dtype = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    return (
        torch.empty(x.shape, dtype=x.dtype, device="meta"),
        torch.empty(stats_shape, dtype=stats_dtype, device="meta"),
        torch.empty(stats_shape, dtype=stats_dtype, device="meta"),
    )


def _reduced_from_shapes(args, dims_at: int, kwargs) -> torch.Tensor | None:
    """``mean.dim``'s or ``linalg_vector_norm``'s result of a contiguous float input in its own dtype: the reduced
    dimensions (all where none are named) dropped, or kept as 1 with ``keepdim``."""
    x = args[0]
    if not (x.is_meta and x.is_contiguous() and x.is_floating_point()) or kwargs.get("dtype") is not None:
        return None
    dims = args[dims_at] if len(args) > dims_at else None
    dims = [dims] if isinstance(dims, int) else dims
    keepdim = bool(args[dims_at + 1]) if len(args) > dims_at + 1 else False
    if x.dim() == 0:
        return None
    reduced = {d % x.dim() for d in dims} if dims else set(range(x.dim()))
    shape = [1 if i in reduced else n for i, n in enumerate(x.shape) if keepdim or i not in reduced]
    return torch.empty(shape, dtype=x.dtype, device="meta")


def _cat_from_shapes(tensors, dim: int = 0) -> torch.Tensor | None:
    """``cat`` of contiguous meta tensors of one dtype and rank, equal but along ``dim``: contiguous, their sizes
    along ``dim`` added."""
    first = tensors[0] if tensors else None
    if first is None or first.dim() == 0:
        return None
    dim %= first.dim()
    for t in tensors:
        if not (t.is_meta and t.is_contiguous() and t.dtype == first.dtype and t.dim() == first.dim()):
            return None
        if t.shape[:dim] != first.shape[:dim] or t.shape[dim + 1 :] != first.shape[dim + 1 :]:
            return None
    shape = (*first.shape[:dim], sum(t.shape[dim] for t in tensors), *first.shape[dim + 1 :])
    return torch.empty(shape, dtype=first.dtype, device="meta")


def _to_cpu(func, kwargs) -> bool:
    device = kwargs.get("device")
    return func is torch.ops.aten._to_copy.default and device is not None and torch.device(device).type == "cpu"


@contextlib.contextmanager
def _labelled(mode: LiveBytes, modules: dict):
    """``mode.label`` set to a module's key while that module's forward runs (and back to what it was after)."""
    handles, before = [], []
    for key, module in modules.items():

        def enter(_module, _args, key=key):
            mode._count()
            before.append(mode.label)
            mode.label = key

        def leave(_module, _args, _out):
            mode._count()
            mode.label = before.pop()

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


_SDPA = torch.nn.functional.scaled_dot_product_attention


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as a flash kernel allocates (the output and its log-sum-exp, not the
    (B, H, N, N) weights the meta device's math path would make), for meta tensors."""
    if not query.is_meta:
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and key.shape[-3] != query.shape[-3]:  # (B, H_kv, N, d) -> (B, H, N, d), as the kernels expand
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # made additive, as torch does for a bool mask
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


@contextlib.contextmanager
def traced():
    """What a trace runs under: no autograd, flash attention, a meta ``nonzero`` that counts every element (a
    mask's: all attended)."""
    nonzero = fx_config.patch(meta_nonzero_assume_all_nonzero=True)  # type: ignore[attr-defined]
    with torch.no_grad(), nonzero, mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _flash_sdpa):
        yield


@dataclass(frozen=True)
class RequestActivations:
    """What one request holds beside the weights, in bytes, from :func:`call_peaks`: what each block leaves alive
    once the request is done (until the next request replaces it: its text K/V record, K/V it keeps by reference),
    and the peaks of a second request above what the first left (a tensor of the first freed during the second
    lowers the count, as the allocator's would)."""

    batch: int  # the transformer batch of the whole-image passes
    kept: tuple[int, ...]  # chain block -> bytes its passes leave alive after the request
    kept_rest: int  # bytes the rest of the request leaves alive (the loop's, the text encoders')
    encode: int  # peak while a text encoder runs
    blocks: tuple[int, ...]  # chain block -> peak while it runs
    outside: int  # peak of the denoising loop outside the blocks (embedding, output layer, scheduler step)
    decode: int = 0  # peak while the VAE decodes (rank 0's decode, or this rank's band)

    def total(self) -> int:
        """The request's peak on one rank holding every block, beside the weights."""
        return sum(self.kept) + self.kept_rest + max(self.encode, max(self.blocks, default=0), self.outside,
                                                     self.decode)  # fmt: skip


def _meta_pipeline(model: str, dtype: torch.dtype):
    """The model's diffusers pipeline on the meta device, in ``dtype``: its preset built weightless, with the
    released text encoders where the preset names them (``RELEASED_TEXT_ENCODERS``)."""
    import transformers
    from accelerate import init_empty_weights

    if model not in PRESET_MODELS:
        raise ValueError(f"activations are traced for the presets; {model!r} is a folder")
    spec = model_spec(model)
    with init_empty_weights():  # parameters and buffers on the meta device; a scheduler's tensors stay real
        pipe = spec.build_preset_pipeline(model)
        for name, config in text_encoder_configs(model).items():
            current = getattr(pipe, name, None)
            if current is None or current.config.to_dict() == config:
                continue
            model_class = getattr(transformers, config["architectures"][0])
            setattr(pipe, name, model_class(model_class.config_class.from_dict(config)).eval())
    pipe = pipe.to("meta")
    if dtype != torch.float32:  # each model cast: torch's own cast, as diffusers' ModelMixin.to warns on any dtype
        for component in pipe.components.values():  # ("should be kept in float32: []"), of nothing the user did
            if isinstance(component, torch.nn.Module):
                torch.nn.Module.to(component, dtype=dtype)
    for module in pipe.transformer.modules():  # tensors kept as plain attributes (Qwen-Image's RoPE tables): the
        for name, value in list(vars(module).items()):  # model's constants, not made by a call
            if isinstance(value, torch.Tensor):
                setattr(module, name, value.to("meta"))
    return pipe


def call_peaks(xp, call: dict) -> RequestActivations:
    """The peaks of the second of two ``xp(**call)`` on this rank (an xfuse pipeline: one rank on the meta device,
    or any rank of a real world), above what the first left alive: its stale K/V buffers, reused, and what a family
    keeps from one request until the next replaces it, as a serving rank's allocator sees it. Labelled by text
    encoder, block, the rest of the denoising loop and the VAE decode (rank 0's, or this rank's band)."""
    encoders = {name: getattr(xp.pipeline, name) for name in ("text_encoder", "text_encoder_2", "text_encoder_3")
                if getattr(xp.pipeline, name, None) is not None}  # fmt: skip
    stages = [xp.stage, *getattr(xp, "extra_stages", {}).values()]  # Wan 2.2's second expert: its blocks too
    blocks = {("block", index): stage.blocks[index] for stage in stages for index in stage.block_ids}
    mode, batches = LiveBytes(), []

    def within(label, run, request=False):
        def labelled(*args, **kwargs):
            if request:
                batches.append(args[0].model_batch)
            before, mode.label = mode.label, label
            try:
                return run(*args, **kwargs)
            finally:
                mode._count()
                mode.label = before

        return labelled

    engines = [value for value in vars(xp).values() if isinstance(value, PipeFusionEngine)]  # Wan 2.2: two experts'
    wrapped = [(engine, "denoise", within("outside", engine.denoise, request=True)) for engine in engines]
    for decoder in (getattr(xp.pipeline, "vae", None), xp.band_decode):
        if decoder is not None:
            wrapped.append((decoder, "decode", within("decode", decoder.decode)))
    for owner, name, method in wrapped:
        setattr(owner, name, method)
    try:
        with traced(), mode, _labelled(mode, {**blocks, **encoders}):
            with warnings.catch_warnings():  # a one-step schedule divides by its zero span (a shift's) in numpy
                warnings.simplefilter("ignore", RuntimeWarning)
                xp(**{**call, "num_inference_steps": 1})  # what a request leaves: each step replaces the last's
            alive = mode.alive_by_label()
            mode.restart()
            xp(**call)
    finally:
        for owner, name, _ in wrapped:
            delattr(owner, name)  # the class's again
    chain = range(xp.plan.num_blocks)
    return RequestActivations(
        batch=max(batches),
        kept=tuple(alive.pop(("block", index), 0) for index in chain),
        kept_rest=sum(alive.values()),
        encode=max((mode.peaks.get(name, 0) for name in encoders), default=0),
        blocks=tuple(mode.peaks.get(("block", index), 0) for index in chain),
        outside=mode.peaks.get("outside", 0),
        decode=mode.peaks.get("decode", 0),
    )


def trace_call(model: str, height: int, width: int, num_frames: int | None = None, *,
               negative_prompt: bool = False) -> dict:  # fmt: skip
    """The ``__call__`` arguments of the request traced for ``model``: one prompt, two whole-image steps, latents
    out."""
    spec = model_spec(model)
    # A family that keeps a prompt at its own length is traced with one at the most it takes, as the plan counts it.
    prompt = PROMPT if spec.text_padded else " ".join([PROMPT] * (sum(spec.text_lengths) // len(PROMPT) + 1))
    kwargs = {"prompt": prompt, "height": height, "width": width, "num_inference_steps": TRACE_STEPS,
              "output_type": "latent"}  # fmt: skip
    if spec.resolution_binning:
        kwargs["use_resolution_binning"] = False
    if num_frames is not None:
        kwargs["num_frames"] = num_frames
    if negative_prompt:  # as long as the prompt: a CFG group's text at the most
        kwargs["negative_prompt"] = prompt
    return kwargs


TRACE_STEPS = 2  # a step after the first, holding what a step keeps for the next, as most of a request's steps
TRACE_PARALLEL = {"warmup_steps": TRACE_STEPS}  # one rank, every step a whole-image pass (a rank's largest)


def _preset_request(model: str, height: int, width: int, num_frames: int | None = None, *,
                    negative_prompt: bool = False, dtype: torch.dtype = torch.float32,
                    trace_decode: bool = False) -> tuple | None:  # fmt: skip
    """:func:`request_activations`' key on disk: a preset's request (a folder's config may change under its path)."""
    if model not in PRESET_MODELS:
        return None
    return model, height, width, num_frames, negative_prompt, str(dtype), trace_decode


@lru_cache(maxsize=32)
@on_disk(_preset_request)
def request_activations(model: str, height: int, width: int, num_frames: int | None = None, *,
                        negative_prompt: bool = False, dtype: torch.dtype = torch.float32,
                        trace_decode: bool = False) -> RequestActivations:  # fmt: skip
    """Trace one ``height`` x ``width`` px request (``num_frames``: a clip's; ``negative_prompt``: with one) of
    preset ``model`` in ``dtype``: xfuse's own pipeline of the family on one rank of the meta device
    (:func:`call_peaks`), and with ``trace_decode`` its VAE decode."""
    from xfuse.config import config_from_dict
    from xfuse.runtime.world import one_process_context

    spec = model_spec(model)
    pipe = _meta_pipeline(model, dtype)
    runtime = {"device": "cpu", "dtype": str(dtype).removeprefix("torch.")}  # the meta device: the context's
    config = config_from_dict({"model": model, "parallel": TRACE_PARALLEL, "runtime": runtime})
    xp = spec.pipeline_class()(pipe, one_process_context(config, torch.device("meta")), dtype)
    xp.set_progress_bar_config(disable=True)
    peaks = call_peaks(xp, trace_call(model, height, width, num_frames, negative_prompt=negative_prompt))
    if not trace_decode:
        return peaks
    return replace(peaks, decode=_traced_decode(pipe, spec, height, width, num_frames))


def _traced_decode(pipe, spec: ModelSpec, height: int, width: int, num_frames: int | None) -> int:
    """The peak of ``vae.decode`` on one image's (clip's) latents, traced (for Qwen-Image's and LTX-Video's 3-D VAEs,
    which the bands do not run: a frame axis; Wan's: ``xfuse.perf.video_vae``)."""
    vae = pipe.vae
    factor, config = spec.vae_scale_factor, vae.config
    rows = (height // factor, width // factor)
    shape: tuple[int, ...]
    if "z_dim" in config:  # the causal 3-D VAEs (Wan's, Qwen-Image's): (B, C, frames, h, w)
        shape = (1, config["z_dim"], spec.latent_frames(num_frames), *rows)
    elif spec.video:  # LTX-Video's: (B, C, frames, h, w) too
        shape = (1, config["latent_channels"], spec.latent_frames(num_frames), *rows)
    else:
        shape = (1, config["latent_channels"], *rows)
    latents = torch.zeros(shape, device="meta", dtype=next(vae.parameters()).dtype)
    mode = LiveBytes()
    with traced(), mode:
        vae.decode(latents, return_dict=False)
    return mode.peak
