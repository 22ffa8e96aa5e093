"""The memory side of ``xfuse plan --auto`` (``xfuse.perf.memory``): each layout's text encoders placed by
``parallel.text_encoder`` (``auto``: rank 0, split over the pipeline group, offloaded: the first that fits) and the
layouts whose busiest rank would not hold its transformer share, stale K/V, text encoders and VAE on the device
dropped, naming the rank and how much it needs of what."""

import re

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

from xfuse.config import config_from_dict
from xfuse.families.registry import text_encoder_configs, transformer_config
from xfuse.perf.hardware import DEVICES
from xfuse.perf.memory import GIB, place_text, text_encoder_bytes
from xfuse.perf.model import machine
from xfuse.perf.planner import format_ranking, rank_layouts, workload

NEEDS = re.compile(r"does not fit: pipeline rank (\d+) needs ([\d.]+) GiB \(transformer ([\d.]+), stale K/V ([\d.]+), "
                   r"text encoders ([\d.]+), VAE ([\d.]+), activations ([\d.]+)\) of ([\d.]+) GiB; text encoders "
                   r"(.*)$")  # fmt: skip


def _config(model: str, **parallel):
    return config_from_dict({"model": model, "parallel": parallel,
                             "generation": {"height": 1024, "width": 1024, "num_inference_steps": 20}})  # fmt: skip


def _mistral_small():
    """Mistral Small 3.x, FLUX.2 [dev]'s text encoder, built here from its published shape (not from the preset)."""
    text = dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                tie_word_embeddings=False)  # fmt: skip
    vision = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14)  # fmt: skip
    config = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=2,
                            multimodal_projector_bias=False, tie_word_embeddings=False)  # fmt: skip
    with torch.device("meta"):
        return Mistral3ForConditionalGeneration(config)


def _reasons(refused: list[str], layout: str) -> tuple:
    (reason,) = [r for r in refused if r.startswith(f"{layout}: ")]
    return NEEDS.search(reason).groups()


def test_flux2_dev_on_four_l40s_splits_the_text_encoder_and_drops_what_does_not_fit():
    """FLUX.2 [dev]: a 32 B transformer (60 GiB in bf16) and a 24 B text encoder (45 GiB). On four 48 GB L40s,
    PipeFusion 4 fits only with the text encoder split over its four ranks (whole on rank 0 it needs 67 GiB there)
    and is chosen; Ulysses 4 and Ring 4 keep the whole transformer on every rank and fit with no placement (the
    least: offloaded, one module at a time, the 1.25 GiB embedding table). Every figure is counted independently
    here."""
    config, where = _config("flux2-dev"), machine("l40", "pcie", 4)
    ranked, refused = rank_layouts(config, 4, where)
    assert ranked[0].name == "pipefusion 4" and ranked[0].placed.text == "split"
    assert {"ulysses 4", "ring 4"}.isdisjoint(r.name for r in ranked)
    with torch.device("meta"):
        transformer = sum(p.numel() for p in Flux2Transformer2DModel(**transformer_config("flux2-dev")).parameters())
    encoder = _mistral_small()
    assert sum(p.numel() for p in encoder.parameters()) == pytest.approx(24.0e9, rel=0.005)  # the release's 24 B
    embedding = encoder.get_input_embeddings().weight.numel()
    for layout in ("ulysses 4", "ring 4", "ulysses 2 x ring 2"):
        rank, needs, weights, kv, text, vae, made, device, how = _reasons(refused, layout)
        assert rank == "0" and float(device) == pytest.approx(DEVICES["l40"].memory / GIB, abs=0.05)
        assert float(weights) == pytest.approx(2 * transformer / GIB, abs=0.05)  # bf16
        assert float(text) == pytest.approx(2 * embedding / GIB, abs=0.051)  # printed to 0.1
        assert (
            how == "offloaded (rank 0 streams one module at a time) (parallel.text_encoder auto: none fits; the "
            "placement needing least)"
        )
        parts = float(weights) + float(kv) + float(text) + float(vae) + float(made)
        assert float(needs) == pytest.approx(parts, abs=0.25) and float(needs) > float(device)
        assert 0.1 < float(made) < 2  # a 1024 px request's (xfuse.perf.activations; tests/multirank/test_memory.py)
    for r in ranked:
        assert r.placed.fits and r.placed.busiest.total <= DEVICES["l40"].memory, r.name
    # with the text encoder kept on rank 0, PipeFusion 4 does not fit: rank 0 holds all 24 B besides its blocks
    ranked, refused = rank_layouts(_config("flux2-dev", text_encoder="rank0"), 4, where)
    assert ranked == []
    rank, needs, weights, kv, text, vae, made, device, how = _reasons(refused, "pipefusion 4")
    assert float(text) == pytest.approx(2 * sum(p.numel() for p in encoder.parameters()) / GIB, abs=0.05)
    assert how == "whole on rank 0 (parallel.text_encoder: rank0)"
    text = format_ranking(config, 4, where)
    assert "ring 4: does not fit: pipeline rank 0 needs" in text and "the request's activations" in text


def test_flux2_dev_on_eight_rtx4090s_needs_eight_pipeline_stages():
    """On 24 GB cards only PipeFusion 8 fits, with the text encoder offloaded. Split over the 8 ranks, rank 0 would
    need 24.2 GiB (its blocks, its eighth of the encoder's layers beside the embedding table, and a 1024 px
    request's activations, 1.0 GiB); PipeFusion 4 x SP 2 keeps a quarter of the transformer (21.5 GiB) and needs
    24.3 GiB with the encoder offloaded; PipeFusion 2 and less keep 30 GiB or more of the transformer."""
    config, where = _config("flux2-dev"), machine("rtx4090", "pcie", 8)
    ranked, refused = rank_layouts(config, 8, where)
    assert [(r.name, r.placed.text) for r in ranked] == [("pipefusion 8", "offload")]
    assert all(r.placed.busiest.total <= DEVICES["rtx4090"].memory for r in ranked)
    for reason in refused:
        assert "does not fit" in reason and not reason.startswith("pipefusion 8")
    for layout in ("pipefusion 4 x ulysses 2", "pipefusion 4 x ring 2"):
        rank, needs, weights, kv, text, vae, made, device, how = _reasons(refused, layout)
        assert float(device) < float(needs) < float(device) + 0.5 and 0.1 < float(made) < 2
    split = _config("flux2-dev", pipefusion_degree=8, text_encoder="split")
    placed = place_text("flux2-dev", workload(split), split.parallel, torch.bfloat16, DEVICES["rtx4090"].memory)
    assert not placed.fits and placed.busiest.pipe_rank == 0
    assert (
        DEVICES["rtx4090"].memory < placed.busiest.total < DEVICES["rtx4090"].memory + placed.busiest.activation_bytes
    )


def test_split_shares_add_up_to_the_encoder_and_each_rank_s_norm():
    """A split keeps every parameter once, plus the final norm on each rank other than 0 (each runs it after its
    layers); rank 0 also keeps the embeddings, the language-model head and the vision tower."""
    encoder = _mistral_small()
    total = sum(p.numel() for p in encoder.parameters())
    for ranks in (2, 4, 8):
        split = text_encoder_bytes("flux2-dev", "split", ranks, torch.bfloat16)
        assert sum(split.values()) == 2 * (total + (ranks - 1) * 5120)
        layer = sum(p.numel() for p in encoder.model.language_model.layers[0].parameters())
        assert split[ranks - 1] == 2 * (40 // ranks * layer + 5120)
    assert text_encoder_bytes("flux2-dev", "rank0", 4, torch.bfloat16) == {0: 2 * total, 1: 0, 2: 0, 3: 0}


def test_auto_keeps_text_encoders_on_rank0_where_they_fit_and_where_memory_is_unknown():
    """FLUX.2 [klein] 4B (8 GiB text encoder) fits whole beside its transformer on an 80 GB H100; the CPU's memory
    is not limited."""
    config = _config("flux2-klein-4b", pipefusion_degree=2)
    work = workload(config)
    assert place_text(config.model, work, config.parallel, torch.bfloat16, DEVICES["h100"].memory).text == "rank0"
    assert place_text(config.model, work, config.parallel, torch.bfloat16, None).text == "rank0"
    assert DEVICES["cpu"].memory is None
    ranked, refused = rank_layouts(_config("flux2-small"), 2, machine("cpu", "gloo", 2))
    assert ranked and not [r for r in refused if "does not fit" in r]


def test_text_encoders_that_cannot_split_stay_whole_on_rank_0():
    """FLUX.1 [dev]'s CLIP-L and T5-XXL (4.76 B: the released shape, counted from its published config) cannot be split
    by layers: ``split`` leaves them whole on rank 0, as ``rank0`` does; ``offload`` keeps T5's largest module, its
    32128 x 4096 embedding table."""
    configs = text_encoder_configs("flux-dev")
    assert [c["architectures"][0] for c in configs.values()] == ["CLIPTextModel", "T5EncoderModel"]
    whole = text_encoder_bytes("flux-dev", "rank0", 4, torch.bfloat16)
    assert text_encoder_bytes("flux-dev", "split", 4, torch.bfloat16) == whole
    assert whole[0] == pytest.approx(2 * (4.762e9 + 0.123e9), rel=1e-3)
    assert text_encoder_bytes("flux-dev", "offload", 4, torch.bfloat16)[0] == 2 * 32128 * 4096


def test_a_model_that_fits_everywhere_loses_no_layout():
    config = _config("flux-dev")  # FLUX.1 [dev]: 12 B, 22 GiB in bf16, fits an L40 whole
    ranked, refused = rank_layouts(config, 4, machine("l40", "pcie", 4))
    assert len(ranked) == 6 and not [r for r in refused if "does not fit" in r]


@pytest.mark.parametrize("preset", ["tiny", "pixart-tiny", "sd3-tiny", "flux-tiny", "wan-tiny", "flux2-tiny"])
def test_the_planned_vae_weights_are_the_built_vae_s(preset):
    """Whatever the VAE's class (``AutoencoderKL``, ``AutoencoderKLWan``, ``AutoencoderKLFlux2``), the plan counts
    exactly the parameters of the VAE the preset builds."""
    from xfuse.families.registry import load_pipeline
    from xfuse.perf.memory import vae_weight_bytes

    vae = load_pipeline(preset).vae
    assert vae_weight_bytes(preset, torch.float32) == 4 * sum(p.numel() for p in vae.parameters()) > 0


def test_an_offloaded_text_encoder_costs_its_copy_from_host_memory_every_request():
    """On four 40 GB A100s FLUX.2 [dev] fits as PipeFusion 4 with the text encoder split, or with two pipeline
    stages and the 44.7 GiB encoder offloaded: those pay its copy over PCIe (25 GB/s) every request, 1.9 s, and rank
    after PipeFusion 4, whose loop alone would be no faster."""
    where = machine("a100-40gb", "nvlink", 4)
    assert where.device.memory == 40960 * 2**20 and machine("a100-80gb", "nvlink", 4).device.name == "A100 SXM 80GB"
    ranked, _ = rank_layouts(_config("flux2-dev"), 4, where)
    assert (ranked[0].name, ranked[0].placed.text) == ("pipefusion 4", "split")
    copy = text_encoder_bytes("flux2-dev", "rank0", 1, torch.bfloat16)[0] / 25e9
    assert copy == pytest.approx(1.92, abs=0.01)
    offloaded = [r for r in ranked if r.placed.text == "offload"]
    assert offloaded and all(r.prediction.outside >= copy for r in offloaded)
    assert min(r.prediction.loop for r in offloaded) <= ranked[0].prediction.loop + 0.01
