"""``xfuse.pipelines.lora_share``: a LoRA state dict checked against a model's linear layers (every refusal names
the key or module), and the share a rank keeps."""

import pytest
import torch
from torch import nn

from xfuse.pipelines.lora_share import check_lora, linear_shapes, meta_linear_shapes, share


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q, self.to_out = nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 8))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])


TARGETS = {"transformer": linear_shapes(Model()), "text_encoder": {"q_proj": (4, 4)}}


def pair(module, rank=2, fan_in=8, fan_out=16, component="transformer", older=False):
    down, up = ("lora.down", "lora.up") if older else ("lora_A", "lora_B")
    return {
        f"{component}.{module}.{down}.weight": torch.zeros(rank, fan_in),
        f"{component}.{module}.{up}.weight": torch.zeros(fan_out, rank),
    }


def test_the_model_description_names_every_linear_layer_and_meta_builds_none():
    assert TARGETS["transformer"] == {
        "blocks.0.to_q": (8, 16), "blocks.0.to_out.0": (16, 8), "blocks.1.to_q": (8, 16), "blocks.1.to_out.0": (16, 8)
    }  # fmt: skip
    assert meta_linear_shapes(Model) == TARGETS["transformer"]


def test_a_good_file_and_the_share_a_rank_keeps():
    weights = pair("blocks.0.to_q") | pair("blocks.1.to_out.0", fan_in=16, fan_out=8, older=True)
    weights |= pair("q_proj", fan_in=4, fan_out=4, component="text_encoder")
    adapted = check_lora(weights, TARGETS, "Model")
    assert adapted == {"transformer": {"blocks.0.to_q", "blocks.1.to_out.0"}, "text_encoder": {"q_proj"}}
    mine = share(weights, lambda component, module: component == "transformer" and module.startswith("blocks.1."))
    assert sorted(mine) == [
        "transformer.blocks.1.to_out.0.lora.down.weight",
        "transformer.blocks.1.to_out.0.lora.up.weight",
    ]


Q = "transformer.blocks.0.to_q"
BAD = [
    ({}, "the LoRA file has no weights"),
    ({f"{Q}.weight": torch.zeros(16, 8)}, f"LoRA key '{Q}.weight' is not a LoRA weight"),
    ({f"{Q}.lora_magnitude_vector": torch.zeros(16)}, "DoRA, biases and Control-LoRA norms"),
    (pair("q_proj", component="text_encoder_3"), "loads LoRA into text_encoder, transformer, not 'text_encoder_3'"),
    (pair("single_blocks.0.to_q"), "Model's transformer has no linear layer 'single_blocks.0.to_q'"),
    ({f"{Q}.lora_A.weight": torch.zeros(2, 8)}, f"LoRA weights of {Q}: the down projection is there, its other half"),
    (pair("blocks.0.to_q", fan_in=9), f"{Q}: down (2, 9) and up (16, 2) do not fit the layer (8 -> 16)"),
    (pair("blocks.0.to_q") | {f"{Q}.lora_B.weight": torch.zeros(16, 3)}, "down (2, 8) and up (16, 3)"),
]


@pytest.mark.parametrize("weights,says", BAD)
def test_a_bad_file_is_refused_naming_the_key(weights, says):
    with pytest.raises(ValueError) as e:
        check_lora(weights, TARGETS, "Model")
    assert says in str(e.value)
