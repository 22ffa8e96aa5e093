"""Stages of a real diffusers HunyuanDiT2DModel, run in one process, reproduce the model's own forward."""

import copy

import pytest
import torch

from xfuse.families.hunyuandit.presets import build_tiny_transformer
from xfuse.families.hunyuandit.reference import staged_forward
from xfuse.families.hunyuandit.stage import HunyuanDiTStage, rotary_embedding, text_states
from xfuse.families.registry import HUNYUANDIT
from xfuse.parallel.patch_grid import patch_grid
from xfuse.parallel.stage import BatchPart
from xfuse.parallel.stage_plan import stage_plan

NUM_LAYERS = 16


@pytest.fixture(scope="module")
def model():
    transformer = build_tiny_transformer("tiny", seed=0)
    assert transformer.config.num_layers == NUM_LAYERS
    # Perturb every weight so no part is zero-initialised: a wrong skip wiring or a dropped block must show.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in transformer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return transformer


def inputs(config, height, width, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, 77, dtype=torch.long)
    mask[0, 40:] = 0  # padding: the learned padding parameter is swapped in
    mask_t5 = torch.ones(batch, 256, dtype=torch.long)
    mask_t5[1, 100:] = 0
    return (
        dict(
            encoder_hidden_states=torch.randn(batch, 77, 32, generator=g),
            text_embedding_mask=mask,
            encoder_hidden_states_t5=torch.randn(batch, 256, 32, generator=g),
            text_embedding_mask_t5=mask_t5,
            image_meta_size=None,
            style=None,
            image_rotary_emb=rotary_embedding(config, height, width),
        ),
        torch.randn(batch, 4, height, width, generator=g),
        torch.tensor([500.0, 500.0]),
    )


def rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


CASES = [(n, placement) for n in range(1, 9) for placement in ("balanced", "folded", "linear")]


@pytest.mark.parametrize("height,width", [(16, 16), (12, 20)])  # square, and non-square with uneven bands
@pytest.mark.parametrize("degree,placement", CASES)
def test_stages_reproduce_forward_whole_and_patchwise(model, degree, placement, height, width):
    kwargs, latents, t = inputs(model.config, height, width)
    with torch.no_grad():
        expected = model(latents, t, **kwargs, return_dict=False)[0]
        plan = stage_plan(NUM_LAYERS, degree, placement, skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
        stages = {r: HunyuanDiTStage(copy.deepcopy(model), plan, r) for r in range(degree)}
        for stage in stages.values():
            stage.begin_request(patch_grid(height, width, 1, 2))
        whole = staged_forward(stages, latents, t, **kwargs)
        assert rel_diff(whole, expected) <= 1e-6
        # The buffers now hold this step's K/V: patch by patch must give the same result.
        grid = patch_grid(height, width, num_patches=min(degree + 1, height // 2), patch_size=2)
        patchwise = staged_forward(stages, latents, t, **kwargs, grid=grid)
        assert rel_diff(patchwise, expected) <= 1e-5


def request_text(stage, kwargs):
    """The cross-attention input, computed once per request as ``denoise_request`` does."""
    return text_states(
        stage.transformer,
        kwargs["encoder_hidden_states"],
        kwargs["text_embedding_mask"],
        kwargs["encoder_hidden_states_t5"],
        kwargs["text_embedding_mask_t5"],
    )


def run_in_parts(stage, latents, t, kwargs, text, parts):
    """The whole image through a one-rank stage as batch parts (each its rows, its conditioning), outputs joined in
    batch order, as the engine runs a whole-image step on the output rank."""
    cond = stage.conditioning(
        t, text, kwargs["encoder_hidden_states_t5"], None, None, kwargs["image_rotary_emb"]
    )  # a new conditioning object per call, as the engine builds one per step
    outputs = []
    for part in parts:
        part_cond, skips = stage.batch_part(cond, part), {}
        hidden = stage.embed(latents[part.rows], None)  # (part rows, C, H, W) -> (part rows, tokens, D)
        for segment in stage.plan.route:
            hidden = stage.run_segment(hidden, segment, part_cond, None, skips, keep_kv=True)
        outputs.append(stage.head(hidden, part_cond, latents.shape[-1] // 2))
    return torch.cat(outputs), cond


def test_batch_parts_reproduce_forward_and_store_their_kv_rows(model):
    """A whole-image pass in two batch parts equals the model's forward, and leaves the K/V buffers as a whole pass
    does: a patch-by-patch pass of the whole batch afterwards equals the forward too. Storing both parts into the
    first part's rows (an injected bug) leaves the second row's K/V unwritten and shows in the patch pass."""
    height, width = 12, 20
    kwargs, latents, t = inputs(model.config, height, width)
    plan = stage_plan(NUM_LAYERS, 1, "folded", skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    grid = patch_grid(height, width, num_patches=3, patch_size=2)
    with torch.no_grad():
        expected = model(latents, t, **kwargs, return_dict=False)[0]
        for parts, close in (([BatchPart(0, 2, 1), BatchPart(1, 2, 1)], True), ([BatchPart(0, 2, 1)] * 2, False)):
            stage = HunyuanDiTStage(copy.deepcopy(model), plan, 0)  # new buffers: no earlier pass's K/V in them
            stage.begin_request(grid)
            whole, _ = run_in_parts(stage, latents, t, kwargs, request_text(stage, kwargs), parts)
            if close:
                assert rel_diff(whole, expected) <= 1e-5  # float rounding of batch-1 GEMMs only
            patchwise = staged_forward({0: stage}, latents, t, **kwargs, grid=grid)
            assert (rel_diff(patchwise, expected) <= 1e-5) == close, parts


def test_a_batch_part_reuses_its_text_and_text_kv_every_step(model):
    """``batch_part`` slices the request's text once per part, so every step's part passes the same tensor and the
    cross-attention computes a part's text K/V once per request (not once per step)."""
    kwargs, latents, t = inputs(model.config, 8, 8)
    plan = stage_plan(NUM_LAYERS, 1, "folded", skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    stage = HunyuanDiTStage(copy.deepcopy(model), plan, 0)
    stage.begin_request(patch_grid(8, 8, 1, 2))
    projections = []
    hooks = [b.attn2.to_k.register_forward_hook(lambda *a: projections.append(1)) for b in stage.transformer.blocks]
    parts = [BatchPart(0, 2, 1), BatchPart(1, 2, 1)]
    with torch.no_grad():
        text = request_text(stage, kwargs)
        _, first = run_in_parts(stage, latents, t, kwargs, text, parts)
        assert len(projections) == NUM_LAYERS * 2  # each part's text K/V, in every block
        part_texts = [stage.batch_part(first, p).text for p in parts]
        _, second = run_in_parts(stage, latents, t, kwargs, text, parts)  # the next step: a new conditioning
    for hook in hooks:
        hook.remove()
    assert second is not first and len(projections) == NUM_LAYERS * 2
    assert all(a is b for a, b in zip(part_texts, [stage.batch_part(second, p).text for p in parts], strict=True))
    assert [tuple(x.shape) for x in part_texts] == [(1, *text.shape[1:])] * 2


def test_stage_keeps_only_its_blocks_with_stable_names(model):
    plan = stage_plan(NUM_LAYERS, 4, "folded", skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    full_names = dict(model.named_parameters())
    for rank in range(4):
        stage = HunyuanDiTStage(copy.deepcopy(model), plan, rank)
        names = {n.removeprefix("transformer.") for n, _ in stage.named_parameters()}
        blocks = {int(n.split(".")[1]) for n in names if n.startswith("blocks.")}
        assert blocks == set(plan.blocks_of(rank))
        assert names <= set(full_names)  # same names, same global indices
        assert ("pos_embed.proj.weight" in names) == (rank == 0)
        assert ("proj_out.weight" in names) == (rank == 0)  # folded: rank 0 owns both ends
        for n, p in stage.named_parameters():
            assert torch.equal(p, full_names[n.removeprefix("transformer.")])


def test_stage_from_pretrained_reads_only_its_tensors(tmp_path):
    """A rank loads its share from the checkpoint: same tensors as the full model, nothing else, nothing meta."""
    from diffusers import HunyuanDiT2DModel

    from xfuse.families.hunyuandit.presets import save_tiny_pipeline

    folder = save_tiny_pipeline(tmp_path / "tiny")
    full = HunyuanDiT2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
    full_tensors = dict(full.state_dict())
    plan = stage_plan(NUM_LAYERS, 4, "linear", skips=HUNYUANDIT.skip_pairs(NUM_LAYERS))
    for rank in (0, 3):
        stage = HunyuanDiTStage.from_pretrained(folder, plan, rank)
        tensors = {n.removeprefix("transformer."): t for n, t in stage.state_dict().items()}
        blocks = {int(n.split(".")[1]) for n in tensors if n.startswith("blocks.")}
        assert blocks == set(plan.blocks_of(rank))
        assert ("pos_embed.proj.weight" in tensors) == (rank == 0) and ("proj_out.weight" in tensors) == (rank == 3)
        assert all(t.device.type == "cpu" and torch.equal(t, full_tensors[n]) for n, t in tensors.items())
    half = HunyuanDiTStage.from_pretrained(folder, plan, 1, torch_dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
