"""What a patch costs: one pipelined step's M patch passes against one whole-image pass, per family, on one device.

PipeFusion's premise, and the performance model's assumption, is that a patch of 1/M of the image's tokens costs 1/M
of a whole-image pass: a pipelined step's M patch passes cost what one whole pass costs. On a GPU the smaller GEMMs
and attention queries use the device less well, so the step costs more; this module measures by how much.

Each family's released transformer shape (random weights, built on the device in bf16; no download) is built at two
depths, and for M in 1, 2, 4, 8 the latent's token rows are cut into M bands as the engine cuts them (rows split as
evenly as they go) and every band runs through the untouched diffusers model:

* self-attention (and the joint attention of MMDiT families) attends the band's queries over a K/V buffer of every
  token of the image: the band's fresh K/V are copied into the buffer's rows, the rest are stale rows, as
  ``xfuse.parallel.stale_kv.StaleKVCache.update`` does. ``torch.nn.functional.scaled_dot_product_attention`` is
  wrapped for the length of a band's pass (diffusers calls it by attribute), so the kernel torch picks (flash where it
  applies) sees the same shapes as the engine's;
* the text rides with the step's first patch only, where the family's text shares the softmax
  (``xfuse.families.common.joint``: later patches carry a text stream of zero tokens); cross-attention families carry
  their text K/V in every patch, as their cached cross-attention does;
* the blocks are timed from the first block's input to the last block's output (forward hooks, CUDA events on a GPU),
  so the embedding and output layers are not counted, and the per-block cost is the difference of the two depths
  divided by their difference in blocks: the cost of ``depths[1] - depths[0]`` more blocks of every list.

The result per family and M: the step's M patch passes over one whole pass (1.00 is the model's assumption), per
block and for the deeper stage, and the times in ms (median of ``repeats``, min-max).

A Ulysses rank's share of a pass, for U in 2, 4, 8 where the head count allows: the blocks on 1/U of the image's
token rows (and 1/U of a joint text), every self-attention over U times its tokens with 1/U of its heads, as after
Ulysses' all-to-all (``UlyssesShare``: the local Q/K/V reshaped to that shape, one copy standing for the all-to-all's
local permute; the network is not counted). Reported as U shares over one whole pass (1.00: a share costs 1/U, the
performance model's assumption for sequence parallelism).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from xfuse.perf.measured import even_rows  # the cut the model's curves assume (no torch at import time)

PATCH_COUNTS = (2, 4, 8)  # M; 1 is the whole image
SHARE_DEGREES = (2, 4, 8)  # U: Ulysses degrees whose rank's share is timed


@dataclass(frozen=True)
class Family:
    """One family's released transformer, how to feed it a band of token rows, and what rides with a patch."""

    name: str
    model: str  # the released checkpoint whose transformer shape this is
    preset: str | None  # xfuse's preset of that shape (``xfuse.perf.measured`` costs its blocks); None: no family yet
    transformer: type  # the diffusers transformer class
    config: dict  # its constructor arguments, but for the block counts
    depth_keys: tuple[str, ...]  # the config keys of the block counts: a depth d sets every one of them to d
    block_lists: tuple[str, ...]  # the model's block ModuleLists, in the order they run
    inputs: Callable[..., dict]  # (model, rows, text_tokens, batch, device, dtype) -> the forward's kwargs
    token_rows: int  # the whole image's token rows (the engine cuts patches along them)
    tokens_per_row: int  # tokens in one token row (Wan: every frame's tokens of that row)
    text_tokens: int
    batch: int  # 2 where the released pipeline runs CFG in one batch
    joint_text: bool  # the text shares the image's softmax: only the step's first patch carries it
    depths: tuple[int, int] = (2, 4)
    note: str = ""

    @property
    def tokens(self) -> int:
        return self.token_rows * self.tokens_per_row

    def build(self, depth: int):
        return self.transformer(**self.config, **dict.fromkeys(self.depth_keys, depth))


# ------------------------------------------------------------------------------------------------ the families
def _rand(*shape, device, dtype):
    import torch

    return torch.randn(*shape, device=device, dtype=dtype)


def _hunyuan_inputs(model, rows, text_tokens, batch, device, dtype):
    import torch
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    cfg = model.config
    cols = cfg.sample_size // cfg.patch_size
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # (S, head_dim) cos and sin of the band's grid, as HunyuanDiTPipeline computes them for a whole grid
    rope = get_2d_rotary_pos_embed(head_dim, ((0, 0), (rows, cols)), (rows, cols), device=device, output_type="pt")
    return dict(
        hidden_states=_rand(
            batch, cfg.in_channels, rows * cfg.patch_size, cols * cfg.patch_size, device=device, dtype=dtype
        ),  # fmt: skip
        timestep=torch.full((batch,), 500.0, device=device, dtype=dtype),  # HunyuanDiTPipeline's t_expand
        encoder_hidden_states=_rand(batch, cfg.text_len, cfg.cross_attention_dim, device=device, dtype=dtype),
        text_embedding_mask=torch.ones(batch, cfg.text_len, device=device, dtype=torch.long),
        encoder_hidden_states_t5=_rand(batch, cfg.text_len_t5, cfg.cross_attention_dim_t5, device=device, dtype=dtype),
        text_embedding_mask_t5=torch.ones(batch, cfg.text_len_t5, device=device, dtype=torch.long),
        image_rotary_emb=tuple(x.to(dtype) for x in rope),
    )


def _sd3_inputs(model, rows, text_tokens, batch, device, dtype):
    import torch

    cfg = model.config
    cols = cfg.sample_size // cfg.patch_size
    return dict(
        hidden_states=_rand(
            batch, cfg.in_channels, rows * cfg.patch_size, cols * cfg.patch_size, device=device, dtype=dtype
        ),  # fmt: skip
        encoder_hidden_states=_rand(batch, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        pooled_projections=_rand(batch, cfg.pooled_projection_dim, device=device, dtype=dtype),
        timestep=torch.full((batch,), 500.0, device=device),
    )


def _flux_ids(rows, cols, axes, device):
    """(rows * cols, axes) position ids of a grid: zeros, then the row and the column (FLUX.1: 3 axes; FLUX.2: 4)."""
    import torch

    ids = torch.zeros(rows, cols, axes, device=device)
    ids[..., axes - 2] = torch.arange(rows, device=device)[:, None]
    ids[..., axes - 1] = torch.arange(cols, device=device)[None, :]
    return ids.flatten(0, 1)  # (rows, cols, axes) -> (rows * cols, axes)


def _flux_inputs(model, rows, text_tokens, batch, device, dtype, *, cols):
    import torch

    cfg = model.config
    axes = len(cfg.axes_dims_rope)
    kwargs = dict(
        hidden_states=_rand(batch, rows * cols, cfg.in_channels, device=device, dtype=dtype),
        encoder_hidden_states=_rand(batch, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
        img_ids=_flux_ids(rows, cols, axes, device),
        txt_ids=torch.zeros(text_tokens, axes, device=device),
        guidance=torch.full((batch,), 3.5, device=device, dtype=dtype) if cfg.guidance_embeds else None,
    )
    if "pooled_projection_dim" in cfg:  # FLUX.1's CLIP vector; FLUX.2 has none
        kwargs["pooled_projections"] = _rand(batch, cfg.pooled_projection_dim, device=device, dtype=dtype)
    return kwargs


def _qwen_inputs(model, rows, text_tokens, batch, device, dtype, *, cols):
    import torch

    cfg = model.config
    return dict(
        hidden_states=_rand(batch, rows * cols, cfg.in_channels, device=device, dtype=dtype),
        encoder_hidden_states=_rand(batch, text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype),
        encoder_hidden_states_mask=None,  # every text token valid: no attention mask
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
        img_shapes=[(1, rows, cols)] * batch,
    )


def _wan_inputs(model, rows, text_tokens, batch, device, dtype, *, frames, cols):
    import torch

    cfg = model.config
    _, patch_h, patch_w = cfg.patch_size
    return dict(
        hidden_states=_rand(
            batch, cfg.in_channels, frames, rows * patch_h, cols * patch_w, device=device, dtype=dtype
        ),  # fmt: skip
        timestep=torch.full((batch,), 500.0, device=device),
        encoder_hidden_states=_rand(batch, text_tokens, cfg.text_dim, device=device, dtype=dtype),
    )


def families(quick: bool) -> list[Family]:
    """The released shapes (``quick``: tiny ones of the same classes, for the CPU test)."""
    from functools import partial

    from diffusers import (
        Flux2Transformer2DModel,
        FluxTransformer2DModel,
        HunyuanDiT2DModel,
        QwenImageTransformer2DModel,
        SD3Transformer2DModel,
        WanTransformer3DModel,
    )

    from xfuse.families.registry import transformer_config

    def released(preset: str, *drop: str) -> dict:  # xfuse's preset of the released shape, block counts left out
        return {k: v for k, v in transformer_config(preset).items() if k not in drop}

    side = 8 if quick else 64  # token rows and columns of a square image: 1024 px over the VAE's 8 and patch 2
    # Qwen-Image (Qwen/Qwen-Image, transformer/config.json): 24 heads x 128, Qwen2.5-VL's 3584 text width
    qwen = dict(num_attention_heads=24, attention_head_dim=128, joint_attention_dim=3584, in_channels=64,
                out_channels=16, axes_dims_rope=(16, 56, 56))  # fmt: skip
    tiny_heads = dict(num_attention_heads=2, attention_head_dim=32)
    if quick:
        qwen = dict(qwen, **tiny_heads, joint_attention_dim=32, axes_dims_rope=(8, 12, 12))
    frames, wan_rows, wan_cols = (3, 8, 7) if quick else (21, 30, 52)  # 81 frames of 480 x 832 px: 21 x 30 x 52 tokens
    presets = {"hunyuan": "tiny", "sd3": "sd3-tiny", "flux": "flux-tiny", "wan": "wan-tiny", "flux2": "flux2-tiny"} if (
        quick) else {"hunyuan": "dit-g2", "sd3": "sd3.5-large", "flux": "flux-dev", "wan": "wan2.1-t2v-14b",
                     "flux2": "flux2-dev"}  # fmt: skip
    one = ("num_layers",)
    two = ("num_layers", "num_single_layers")
    square = dict(token_rows=side, tokens_per_row=side)
    return [
        Family(
            "HunyuanDiT", "Tencent-Hunyuan/HunyuanDiT-v1.2 (DiT-g/2)", presets["hunyuan"], HunyuanDiT2DModel,
            released(presets["hunyuan"], *one), one, ("blocks",), _hunyuan_inputs,
            text_tokens=77 + 256, batch=2, joint_text=False, **square,
            note="cross-attention to CLIP (77) + T5 (256) tokens; long skips in the second half of the blocks",
        ),
        Family(
            "SD3.5", "stabilityai/stable-diffusion-3.5-large", presets["sd3"], SD3Transformer2DModel,
            released(presets["sd3"], *one), one, ("transformer_blocks",), _sd3_inputs,
            text_tokens=77 + 256, batch=2, joint_text=True, **square,
        ),
        Family(
            "FLUX.1", "black-forest-labs/FLUX.1-dev", presets["flux"], FluxTransformer2DModel,
            released(presets["flux"], *two), two, ("transformer_blocks", "single_transformer_blocks"),
            partial(_flux_inputs, cols=side), text_tokens=512, batch=1, joint_text=True, **square,
            note="a depth of d is d double-stream and d single-stream blocks (the release has 19 + 38)",
        ),
        Family(
            "Qwen-Image", "Qwen/Qwen-Image", None, QwenImageTransformer2DModel, qwen, one, ("transformer_blocks",),
            partial(_qwen_inputs, cols=side), text_tokens=128, batch=2, joint_text=True, **square,
            note="60 blocks released; 128 text tokens: a prompt of about 90 words after the template's are dropped",
        ),
        Family(
            "FLUX.2", "black-forest-labs/FLUX.2-dev", presets["flux2"], Flux2Transformer2DModel,
            released(presets["flux2"], *two), two,
            ("transformer_blocks", "single_transformer_blocks"), partial(_flux_inputs, cols=side),
            text_tokens=512, batch=1, joint_text=True, **square,
            note="a depth of d is d double-stream and d single-stream blocks (the release has 8 + 48)",
        ),
        Family(
            "Wan 2.1", "Wan-AI/Wan2.1-T2V-14B-Diffusers, 480 x 832 px, 81 frames", presets["wan"],
            WanTransformer3DModel, released(presets["wan"], *one), one, ("blocks",),
            partial(_wan_inputs, frames=frames, cols=wan_cols), token_rows=wan_rows, tokens_per_row=frames * wan_cols,
            text_tokens=512, batch=2, joint_text=False,
            note="spatial patches: a band of token rows in every frame; cross-attention to 512 UMT5 tokens",
        ),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------ measuring
@contextlib.contextmanager
def _sdpa_replaced_by(attention: Callable) -> Iterator[None]:
    """torch's SDPA replaced by ``attention`` for the block: diffusers calls it by attribute, so each pass's
    attention goes through it."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class StaleKV:
    """Wraps torch's SDPA for one band's pass: every self-attention (queries and keys of one length) attends over a
    buffer of the whole image's tokens, the band's K/V copied into its first rows (``StaleKVCache.update``)."""

    def __init__(self) -> None:
        self.extra = 0  # tokens of the image outside this pass's band
        self._buffers: dict[tuple, tuple] = {}
        self._call = 0

    @contextlib.contextmanager
    def band(self, extra_tokens: int) -> Iterator[None]:
        import torch.nn.functional as F

        original = F.scaled_dot_product_attention
        self.extra, self._call = extra_tokens, 0

        def attention(query, key, value, *args, **kwargs):
            if self.extra == 0 or key.shape[-2] != query.shape[-2]:  # the whole image, or cross-attention
                return original(query, key, value, *args, **kwargs)
            if args or kwargs.get("attn_mask") is not None:
                raise RuntimeError("gpu_patch_cost: a masked self-attention (the harness passes no masks)")
            k_buf, v_buf = self._buffer(key)
            k_buf[..., : key.shape[-2], :].copy_(key)
            v_buf[..., : value.shape[-2], :].copy_(value)
            return original(query, k_buf, v_buf, **kwargs)

        with _sdpa_replaced_by(attention):
            yield

    def _buffer(self, key):
        """Layer ``self._call``'s K/V buffers, (B, heads, band + stale tokens, head_dim) each, kept between passes as
        the engine keeps them (the stale rows hold whatever they held: their values do not change the cost)."""
        import torch

        self._call += 1
        shape = (*key.shape[:-2], key.shape[-2] + self.extra, key.shape[-1])
        entry = self._buffers.get((self._call, shape))
        if entry is None:
            entry = self._buffers[(self._call, shape)] = tuple(
                torch.randn(shape, device=key.device, dtype=key.dtype) for _ in range(2)
            )
        return entry


class UlyssesShare:
    """Wraps torch's SDPA for one share's pass: a self-attention's (B, heads, L, head_dim) Q/K/V become (B, heads / U,
    L * U, head_dim), the shape a Ulysses rank attends after its all-to-all (values permuted: they do not change the
    cost), and the output goes back; cross-attention (the text's keys) is left alone, as Ulysses leaves it."""

    def __init__(self) -> None:
        self.degree = 1

    @contextlib.contextmanager
    def share(self, degree: int) -> Iterator[None]:
        import torch.nn.functional as F

        original = F.scaled_dot_product_attention
        self.degree = degree

        def attention(query, key, value, *args, **kwargs):
            if key.shape[-2] != query.shape[-2]:  # cross-attention
                return original(query, key, value, *args, **kwargs)
            if args or kwargs.get("attn_mask") is not None:
                raise RuntimeError("gpu_patch_cost: a masked self-attention (the harness passes no masks)")
            b, heads, length, dim = query.shape
            # (B, heads, L, d) -> (B, heads / U, L * U, d): the all-to-all's result, as a local copy
            q, k, v = (x.reshape(b, heads // degree, length * degree, dim).contiguous() for x in (query, key, value))
            out = original(q, k, v, **kwargs)  # (B, heads / U, L * U, d)
            return out.reshape(b, heads, length, dim).contiguous()  # back: the second all-to-all's local copy

        with _sdpa_replaced_by(attention):
            yield


class BlockTimer:
    """Time from the first block's input to the last block's output of every forward (CUDA events on a GPU)."""

    def __init__(self, model, block_lists: tuple[str, ...], device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        first = getattr(model, block_lists[0])[0]
        last = getattr(model, block_lists[-1])[-1]
        self.marks: list = []

        def mark(*_):
            if self.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append(event)
            else:
                self.marks.append(time.perf_counter())

        self._handles = [first.register_forward_pre_hook(mark), last.register_forward_hook(mark)]

    def seconds(self) -> float:
        """Seconds inside the blocks since the last call (synchronises the device)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            pairs = [(a.elapsed_time(b) / 1e3) for a, b in zip(self.marks[::2], self.marks[1::2], strict=True)]
        else:
            pairs = [b - a for a, b in zip(self.marks[::2], self.marks[1::2], strict=True)]
        self.marks.clear()
        return sum(pairs)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _on_device(build: Callable[[int], Any], depth: int, device, dtype):
    """The model built on ``device`` and cast to ``dtype``, except the parameters diffusers keeps in float32 when it
    loads a checkpoint in a lower precision (``_keep_in_fp32_modules``: Wan's norms, time embedder and modulation)."""
    import torch
    from diffusers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # .to(dtype) warns about the float32 modules, which are put back below
    try:
        with torch.device(device):
            model = build(depth).to(dtype).eval()
    finally:
        logging.set_verbosity(verbosity)
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for name, param in model.named_parameters():
        if any(part in keep for part in name.split(".")):
            param.data = param.data.float()  # as diffusers' from_pretrained(torch_dtype=...) leaves them
    return model


def _spread(values: list[float]) -> dict:
    ms = [v * 1e3 for v in values]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms)}


def measure_family(family: Family, device, dtype, repeats: int) -> dict:
    """The blocks' time of a whole-image pass and of one step's M patch passes, at both depths (see the module)."""
    import torch

    result: dict = {"model": family.model, "preset": family.preset, "depth_keys": list(family.depth_keys),
                    "tokens": family.tokens, "token_rows": family.token_rows, "tokens_per_row": family.tokens_per_row,
                    "text_tokens": family.text_tokens, "batch": family.batch, "joint_text": family.joint_text,
                    "depths": list(family.depths), "note": family.note}  # fmt: skip
    times: dict[int, dict[int, dict]] = {}
    shares: dict[int, dict[int, dict]] = {}
    for depth in family.depths:
        model = _on_device(family.build, depth, device, dtype)
        if depth == family.depths[1]:
            result["parameters_per_stage"] = sum(p.numel() for p in model.parameters())
        timer = BlockTimer(model, family.block_lists, device)
        stale = StaleKV()
        text_in_later_patches = None
        times[depth] = {}
        try:
            for patches in (1, *PATCH_COUNTS):
                # per band: (its rows, the text it carries); the inputs are built once, outside the timed passes
                passes = []
                for i, rows in enumerate(even_rows(family.token_rows, patches)):
                    text = family.text_tokens if (i == 0 or not family.joint_text) else 0
                    kwargs = family.inputs(model, rows, text, family.batch, device, dtype)
                    passes.append((rows, kwargs))
                with torch.inference_mode():
                    if patches > 1 and family.joint_text and text_in_later_patches is None:
                        rows, kwargs = passes[-1]  # a later patch: a text stream of zero tokens
                        extra = (family.token_rows - rows) * family.tokens_per_row
                        text_in_later_patches = not _runs_without_text(model, kwargs, stale, extra)
                        timer.marks.clear()  # the probe's marks (a refused pass leaves its first one alone)
                    if text_in_later_patches and patches > 1:  # the model cannot take zero text tokens: say so
                        passes = [(rows, family.inputs(model, rows, family.text_tokens, family.batch, device, dtype))
                                  for rows, _ in passes]  # fmt: skip
                    samples = []
                    for round_ in range(repeats + 1):  # the first round warms the kernels and the buffers up
                        for rows, kwargs in passes:
                            extra = (family.token_rows - rows) * family.tokens_per_row
                            with stale.band(extra):
                                model(**kwargs, return_dict=False)
                        seconds = timer.seconds()
                        if round_:
                            samples.append(seconds)
                times[depth][patches] = _spread(samples)
            shares[depth] = _share_times(family, model, timer, repeats, device, dtype)
        finally:
            timer.remove()
            del model, stale
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if family.joint_text:
            result["text_in_later_patches"] = bool(text_in_later_patches)
    result["times"] = {str(d): {str(m): row for m, row in by_m.items()} for d, by_m in times.items()}
    shallow, deep = family.depths
    result["step_over_whole"] = {}
    for patches in PATCH_COUNTS:
        whole = {d: times[d][1]["median_ms"] for d in family.depths}
        step = {d: times[d][patches]["median_ms"] for d in family.depths}
        result["step_over_whole"][str(patches)] = {
            "per_block": (step[deep] - step[shallow]) / (whole[deep] - whole[shallow]),
            "stage": step[deep] / whole[deep],
        }
    result["block_ms_whole"] = (times[deep][1]["median_ms"] - times[shallow][1]["median_ms"]) / (deep - shallow)
    result["share_times"] = {str(d): {str(u): row for u, row in by_u.items()} for d, by_u in shares.items()}
    result["shares_over_whole"] = {}
    for degree in SHARE_DEGREES:
        if degree not in shares[deep]:
            continue
        whole = {d: times[d][1]["median_ms"] for d in family.depths}
        share = {d: shares[d][degree]["median_ms"] for d in family.depths}
        result["shares_over_whole"][str(degree)] = {
            "per_block": degree * (share[deep] - share[shallow]) / (whole[deep] - whole[shallow]),
            "stage": degree * share[deep] / whole[deep],
        }
    return result


def _share_times(family: Family, model, timer: BlockTimer, repeats: int, device, dtype) -> dict[int, dict]:
    """The blocks' time of one Ulysses rank's share of a whole pass, per degree U its heads allow (see the module)."""
    import torch

    heads = family.config.get("num_attention_heads", 0)
    share, out = UlyssesShare(), {}
    for degree in SHARE_DEGREES:
        if heads % degree or family.token_rows < degree:
            continue
        rows = family.token_rows // degree
        text = family.text_tokens // degree if family.joint_text else family.text_tokens  # a joint text is sharded
        kwargs = family.inputs(model, rows, text, family.batch, device, dtype)
        samples = []
        with torch.inference_mode(), share.share(degree):
            for round_ in range(repeats + 1):  # the first round warms up
                model(**kwargs, return_dict=False)
                seconds = timer.seconds()
                if round_:
                    samples.append(seconds)
        out[degree] = _spread(samples)
    return out


def _runs_without_text(model, kwargs: dict, stale: StaleKV, extra_tokens: int) -> bool:
    """Whether the untouched model runs a later patch's pass (``kwargs``: a text stream of zero tokens)."""
    try:
        with stale.band(extra_tokens):
            model(**kwargs, return_dict=False)
    except Exception:  # noqa: BLE001 - any refusal means the text rides in every patch; the report says so
        return False
    return True


def patch_cost(quick: bool, repeats: int, only: list[str] | None = None) -> dict:
    """Every family's patch cost on this machine's first CUDA device (``quick``: tiny shapes, on the CPU if there is
    no GPU)."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "repeats": repeats,
                 "patches": list(PATCH_COUNTS), "families": {}}  # fmt: skip
    for family in families(quick):
        if only and family.name not in only:
            continue
        start = time.monotonic()
        try:
            row = measure_family(family, device, dtype, repeats)
        except Exception as exc:  # noqa: BLE001 - one family's failure must not lose the others' figures
            row = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        row["seconds"] = time.monotonic() - start
        out["families"][family.name] = row
        print(f"  patch_cost {family.name}: {row['seconds']:.0f} s", flush=True)
    return out


def markdown(section: dict) -> list[str]:
    """The table of docs/performance.md: a step's M patch passes over one whole pass, per family and M."""
    lines = [
        f"A pipelined step's M patch passes over one whole-image pass ({section['dtype']}, blocks only, median of "
        f"{section['repeats']}; per block = the deeper stage minus the shallower, over their difference; 1.00 is the "
        "performance model's assumption):",
        "",
        "| family | tokens (+ text) | whole pass, ms / block | "
        + " | ".join(f"M = {m}" for m in section["patches"])
        + " |",
        "|---|---|---|" + "---|" * len(section["patches"]),
    ]
    for name, row in section["families"].items():
        if "error" in row:
            lines.append(f"| {name} | {row['error']} |")
            continue
        ratios = [row["step_over_whole"][str(m)] for m in section["patches"]]
        cells = " | ".join(f"{r['per_block']:.2f} (stage {r['stage']:.2f})" for r in ratios)
        text = f"{row['text_tokens']}" + ("" if not row.get("text_in_later_patches") else ", in every patch")
        lines.append(f"| {name} | {row['tokens']} ({text}) x {row['batch']} | {row['block_ms_whole']:.2f} | {cells} |")
    families = section["families"].items()
    shares = {name: row["shares_over_whole"] for name, row in families if row.get("shares_over_whole")}
    if shares:
        lines += [
            "",
            "A Ulysses rank's share: U shares over one whole pass (the all-to-all's local copies in, the network out; "
            "1.00 is the performance model's assumption; blank where the heads do not divide):",
            "",
            "| family | " + " | ".join(f"U = {u}" for u in SHARE_DEGREES) + " |",
            "|---|" + "---|" * len(SHARE_DEGREES),
        ]
        for name, by_u in shares.items():
            cells = " | ".join(
                f"{by_u[str(u)]['per_block']:.2f} (stage {by_u[str(u)]['stage']:.2f})" if str(u) in by_u else ""
                for u in SHARE_DEGREES
            )
            lines.append(f"| {name} | {cells} |")
    return lines
