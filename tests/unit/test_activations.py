"""The activation trace (``xfuse.perf.activations``): xfuse's own pipeline of each family run on the meta device (no
weights, no arithmetic) counts the tensors a real run holds. Against the same call on real CPU tensors, counted by
the same dispatch mode: the text encoders' peak and every block's, per family (its first preset), within 8 %.

What the count does not see is each CPU kernel's own workspace (the CPU flash attention's per-thread blocks, a
matrix product's packing): the allocator's peak of the same calls is higher by that (measured on this machine,
2026-11-27, 256 px: the text encoders within 10 %, the blocks by 0.5-3 MiB at these sizes); on a GPU, flash
attention has none.
"""

import pytest
import torch

from xfuse.families.registry import FAMILIES, load_pipeline, model_spec
from xfuse.perf.activations import TRACE_PARALLEL, LiveBytes, call_peaks, request_activations, trace_call

SIDE = 128


def _frames(spec):
    return 1 + 2 * spec.vae_temporal_factor if spec.video else None


@pytest.mark.parametrize("preset", [spec.presets[0] for spec in FAMILIES])
def test_the_meta_trace_counts_what_a_real_run_holds(preset):
    spec = model_spec(preset)
    call = trace_call(preset, SIDE, SIDE, _frames(spec))
    xp = spec.pipeline_class().from_pipe(load_pipeline(preset), parallel=TRACE_PARALLEL)
    xp.set_progress_bar_config(disable=True)
    real = call_peaks(xp, call)
    traced = request_activations(preset, SIDE, SIDE, _frames(spec))
    assert traced.batch == real.batch
    assert traced.encode == pytest.approx(real.encode, rel=0.08)
    assert len(traced.blocks) == len(real.blocks) == spec.num_blocks(spec.preset_transformer_config(preset))
    for index, (got, held) in enumerate(zip(traced.blocks, real.blocks, strict=True)):
        assert got == pytest.approx(held, rel=0.08), index
    assert min(real.blocks) > 0 and real.encode > 0


def test_live_bytes_counts_a_tensor_until_it_is_freed_and_views_once():
    mode = LiveBytes()
    with mode:
        a = torch.empty(1000, device="meta")  # 4000 bytes
        view = a.view(10, 100)  # the same storage
        b = a + 1  # 4000 more
        del a, view
        c = b * 2  # a is still referenced by nothing: freed before c
    assert mode.peak == 8000 and mode.current == 8000
    del b, c


def test_known_values_follow_a_mask_to_the_tokens_it_keeps():
    """A bool mask moved to the meta device keeps its values: indexing with it keeps as many rows as it selects, and
    its sum reads back (what Z-Image's and Qwen-Image's prompt encodings do with the tokenizer's mask)."""
    mask = torch.tensor([True, True, False, True])
    with LiveBytes():
        hidden = torch.zeros(4, 8, device="meta")
        on_meta = mask.to("meta")
        kept = hidden[on_meta]
        count = int(on_meta.sum())
    assert kept.shape == (3, 8) and count == 3


def test_released_shapes_trace_in_seconds_and_scale_with_the_image():
    """FLUX.2 [klein] 4B's release (the Qwen3-4B text encoder) at 512 and 1024 px in bf16: a block's peak grows with
    the tokens (4x the image tokens: more than 2x, what the 512 text tokens keep per block fixed); the text
    encoder's does not depend on the image."""
    small = request_activations("flux2-klein-4b", 512, 512, dtype=torch.bfloat16)
    large = request_activations("flux2-klein-4b", 1024, 1024, dtype=torch.bfloat16)
    assert large.encode == small.encode > 0
    assert 2 < max(large.blocks) / max(small.blocks) < 4


@pytest.mark.parametrize("preset", ["flux2-tiny", "z-image-tiny", "flux-tiny"])
def test_a_request_leaves_only_its_text_kv_records_alive(preset):
    """After a whole-image request (exact mode: no stale K/V buffers) a stage keeps each block's text K/V record and
    nothing else. The records are copies where the K/V were views of a larger tensor: FLUX.2's single blocks project
    q, k, v and the MLP input of every token in one tensor, and a view of it kept that whole output alive for every
    block of the rank through each whole-image step and between requests (FLUX.2 [dev] at 1024 px on one rank:
    23.3 GiB, traced; 0.8 GiB with the copies)."""
    spec = model_spec(preset)
    xp = spec.pipeline_class().from_pipe(load_pipeline(preset), parallel=TRACE_PARALLEL)
    xp.set_progress_bar_config(disable=True)
    mode = LiveBytes()
    with mode:
        xp(**trace_call(preset, SIDE, SIDE))
        mode._count()
    records = [t for pair in xp.stage.joint.text.values() for t in pair]
    assert records and all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in records)
    held = sum(t.untyped_storage().nbytes() for t in records)
    # + what the request keeps besides (the scheduler's scalars; Z-Image's per-request caption stream and positions)
    assert held <= mode.current <= 1.15 * held


def test_a_bf16_trace_casts_without_diffusers_warning_of_modules_it_keeps(capfd):
    """diffusers' ``ModelMixin.to`` warns on any dtype ("should be kept in float32: []"); ``xfuse plan`` casts the
    weightless models itself, and a user who asked for a plan reads no warning of it."""
    from diffusers.utils import logging as diffusers_logging

    from xfuse.perf.activations import _meta_pipeline

    assert diffusers_logging.get_verbosity() <= diffusers_logging.WARNING  # the warning would be shown
    pipe = _meta_pipeline("flux2-tiny", torch.bfloat16)
    assert pipe.transformer.dtype == pipe.vae.dtype == torch.bfloat16
    assert "should be kept in float32" not in capfd.readouterr().err


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


aten = torch.ops.aten
BF16 = torch.bfloat16
# (op, args, kwargs): each made from shapes by the trace's fast path, each compared with torch's own meta kernel
MADE_FROM_SHAPES = [
    (aten.addmm.default, (_meta(8), _meta(5, 4), _meta(4, 8)), {}),
    (aten.addmm.default, (_meta(1, 8, dtype=BF16), _meta(5, 4, dtype=BF16), _meta(4, 8, dtype=BF16)), {}),
    (aten.addmm.default, (_meta(8, dtype=BF16), _meta(5, 4, dtype=BF16), _meta(8, 4, dtype=BF16).t()), {}),  # Linear's
    (aten.addmm.default, (_meta(5, 8), _meta(5, 6)[:, :4], _meta(4, 16)[:, ::2]), {"beta": 0.5}),  # sliced factors
    (aten.mm.default, (_meta(5, 4), _meta(4, 8)), {}),
    (aten.mm.default, (_meta(4, 5).t(), _meta(1, 8).expand(4, 8)), {}),
    (aten.bmm.default, (_meta(3, 5, 4, dtype=BF16), _meta(3, 4, 8, dtype=BF16)), {}),
    (aten.bmm.default, (_meta(3, 5, 4), _meta(3, 8, 4).transpose(1, 2)), {}),
    (aten.add.Tensor, (_meta(2, 1, 8), _meta(3, 1)), {}),  # broadcast both ways
    (aten.mul.Tensor, (_meta(2, 3, 8, dtype=BF16), _meta(8)), {}),
    (aten.mul.Tensor, (_meta(2, 3, 8, dtype=BF16), _meta()), {}),  # a 0-dim float32 beside bf16: bf16
    (aten.mul.Tensor, (_meta(2, 3, dtype=BF16), torch.tensor(0.5)), {}),  # a wrapped Python number
    (aten.sub.Tensor, (_meta(4, 8, dtype=BF16), _meta(4, 8)), {}),  # bf16 - float32: float32
    (aten.div.Tensor, (_meta(2, 16, 3, 4, 4, dtype=BF16), _meta(2, 1, 3, 4, 4, dtype=BF16)), {}),  # F.normalize's
    (aten.pow.Tensor_Scalar, (_meta(4, 8, dtype=BF16), 2), {}),
    (aten.gelu.default, (_meta(4, 8, dtype=BF16),), {"approximate": "tanh"}),
    (aten.silu.default, (_meta(2, 4, 8),), {}),
    (aten.clamp_min.default, (_meta(2, 1, 3, 4, 4, dtype=BF16), 1e-12), {}),
    (aten.native_layer_norm.default, (_meta(2, 16, 64, dtype=BF16), [64], _meta(64, dtype=BF16), None, 1e-6), {}),
    (aten.native_layer_norm.default, (_meta(4, 8, 6, 32), [6, 32], None, None, 1e-6), {}),
    (aten.native_layer_norm.default, (_meta(2, 64, 16, dtype=BF16).transpose(1, 2), [64], None, None, 1e-6), {}),
    (aten.native_layer_norm.default, (_meta(2, 32, 64)[:, ::2], [64], _meta(64), _meta(64), 1e-6), {}),
    (aten.mean.dim, (_meta(2, 16, 64, dtype=BF16), [-1], True), {}),  # an RMS norm's
    (aten.mean.dim, (_meta(2, 16, 64), [0, 2]), {}),
    (aten.mean.dim, (_meta(2, 16, 64), None), {}),  # every dimension
    (aten.linalg_vector_norm.default, (_meta(2, 16, 3, 4, 4, dtype=BF16), 2, [1], True), {}),  # F.normalize's
    (aten.linalg_vector_norm.default, (_meta(2, 16, 3),), {}),
    (aten.cat.default, ([_meta(1, 16, 2, 8, 8), _meta(1, 16, 1, 8, 8)], 2), {}),  # a causal cache and a frame
    (aten.cat.default, ([_meta(3, 4, dtype=BF16), _meta(5, 4, dtype=BF16), _meta(1, 4, dtype=BF16)],), {}),
    (aten.cat.default, ([_meta(2, 3, 1, 1), _meta(2, 5, 1, 1)], -3), {}),
]


@pytest.mark.parametrize(
    "op, args, kwargs", MADE_FROM_SHAPES, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(MADE_FROM_SHAPES)]
)
def test_ops_made_from_shapes_are_what_torchs_meta_kernels_make(op, args, kwargs):
    from xfuse.perf.activations import _made_from_shapes

    made, kernel = _made_from_shapes(op, args, kwargs), op(*args, **kwargs)
    assert made is not None  # the fast path took it
    for ours, torchs in zip(
        made if isinstance(made, tuple) else (made,), kernel if isinstance(kernel, tuple) else (kernel,), strict=True
    ):
        assert (ours.shape, ours.dtype, ours.stride(), ours.is_meta) == (
            torchs.shape,
            torchs.dtype,
            torchs.stride(),
            True,
        )


@pytest.mark.parametrize(
    "op, args, kwargs",
    [
        (aten.mul.Tensor, (_meta(4, 8).t(), _meta(8, 4)), {}),  # another layout: torch's kernel keeps it
        (aten.add.Tensor, (_meta(4, 8, dtype=torch.int64), torch.tensor(0.5)), {}),  # an int beside a wrapped float
        (aten.mm.default, (_meta(5, 4), _meta(4, 8, dtype=BF16)), {}),  # mixed dtypes: torch's kernel judges them
        (aten.addmm.default, (_meta(8, dtype=BF16), _meta(5, 4), _meta(4, 8)), {}),  # a bias of another dtype
        (aten.addmm.default, (_meta(3), _meta(5, 4), _meta(4, 8)), {}),  # a bias that does not broadcast: an error
        (aten.mean.dim, (_meta(2, 16, 64, dtype=BF16), [-1], True), {"dtype": torch.float32}),  # a dtype asked for
        (aten.linalg_vector_norm.default, (_meta(16, 2).t(), 2, [1], True), {}),  # another layout
        (aten.cat.default, ([_meta(3, 4), _meta(5, 4, dtype=BF16)],), {}),  # mixed dtypes: promoted by torch's kernel
        (aten.cat.default, ([_meta(4, 3).t(), _meta(5, 4)],), {}),  # another layout
        (aten.exp.default, (_meta(4, 8),), {}),  # not one of the ops
    ],
)
def test_other_inputs_are_left_to_torchs_kernel(op, args, kwargs):
    from xfuse.perf.activations import _made_from_shapes

    assert _made_from_shapes(op, args, kwargs) is None
