"""The released text encoders' configs (the shape-bearing keys of their ``config.json``), for ``xfuse plan``'s memory
of the released-shape presets (``RELEASED_TEXT_ENCODERS`` in each family's ``presets.py``), and the configs of a
built preset's own text encoders.

Parameter counts (transformers' models built from these, weightless): CLIP ViT-L/14's text tower 123 M, OpenCLIP
bigG's 695 M, T5-XXL's encoder 4.76 B, UMT5-XXL's 5.68 B, mT5-XL's 1.67 B, Chinese RoBERTa-wwm-ext-large 352 M,
Mistral Small 3.x 24.01 B (with its Pixtral vision tower), Qwen3-4B 4.02 B, Qwen3-8B 8.19 B, Qwen2.5-VL-7B
8.29 B (with its vision tower).
"""

from __future__ import annotations

from typing import Any

_CLIP = {"model_type": "clip_text_model", "vocab_size": 49408, "max_position_embeddings": 77}
CLIP_L: dict[str, Any] = {**_CLIP, "architectures": ["CLIPTextModel"], "hidden_size": 768, "intermediate_size": 3072,
                          "num_hidden_layers": 12, "num_attention_heads": 12, "projection_dim": 768}  # fmt: skip
CLIP_L_PROJECTION: dict[str, Any] = {**CLIP_L, "architectures": ["CLIPTextModelWithProjection"]}
CLIP_G_PROJECTION: dict[str, Any] = {**_CLIP, "architectures": ["CLIPTextModelWithProjection"], "hidden_size": 1280,
                                     "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
                                     "projection_dim": 1280}  # fmt: skip
_T5 = {"d_kv": 64, "feed_forward_proj": "gated-gelu", "architectures": ["T5EncoderModel"]}
T5_XXL: dict[str, Any] = {**_T5, "model_type": "t5", "d_model": 4096, "d_ff": 10240, "num_heads": 64, "num_layers": 24,
                          "vocab_size": 32128}  # fmt: skip
MT5_XL: dict[str, Any] = {**_T5, "model_type": "mt5", "d_model": 2048, "d_ff": 5120, "num_heads": 32, "num_layers": 24,
                          "vocab_size": 250112}  # fmt: skip
UMT5_XXL: dict[str, Any] = {**T5_XXL, "model_type": "umt5", "architectures": ["UMT5EncoderModel"], "vocab_size": 256384}
CHINESE_ROBERTA_LARGE: dict[str, Any] = {"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 1024,
                                         "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                                         "vocab_size": 47020, "max_position_embeddings": 512,
                                         "type_vocab_size": 2}  # fmt: skip
MISTRAL_SMALL_3: dict[str, Any] = {
    "model_type": "mistral3",
    "architectures": ["Mistral3ForConditionalGeneration"],
    "text_config": {
        "model_type": "mistral",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 131072,
        "rope_theta": 1e9,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },  # fmt: skip
    "vision_config": {
        "model_type": "pixtral",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "head_dim": 64,
        "image_size": 1540,
        "patch_size": 14,
    },  # fmt: skip
    "spatial_merge_size": 2,
    "multimodal_projector_bias": False,
    "tie_word_embeddings": False,
}
_QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "num_hidden_layers": 36,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e6}  # fmt: skip
QWEN3_4B: dict[str, Any] = {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True}
QWEN3_8B: dict[str, Any] = {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}

# Qwen2.5-VL-7B-Instruct (Qwen-Image's): a Qwen2 decoder with multimodal RoPE and a 32-block vision tower.
QWEN2_5_VL_7B: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False,
    },  # fmt: skip
    "vision_config": {
        "model_type": "qwen2_5_vl",
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },  # fmt: skip
    "tie_word_embeddings": False,
}


def built_text_encoder_configs(pipeline) -> dict[str, dict[str, Any]]:
    """``{component: config.json}`` of a built pipeline's transformers text encoders (its class in
    ``architectures``, as ``save_pretrained`` writes it)."""
    import torch

    return {name: {**module.config.to_dict(), "architectures": [type(module).__name__]}
            for name, module in pipeline.components.items()
            if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)}  # fmt: skip
