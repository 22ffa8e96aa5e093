"""Which text encoders ``parallel.text_encoder: split`` splits and how (``xfuse.parallel.text_encoder_split``); the
split itself runs on real worlds in ``tests/multirank/test_flux2.py``."""

import pytest
import torch
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from xfuse.families.flux2.presets import save_preset_pipeline
from xfuse.families.registry import load_pipeline, text_encoder_configs
from xfuse.parallel.text_encoder_split import SplitTextEncoder, layer_share, shard_text_encoder, splittable
from xfuse.perf.memory import text_encoder_bytes


@pytest.mark.parametrize(
    "layers,ranks,shares",
    [(30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]), (27, 2, [(0, 14), (14, 27)]),
     (40, 8, [(5 * i, 5 * i + 5) for i in range(8)])],
)  # fmt: skip
def test_layer_shares_are_consecutive_and_even(layers, ranks, shares):
    assert [(r.start, r.stop) for r in (layer_share(layers, i, ranks) for i in range(ranks))] == shares


def test_decoder_only_language_models_split_and_clip_and_t5_stay_whole():
    """FLUX.2's Mistral 3 and Qwen3 split; CLIP's encoder takes no input_ids and T5's blocks return tuples, so those
    stay whole on rank 0."""
    assert splittable(load_pipeline("flux2-tiny").text_encoder)
    assert splittable(load_pipeline("flux2-klein-tiny").text_encoder)
    clip = CLIPTextModel(
        CLIPTextConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    )
    t5 = T5EncoderModel(T5Config(d_model=16, d_ff=32, d_kv=8, num_layers=2, num_heads=2, vocab_size=64))
    assert not splittable(clip) and not splittable(t5)
    with pytest.raises(ValueError, match="T5EncoderModel cannot be split by layers"):
        shard_text_encoder(t5, 0, 2)


def test_a_rank_keeps_its_layers_and_shells_of_the_others():
    """Rank 1 of 3 over klein's 27 Qwen3 layers: layers 9-17 with their weights; the others are weightless shells of
    the same class keeping their per-layer attributes; the embeddings (tied to the head) are emptied."""
    encoder = load_pipeline("flux2-klein-tiny").text_encoder
    layers = encoder.model.layers

    def attributes(layer):  # what a layer carries besides modules and weights (the model's forward may read them)
        return {k: v for k, v in vars(layer).items() if not k.startswith("_") and k != "forward"}

    before = [attributes(layer) for layer in layers]
    assert any(before[0])
    owned = shard_text_encoder(encoder, 1, 3)
    assert owned == range(9, 18)
    assert [type(layer).__name__ for layer in layers] == ["Qwen3DecoderLayer"] * 27
    assert [attributes(layer) for layer in layers] == before
    assert [sum(p.numel() for p in layer.parameters()) > 0 for layer in layers] == [i in owned for i in range(27)]
    assert encoder.model.embed_tokens.weight.numel() == 0 and encoder.model.norm.weight.numel() > 0
    hidden = torch.randn(1, 3, 16)
    assert layers[0](hidden) is hidden  # a shell hands on what it is given


def test_a_split_encoder_called_outside_a_pipeline_call_says_how_to_use_it():
    """Rank 0's split encoder runs inside the pipeline's __call__, where the group listens; called directly it
    refuses before sending anything (the other ranks would never answer)."""
    pipe = load_pipeline("flux2-klein-tiny")
    SplitTextEncoder(pipe.text_encoder, name="text_encoder", index=0, ranks=[0, 1], channels=None, group=None,
                     device=torch.device("cpu"))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"text_encoder is split over ranks \[0, 1\] \(parallel.text_encoder: "
                                           r"split\): it runs inside the pipeline's __call__ only"):  # fmt: skip
        pipe.encode_prompt("a cat", device="cpu")


def test_a_folder_s_text_encoders_are_read_from_its_config(tmp_path):
    folder = save_preset_pipeline(tmp_path / "klein", "flux2-klein-tiny")
    (config,) = text_encoder_configs(folder).values()
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["num_hidden_layers"] == 27
    assert text_encoder_bytes(folder, "split", 2, torch.float32) == text_encoder_bytes(
        "flux2-klein-tiny", "split", 2, torch.float32
    )
