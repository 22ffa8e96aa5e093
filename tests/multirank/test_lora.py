"""LoRA on sharded SD3 and FLUX pipelines (``xfuse/pipelines/lora.py``): the LoRA API of diffusers' loaders on
xfuse's pipeline classes against diffusers' own pipelines with the same LoRA files, each rank keeping its share.

The LoRA files are built here with PEFT on the tiny presets and saved with diffusers' ``save_lora_weights`` (rank 4
with ``lora_alpha`` 8 from the file's metadata, and rank 2 with alpha 2; a third also adapts the CLIP text encoder,
which only rank 0 runs). 128 x 96 px, 3 steps.
"""

import numpy as np
import pytest
import torch

from tests.support.lora_fns import (
    expert_steps,
    lora_steps,
    refused_lora,
    save_lora,
    xfuse_expert_steps,
    xfuse_lora_steps,
)
from tests.support.mmdit_fns import NEGATIVE, PROMPT, grid_of, prepare_inputs, tiny
from tests.support.pipefusion_oracle import pipefusion_reference
from tests.support.world import World
from xfuse.families.registry import load_pipeline, model_spec

HEIGHT, WIDTH, STEPS = 128, 96, 3
FAMILY = {"sd3-tiny": "sd3", "flux-tiny": "flux"}


def call_of(preset, cfg=2.0):
    """The call whose inputs ``mmdit_fns.prepare_inputs`` builds for the oracle (SD3: guidance; FLUX: true CFG)."""
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS,
                max_sequence_length=16, output_type="latent", seed=0)  # fmt: skip
    return call | ({"true_cfg_scale": cfg} if preset.startswith("flux") else {"guidance_scale": cfg})


@pytest.fixture(scope="module")
def world2():
    with World(2, start_timeout=240) as w:
        yield w


@pytest.fixture(scope="module")
def world4():
    with World(4, start_timeout=240) as w:
        yield w


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """preset -> (pipeline folder, LoRA a, LoRA b); "text": an SD3 LoRA that also adapts the CLIP text encoder."""
    out = {}
    for preset in FAMILY:
        root = tmp_path_factory.mktemp(preset)
        pipe = load_pipeline(preset)
        folder = model_spec(preset).save_preset_pipeline(root / "pipe", preset)
        lora_a = save_lora(pipe, root / "a", seed=1, rank=4, alpha=8)
        lora_b = save_lora(pipe, root / "b", seed=2, rank=2, alpha=2)
        out[preset] = (str(folder), lora_a, lora_b)
    out["text"] = save_lora(load_pipeline("sd3-tiny"), tmp_path_factory.mktemp("text") / "te", seed=3, rank=4, alpha=4,
                            text_encoder=True)  # fmt: skip
    return out


_DIFFUSERS = {}


def diffusers_steps(preset, files):
    """``lora_steps`` on diffusers' own pipeline from the same folder and files."""
    if preset not in _DIFFUSERS:
        import diffusers

        folder, lora_a, lora_b = files[preset]
        pipe = getattr(diffusers, model_spec(preset).diffusers_pipeline).from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        _DIFFUSERS[preset] = lora_steps(pipe, call_of(preset), lora_a, lora_b)
    return _DIFFUSERS[preset]


def expected_share(preset, lora_files, blocks, rank):
    """Elements of the files' weights a rank keeps: its blocks' (FLUX: global index past the double blocks is a
    single block), and the text encoder's on global rank 0 only."""
    from safetensors.torch import load_file

    config = tiny(preset).transformer.config
    doubles = config.num_layers
    prefixes = []
    for b in blocks:
        if preset.startswith("flux") and b >= doubles:
            prefixes.append(f"transformer.single_transformer_blocks.{b - doubles}.")
        else:
            prefixes.append(f"transformer.transformer_blocks.{b}.")
    total = 0
    for path in lora_files:
        for key, tensor in load_file(f"{path}/pytorch_lora_weights.safetensors").items():
            if any(key.startswith(p) for p in prefixes) or (rank == 0 and key.startswith("text_encoder.")):
                total += tensor.numel()
    return total


LAYOUTS = {
    "pp2": {"pipefusion_degree": 2},
    "pp4": {"pipefusion_degree": 4},
    "cfg2xpp2": {"cfg_degree": 2, "pipefusion_degree": 2},
    "pp2xulysses2": {"pipefusion_degree": 2, "ulysses_degree": 2},  # the ranks of a stage share its blocks' adapters
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("preset", FAMILY)
def test_exact_mode_with_loras_equals_diffusers(request, files, preset, layout):
    """Load a, load b, both with weights 0.7 / 0.4, fuse, unfuse, disable, enable with a deleted, unload: after each,
    xfuse in exact mode equals diffusers with the same LoRA state (max abs ≤ 1e-4), reports the same active adapters
    on every rank, and each rank holds exactly its share of the adapters' weights (its blocks'; the text encoders'
    would be rank 0's)."""
    folder, lora_a, lora_b = files[preset]
    parallel = {**LAYOUTS[layout], "warmup_steps": STEPS}
    world = request.getfixturevalue("world2" if layout == "pp2" else "world4")
    results = world.run_ok(xfuse_lora_steps, folder, FAMILY[preset], parallel, call_of(preset), lora_a, lora_b)
    expected = diffusers_steps(preset, files)
    for (step, images, active), (ref_step, ref_images, ref_active) in zip(results[0]["steps"], expected, strict=True):
        assert step == ref_step and active == ref_active, (step, active, ref_active)
        assert np.abs(images - ref_images).max() <= 1e-4, step
    # a, b, a + b and the base model (disabled) differ; fusing and unfusing do not change the images; with a deleted b
    # runs alone; b fused then unloaded keeps b (diffusers' own behaviour, and a fuse that did nothing would lose it)
    image = {step: images for step, images, _ in expected}
    differs = lambda x, y: np.abs(image[x] - image[y]).max() > 1e-3  # noqa: E731
    assert differs("a", "b") and differs("b", "a 0.7 + b 0.4") and differs("a", "disabled")
    assert not differs("a 0.7 + b 0.4", "fused") and not differs("fused", "unfused")
    assert differs("a deleted", "disabled") and not differs("b fused", "a deleted")
    assert not differs("b fused, unloaded", "b fused")
    for r in results:
        assert all(step[2] == ref[2] for step, ref in zip(r["steps"], expected, strict=True))  # every rank agrees
        held_a = expected_share(preset, [lora_a], r["blocks"], r["rank"])
        held_ab = expected_share(preset, [lora_a, lora_b], r["blocks"], r["rank"])
        assert r["held"] == [held_a, held_ab] and r["final"] == 0, (r["rank"], r["held"], held_a, held_ab)
    num_blocks = model_spec(preset).num_blocks(tiny(preset).transformer.config)
    whole = expected_share(preset, [lora_a, lora_b], range(num_blocks), 0)
    group = [r for r in results if r["cfg_rank"] == 0 and r["sp_rank"] == 0]  # one pipeline group: shares add up
    assert sum(r["held"][1] for r in group) == whole


@pytest.mark.parametrize("preset", FAMILY)
def test_pipelined_with_loras_equals_the_oracle(world2, files, preset):
    """pp2, M = 3, warm-up 1, adapters a 0.7 + b 0.4 active: the pipelined result equals the oracle's (diffusers'
    forward with the same adapters loaded, stale K/V) within 1e-5, and differs from it without the adapters."""
    import diffusers

    folder, lora_a, lora_b = files[preset]
    parallel = {"pipefusion_degree": 2, "num_patches": 3, "warmup_steps": 1}
    results = world2.run_ok(xfuse_lora_steps, folder, FAMILY[preset], parallel, call_of(preset), lora_a, lora_b)
    (step, piped, _) = results[0]["steps"][2]
    assert step == "a 0.7 + b 0.4"
    pipe = getattr(diffusers, model_spec(preset).diffusers_pipeline).from_pretrained(folder)
    pipe.load_lora_weights(lora_a, adapter_name="a")
    pipe.load_lora_weights(lora_b, adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.4])
    inputs = prepare_inputs(pipe, height=HEIGHT, width=WIDTH, steps=STEPS, cfg=2.0)
    spec = model_spec(preset)
    text_tokens = inputs["prompt_embeds"].shape[1]
    tokens = [band.num_tokens for band in grid_of(spec, pipe, HEIGHT, WIDTH, 3, text_tokens)]  # cut by cost, as xfuse
    expected = pipefusion_reference(pipe, inputs, height=HEIGHT, width=WIDTH, num_patches=3, warmup=1,
                                    token_counts=tokens)  # fmt: skip
    expected = expected.numpy()
    scale = np.abs(expected).max()
    assert np.abs(piped - expected).max() / scale <= 1e-5
    (step, disabled, _) = results[0]["steps"][5]
    assert step == "disabled"
    assert np.abs(disabled - expected).max() / scale > 1e-3  # without the adapters the oracle is far


# --- Wan (WanLoraLoaderMixin): one transformer, and Wan 2.2's two experts ------------------------------------------

WAN_CALL = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=64, width=96, num_frames=9, num_inference_steps=4,
                guidance_scale=2.0, max_sequence_length=16, output_type="latent", seed=0)  # fmt: skip


@pytest.fixture(scope="module")
def wan_files(tmp_path_factory):
    """preset -> (pipeline folder, LoRA a, LoRA b) for wan-tiny and wan2.2-tiny."""
    out = {}
    for preset in ("wan-tiny", "wan2.2-tiny"):
        root = tmp_path_factory.mktemp(preset)
        pipe = load_pipeline(preset)
        folder = model_spec(preset).save_preset_pipeline(root / "pipe", preset)
        out[preset] = (str(folder), save_lora(pipe, root / "a", seed=1, rank=4, alpha=8),
                       save_lora(pipe, root / "b", seed=2, rank=2, alpha=2))  # fmt: skip
    return out


def diffusers_pipe(preset, folder):
    import diffusers

    pipe = getattr(diffusers, model_spec(preset).diffusers_pipeline).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("layout", ["pp2", "pp4"])
def test_wan_exact_mode_with_loras_equals_diffusers(request, wan_files, layout):
    """Wan 2.1 (wan-tiny, 4 blocks): the same LoRA sequence as SD3 and FLUX equals diffusers' WanPipeline."""
    folder, lora_a, lora_b = wan_files["wan-tiny"]
    world = request.getfixturevalue("world2" if layout == "pp2" else "world4")
    parallel = {**LAYOUTS[layout], "warmup_steps": WAN_CALL["num_inference_steps"]}
    results = world.run_ok(xfuse_lora_steps, folder, "wan", parallel, WAN_CALL, lora_a, lora_b)
    expected = lora_steps(diffusers_pipe("wan-tiny", folder), WAN_CALL, lora_a, lora_b)
    for (step, images, active), (_, ref_images, ref_active) in zip(results[0]["steps"], expected, strict=True):
        assert active == ref_active, (step, active, ref_active)
        assert np.abs(images - ref_images).max() <= 1e-4 * max(1.0, float(np.abs(ref_images).max())), step
    assert np.abs(expected[0][1] - expected[5][1]).max() > 1e-3  # the adapter changes the clip (5: disabled)


def test_wan_second_expert_takes_a_lora_with_load_into_transformer_2(world2, wan_files):
    """Wan 2.2's two experts (wan2.2-tiny, pp2 exact): ``a`` in the high-noise expert, ``b`` in the low-noise one
    (``load_into_transformer_2``), then both weighted, equal diffusers' after each step; every rank lists b under
    transformer_2."""
    folder, lora_a, lora_b = wan_files["wan2.2-tiny"]
    parallel = {"pipefusion_degree": 2, "warmup_steps": WAN_CALL["num_inference_steps"]}
    results = world2.run_ok(xfuse_expert_steps, folder, parallel, WAN_CALL, lora_a, lora_b)
    expected = expert_steps(diffusers_pipe("wan2.2-tiny", folder), WAN_CALL, lora_a, lora_b)
    for (step, images, listed), (_, ref_images, ref_listed) in zip(results[0], expected, strict=True):
        assert listed == ref_listed, (step, listed, ref_listed)
        assert np.abs(images - ref_images).max() <= 1e-4 * max(1.0, float(np.abs(ref_images).max())), step
    assert all(r[-1][2] == {"transformer": ["a"], "transformer_2": ["b"]} for r in results)
    assert np.abs(expected[1][1] - expected[0][1]).max() > 1e-3  # b in the second expert changes the clip


def test_a_bad_lora_file_is_refused_alike_on_every_rank(world4, files, tmp_path):
    """Half a pair missing, a wrong rank, and FLUX's LoRA on SD3: every rank raises the same ValueError naming the key
    or module, before any weight changes (no adapter weights held after), and the world still runs a call."""
    from safetensors.torch import load_file, save_file

    folder, lora_a, _ = files["sd3-tiny"]
    weights = load_file(f"{lora_a}/pytorch_lora_weights.safetensors")
    missing = {k: v for k, v in weights.items() if "transformer_blocks.3.attn.to_k.lora_B" not in k}
    wrong_rank = dict(weights)
    key = next(k for k in weights if k.endswith("transformer_blocks.1.attn.to_q.lora_A.weight"))
    wrong_rank[key] = torch.zeros(3, weights[key].shape[1])
    bad = []
    for name, state in (("missing", missing), ("wrong_rank", wrong_rank)):
        (tmp_path / name).mkdir()
        save_file(state, str(tmp_path / name / "pytorch_lora_weights.safetensors"))
        bad.append(str(tmp_path / name))
    bad.append(files["flux-tiny"][2])  # FLUX's adapter b
    results = world4.run_ok(refused_lora, folder, "sd3", {"pipefusion_degree": 4}, bad)
    refusals = [r[0] for r in results]
    assert all(r == refusals[0] for r in refusals)  # the same on every rank
    (missing_err, rank_err, family_err) = refusals[0]
    assert missing_err == ("ValueError", "LoRA weights of transformer.transformer_blocks.3.attn.to_k: the down "
                           "projection is there, its other half is missing")  # fmt: skip
    assert rank_err[0] == "ValueError" and "transformer.transformer_blocks.1.attn.to_q: down (3, " in rank_err[1]
    assert family_err[0] == "ValueError" and "has no linear layer 'single_transformer_blocks." in family_err[1]
    assert all(r[1] and r[2] == 0 for r in results)


def test_a_text_encoder_lora_goes_to_rank_0_or_is_refused_alike(world4, files):
    """A LoRA that also adapts the CLIP text encoder: transformers loads it only with a PEFT it accepts. Where it does,
    rank 0 (which runs the text encoders) holds those weights and no other rank does; where it does not (this
    machine's registry has no PEFT new enough for transformers 5), every rank refuses the file with the same message
    before any weight changes, where rank 0 alone would fail otherwise."""
    from transformers.integrations.peft import MIN_PEFT_VERSION
    from transformers.utils.peft_utils import check_peft_version

    try:
        check_peft_version(min_version=MIN_PEFT_VERSION)
        supported = True
    except ValueError:
        supported = False
    results = world4.run_ok(refused_lora, files["sd3-tiny"][0], "sd3", {"pipefusion_degree": 4}, [files["text"]])
    ((outcome, message),) = results[0][0]
    if supported:
        assert outcome == "loaded" and all(r[0] == [("loaded", "")] for r in results)
        assert results[0][2] > max(r[2] for r in results[1:])  # rank 0 also holds the text encoder's weights
    else:
        assert outcome == "ValueError" and all(r[0] == results[0][0] for r in results)
        assert message.startswith(f"the LoRA adapts text_encoder, which transformers loads only with PEFT >= "
                                  f"{MIN_PEFT_VERSION}")  # fmt: skip
        assert all(r[2] == 0 for r in results)
