"""FLUX.2 beyond the family contract (``tests/multirank/test_conformance.py`` runs that for ``flux2`` and
``flux2-klein``): every ``__call__`` argument of ``Flux2Pipeline`` and ``Flux2KleinPipeline`` against diffusers, the
refusals, what each rank loads, ``from_pipe``, and the text encoder split by layers over the pipeline group
(``parallel.text_encoder: split``: [dev]'s ``Mistral3ForConditionalGeneration``, 30 layers and a vision tower the text
never runs; [klein]'s ``Qwen3ForCausalLM``, 27 layers, its decoder called with ``input_ids``).

Sizes are non-square (128 x 96 px: 8 x 6 token rows); the tiny presets have 2 double and 3 single blocks.
"""

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

from tests.support.flux2_fns import from_pipe_call, loaded_share, text_encoder_share
from tests.support.pipeline_fns import check_against_diffusers as check
from tests.support.pipeline_fns import log_callback, reference_runner, run_calls
from tests.support.world import World
from xfuse.config import config_from_dict
from xfuse.families.flux2.presets import save_preset_pipeline
from xfuse.parallel.text_encoder_split import layer_share
from xfuse.perf.memory import rank_memory, text_encoder_bytes
from xfuse.perf.planner import workload

HEIGHT, WIDTH, STEPS = 128, 96, 3
BASE = dict(prompt="a red house by a lake", height=HEIGHT, width=WIDTH, num_inference_steps=STEPS, output_type="np")
EXACT = {"warmup_steps": 100}


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2")
    return {preset: save_preset_pipeline(root / preset, preset) for preset in ("flux2-tiny", "flux2-klein-tiny")}


@pytest.fixture(scope="module")
def references(folders):
    return {
        "flux2-tiny": reference_runner(Flux2Pipeline.from_pretrained(folders["flux2-tiny"], local_files_only=True)),
        "flux2-klein-tiny": reference_runner(
            Flux2KleinPipeline.from_pretrained(folders["flux2-klein-tiny"], local_files_only=True)
        ),
    }


def honoured_calls(reference, klein: bool):
    """Every ``__call__`` argument of the pipeline, each in a call diffusers runs too."""
    with torch.no_grad():
        emb, _ = reference.pipe.encode_prompt("a red house", device="cpu")
        neg, _ = reference.pipe.encode_prompt("", device="cpu")
    calls = {
        "base": {},
        "batch_and_images": dict(prompt=["a red house", "a cat"], num_images_per_prompt=2),
        "size_and_steps": dict(height=96, width=128, num_inference_steps=2),
        "sigmas": dict(sigmas=[1.0, 0.7, 0.3]),
        "guidance_scale": dict(guidance_scale=2.5),
        "latents": dict(latents=torch.randn(1, 16, 8, 6, generator=torch.Generator().manual_seed(7))),
        "prompt_embeds": dict(prompt=None, prompt_embeds=emb),
        "max_sequence_length": dict(max_sequence_length=300),
        "text_encoder_out_layers": dict(text_encoder_out_layers=(3, 8, 27)),
        "callback": dict(callback_on_step_end=log_callback, callback_on_step_end_tensor_inputs=["latents"]),
        "output_pil": dict(output_type="pil"),
        "output_latent": dict(output_type="latent"),
        "return_tuple": dict(return_dict=False),
        "seed": dict(seed=3),
    }
    if klein:  # classifier-free guidance on the empty prompt, off, and given negative embeddings
        calls["no_guidance"] = dict(guidance_scale=1.0)
        calls["negative_prompt_embeds"] = dict(prompt=None, prompt_embeds=emb, negative_prompt_embeds=neg)
    return calls


def check_against_diffusers(per_rank, calls, reference):
    check(per_rank, calls, reference, BASE, output_class="Flux2PipelineOutput", callback_steps=list(range(STEPS)))


@pytest.mark.parametrize(
    "preset,parallel",
    [("flux2-tiny", {"pipefusion_degree": 4, "num_patches": 3}),  # a rank holding double and single blocks
     ("flux2-klein-tiny", {"pipefusion_degree": 4, "num_patches": 3}),
     ("flux2-klein-tiny", {"pipefusion_degree": 2, "cfg_degree": 2})],
    ids=["dev-pp4", "klein-pp4", "klein-cfg2_pp2"],
)  # fmt: skip
def test_every_argument_honoured(world4, folders, references, preset, parallel):
    calls = honoured_calls(references[preset], klein="klein" in preset)
    if parallel.get("cfg_degree") == 2:  # a call without guidance has no batch to split: refused (test_mmdit.py)
        calls.pop("no_guidance")
    family = "flux2-klein" if "klein" in preset else "flux2"
    results = world4.run_ok(run_calls, folders[preset], {**parallel, **EXACT}, [{**BASE, **c} for c in calls.values()],
                            family=family, timeout=600)  # fmt: skip
    check_against_diffusers(results, calls, references[preset])


def test_refusals_name_the_argument_on_every_rank(world4, folders):
    image = np.zeros((64, 64, 3), dtype=np.uint8)
    dev = [{**BASE, "image": image}, {**BASE, "attention_kwargs": {"scale": 0.5}},
           {**BASE, "caption_upsample_temperature": 0.7}, {**BASE, "height": 120}]  # fmt: skip
    results = world4.run_ok(run_calls, folders["flux2-tiny"], {"pipefusion_degree": 4, **EXACT}, dev, family="flux2",
                            timeout=300)  # fmt: skip
    for rank_results in results:  # the same error on every rank, before any communication
        assert [(r["kind"], r["message"]) for r in rank_results] == [(r["kind"], r["message"]) for r in results[0]]
    messages = [r["message"] for r in results[0]]
    assert messages[0].startswith("image is not supported by PipeFusion (reference images append their tokens")
    assert messages[1].startswith("attention_kwargs is not supported by PipeFusion")
    assert messages[2].startswith("caption_upsample_temperature is not supported by PipeFusion")
    assert messages[3].startswith("generation.height: must be a positive multiple of 16 pixels")
    neg = torch.zeros(1, 300, 48)
    klein = [{**BASE, "prompt": None, "prompt_embeds": torch.zeros(1, 512, 48), "negative_prompt_embeds": neg}]
    results = world4.run_ok(run_calls, folders["flux2-klein-tiny"], {"pipefusion_degree": 4, **EXACT}, klein,
                            family="flux2-klein", timeout=300)  # fmt: skip
    assert {r[0]["message"] for r in results} == {"prompt_embeds (1, 512, 48) and negative_prompt_embeds (1, 300, 48) "
                                                  "must have the same shape"}  # fmt: skip
    results = world4.run_ok(run_calls, folders["flux2-tiny"], {"pipefusion_degree": 2, "cfg_degree": 2}, [BASE],
                            family="flux2", timeout=300)  # fmt: skip
    assert {r[0]["message"] for r in results} == {
        "parallel.cfg_degree must be 1 for Flux2Pipeline: FLUX.2 [dev] embeds guidance_scale and has no "
        "classifier-free-guidance batch to split (got 2)"
    }


def test_each_rank_loads_only_its_blocks_and_the_modulation_they_use(world4, folders):
    """pp4 over 2 double + 3 single blocks (linear: 0-1 | 2 | 3 | 4): every parameter of the folder's transformer is
    on some rank; a block's on its rank only; x_embedder on the first rank, norm_out and proj_out on the last; the
    double blocks' shared modulation only on the rank with double blocks, the single blocks' on the others; the
    timestep, guidance and text embedders on every rank (each computes its own conditioning). ``xfuse plan``'s
    per-rank weights are those bytes exactly."""
    whole = Flux2Transformer2DModel.from_pretrained(folders["flux2-tiny"], subfolder="transformer")
    sizes = {name: p.numel() for name, p in whole.named_parameters()}
    per_rank = world4.run_ok(loaded_share, folders["flux2-tiny"], {"pipefusion_degree": 4}, "flux2", timeout=300)
    assert [blocks for _, blocks in per_rank] == [[0, 1], [2], [3], [4]]
    everywhere = ("time_guidance_embed.", "context_embedder.")
    for rank, (params, blocks) in enumerate(per_rank):
        assert all(sizes[name] == count for name, count in params.items())
        block_names = {f"transformer_blocks.{b}." if b < 2 else f"single_transformer_blocks.{b - 2}." for b in blocks}
        expected = {name for name in sizes if any(name.startswith(prefix) for prefix in block_names | set(everywhere))}
        expected |= {name for name in sizes if name.startswith("x_embedder.")} if rank == 0 else set()
        expected |= {name for name in sizes if name.startswith(("norm_out.", "proj_out."))} if rank == 3 else set()
        modulation = "double_stream_modulation_" if rank == 0 else "single_stream_modulation."
        expected |= {name for name in sizes if name.startswith(modulation)}
        assert set(params) == expected, rank
    assert set().union(*(params for params, _ in per_rank)) == set(sizes)
    # xfuse plan's per-rank weights (xfuse.perf.memory, a weightless model) are exactly what the ranks loaded
    config = config_from_dict({"model": "flux2-tiny", "parallel": {"pipefusion_degree": 4}})
    planned = rank_memory("flux2-tiny", workload(config), config.parallel, torch.float32)
    assert [m.param_bytes for m in planned] == [4 * sum(params.values()) for params, _ in per_rank]


def test_from_pipe_equals_diffusers_and_refuses_another_family(world4, references):
    results = world4.run_ok(from_pipe_call, {"pipefusion_degree": 4, **EXACT}, BASE, timeout=300)
    assert all("takes a Flux2Pipeline" in refused for refused, _ in results)
    assert all(images is None for _, images in results[1:])
    assert np.abs(results[0][1] - references["flux2-tiny"](BASE)[0]).max() <= 1e-4


def split_calls(reference, klein: bool) -> dict:
    with torch.no_grad():
        emb, _ = reference.pipe.encode_prompt("a red house", device="cpu")
    calls = {
        "base": {},
        "batch_and_images": dict(prompt=["a red house", "a cat"], num_images_per_prompt=2),
        # layers 3, 8 and 27 of the stack live on three different ranks of a pp4 split
        "text_encoder_out_layers": dict(text_encoder_out_layers=(3, 8, 27)),
        "max_sequence_length": dict(max_sequence_length=300),
        "prompt_embeds": dict(prompt=None, prompt_embeds=emb),  # no text-encoder call: the group's ranks just go on
    }
    if klein:  # classifier-free guidance: two encodes per request
        calls["no_guidance"] = dict(guidance_scale=1.0)
    return calls


@pytest.mark.parametrize(
    "preset,parallel",
    [("flux2-tiny", {"pipefusion_degree": 4, "num_patches": 3}),
     ("flux2-klein-tiny", {"pipefusion_degree": 4}),
     ("flux2-klein-tiny", {"pipefusion_degree": 2, "cfg_degree": 2}),  # the text group: ranks 0 and 1
     ("flux2-tiny", {"pipefusion_degree": 2, "ulysses_degree": 2})],  # the text group: ranks 0 and 2
    ids=["dev-pp4", "klein-pp4", "klein-cfg2_pp2", "dev-pp2_ulysses2"],
)  # fmt: skip
def test_split_text_encoder_equals_diffusers(world4, folders, references, preset, parallel):
    klein = "klein" in preset
    calls = split_calls(references[preset], klein)
    if parallel.get("cfg_degree") == 2:
        calls.pop("no_guidance")
    family = "flux2-klein" if klein else "flux2"
    results = world4.run_ok(run_calls, folders[preset], {**parallel, **EXACT, "text_encoder": "split"},
                            [{**BASE, **c} for c in calls.values()], family=family, timeout=600)  # fmt: skip
    check_against_diffusers(results, calls, references[preset])


@pytest.mark.parametrize("preset,family,layers", [("flux2-tiny", "flux2", 30), ("flux2-klein-tiny", "flux2-klein", 27)])
def test_each_rank_holds_its_layers_as_the_plan_counts(world4, folders, preset, family, layers):
    """pp4 split: rank r runs layers ``layer_share(L, r, 4)`` and holds exactly what ``xfuse plan`` counts for it (rank
    0 the embeddings, head and vision tower besides its layers; the others their layers and the final norm); with
    ``rank0`` (the default on a CPU) rank 0 holds the whole encoder and the others nothing."""
    parallel = {"pipefusion_degree": 4, "text_encoder": "split"}
    held = world4.run_ok(text_encoder_share, folders[preset], parallel, family, timeout=300)
    assert [owned for _, owned, _ in held] == [list(layer_share(layers, r, 4)) for r in range(4)]
    assert {placement for *_, placement in held} == {"split"}
    config = config_from_dict({"model": preset, "parallel": parallel})
    planned = text_encoder_bytes(preset, "split", 4, torch.float32)
    assert [4 * count for count, _, _ in held] == [planned[r] for r in range(4)]
    assert planned[0] > planned[1] > 0 and config.parallel.text_encoder == "split"
    whole = world4.run_ok(text_encoder_share, folders[preset], {"pipefusion_degree": 4}, family, timeout=300)
    assert [(count > 0, owned, placement) for count, owned, placement in whole] == [
        (True, None, "rank0"), (False, None, "rank0"), (False, None, "rank0"), (False, None, "rank0")
    ]  # fmt: skip
    assert 4 * whole[0][0] == text_encoder_bytes(preset, "rank0", 4, torch.float32)[0]
