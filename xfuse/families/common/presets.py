"""The offline builders every family's presets share: one small vocabulary, per-component seeding, and tiny text
encoders, tokenizers and VAEs with the real components' structure.

Nothing here touches the network, and every weight is a pure function of ``seed``: each component is initialised under
its own seed (derived from ``seed`` and the component's name) inside a forked RNG, so the caller's global RNG state is
left untouched. torch, diffusers and transformers are imported inside the builders: reading a preset's config (plan
checks, the CLI) must stay cheap.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise

# CLIP's context: the SD3 and FLUX pipelines pad CLIP prompts to the tokenizer's model_max_length.
CLIP_MAX_LENGTH = 77
# The SDXL VAE's latent scale, which HunyuanDiT and PixArt-Σ use.
SDXL_VAE_SCALING = 0.13025

# A small fixed vocabulary shared by both tokenizers: enough to tokenize typical English test prompts into real
# pieces (rarer words fall back to sub-word or unknown pieces) plus a few CJK characters, as HunyuanDiT is
# bilingual. Order matters: it fixes the token ids.
WORDS = (
    "a an the of and in on with at to for by from is are this that photo picture painting drawing image "
    "portrait landscape cat dog bird horse fish tree flower forest mountain river sea sky sun moon star city "
    "street house car boat man woman child girl boy face red green blue yellow white black orange purple "
    "pink brown gray golden big small old young beautiful cute dark bright night day morning evening winter "
    "summer snow rain light style art oil watercolor digital realistic detailed high quality 4k 8k"
).split()
CJK_CHARS = "一只猫狗的在上和中国山水画"
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789" + ",.!?'\"-:;()&/" + CJK_CHARS


def _component_seed(seed: int, component: str) -> int:
    # A distinct stream per component, so that changing one component's config (e.g. a transformer override) does
    # not change the others' weights. crc32 is stable across processes, unlike `hash`.
    return (int(seed) * 1_000_003 + zlib.crc32(component.encode())) % (2**63)


@contextmanager
def seeded(seed: int, component: str) -> Iterator[None]:
    import torch

    # Model constructors draw from the global CPU RNG; fork it so the caller's RNG state is restored afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_component_seed(seed, component))
        yield


def t5_vocab(extra_words: tuple[str, ...] = ()) -> list[tuple[str, float]]:
    # Unigram picks the segmentation with the highest total log-probability, so whole words must score better than
    # their spelling; single characters are the fallback that keeps any ASCII/listed text free of `<unk>`.
    # T5's special ids: <pad> = 0, </s> = 1, <unk> = 2.
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    words = WORDS + [word for word in extra_words if word not in WORDS]
    pieces += [("\u2581" + word, -5.0 - 0.01 * index) for index, word in enumerate(words)]
    # Unlike BERT's, the T5 tokenizer does not lowercase, so it needs the capitals too.
    chars = CHARS + CHARS[:26].upper()
    pieces += [(char, -10.0) for char in chars]
    pieces += [("\u2581" + char, -9.0) for char in chars]
    return pieces


def divisor_heads(width: int, head_dim: int) -> int:
    # As many heads of `head_dim` as fit exactly, at least one.
    return max(1, width // head_dim) if width % head_dim == 0 else 1


def t5_encoder(width: int, vocab_size: int, seed: int, component: str, *, umt5: bool = False):
    """A 2-layer T5 v1.1 / mT5-style encoder (gated GELU, untied embeddings) of ``width``, seeded per component;
    ``umt5``: a UMT5 encoder of the same sizes (Wan's: a relative position bias in every layer)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = config_class(
        vocab_size=vocab_size,
        d_model=width,
        d_kv=8,
        num_heads=divisor_heads(width, 8),
        d_ff=2 * width,
        num_layers=2,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.0,
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    with seeded(seed, component):
        return model_class(config).eval()


def tiny_vae_config(
    sample_size: int,
    *,
    latent_channels: int = 4,
    scaling_factor: float | None = None,
    shift_factor: float | None = None,
    quant_convs: bool = True,
) -> dict:
    """The ``AutoencoderKL`` arguments of :func:`tiny_vae` (no torch: ``xfuse plan`` costs the decode from them;
    a ``scaling_factor`` or ``shift_factor`` of None leaves diffusers' default: the costs do not depend on them)."""
    config = {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * 4,
        "up_block_types": ("UpDecoderBlock2D",) * 4,
        "block_out_channels": (8, 8, 16, 16),
        "layers_per_block": 1,
        "latent_channels": latent_channels,
        "norm_num_groups": 4,
        "sample_size": sample_size,
        "use_quant_conv": quant_convs,
        "use_post_quant_conv": quant_convs,
        "force_upcast": False,
    }
    factors = {"scaling_factor": scaling_factor, "shift_factor": shift_factor}
    return config | {key: value for key, value in factors.items() if value is not None}


# The released image VAEs' widths: SDXL's (HunyuanDiT, PixArt-Σ), SD3's, FLUX.1's (Z-Image's) and FLUX.2's
# AutoencoderKL decoders alike have four levels of (128, 256, 512, 512) channels, two resnets a level and 32 norm
# groups (their config.json; 83.7-84 M parameters). The released-shape presets carry them, so that xfuse plan counts
# the VAE's bytes and costs its decode as released; the test presets keep the tiny widths.
RELEASED_VAE_WIDTHS = {"block_out_channels": (128, 256, 512, 512), "layers_per_block": 2, "norm_num_groups": 32}


def released_vae(config: dict, released: bool) -> dict:
    """A preset's ``AutoencoderKL``-layout VAE arguments (``tiny_vae_config``'s) at the release's widths where the
    preset has the release's shape (``released``: it is in its family's ``RELEASED_TEXT_ENCODERS``)."""
    return config | RELEASED_VAE_WIDTHS if released else config


def tiny_vae(config: dict, seed: int):
    """A tiny ``AutoencoderKL`` of :func:`tiny_vae_config`'s arguments (a family's ``preset_vae_config``) with scale
    factor 8: four resolution levels, three 2x downsamplings, as every family's released VAE (the pipelines derive the
    factor from ``block_out_channels``; HunyuanDiT's also hard-codes 8 when it sizes the RoPE grid). Channels stay tiny
    so that decoding costs little next to the transformer.

    HunyuanDiT and PixArt-Σ use the SDXL VAE's layout (4 latent channels, quant convs, a scale only); SD3 and FLUX
    have no quant convs and normalise latents with a shift as well as a scale (``tiny_vae_config``'s
    ``quant_convs=False`` and ``shift_factor``)."""
    from diffusers import AutoencoderKL

    with seeded(seed, "vae"):
        vae = AutoencoderKL(**config)
    return vae.eval()


def _clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary and merges for CLIP: every byte, plus whole-word tokens for ``tiny.WORDS``."""
    from tokenizers import pre_tokenizers

    # All 256 byte symbols, bare and word-final, so any text encodes without the unknown token (which is CLIP's end
    # token: an unknown piece would otherwise end the prompt for the pooler, which takes the first end token).
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|startoftext|>", "<|endoftext|>", *alphabet, *(char + "</w>" for char in alphabet)]
    # The merges are learnt by plain BPE training on the listed words (most frequent pair first, ties by the pair
    # itself, so the result is fixed): encoding replays training, so every listed word becomes one token, which
    # hand-ordered merge chains do not guarantee (one word's merge can split another word first).
    words = [[*word[:-1], word[-1] + "</w>"] for word in WORDS if word.isalpha()]  # CLIP splits digits off
    merges: list[tuple[str, str]] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for word in words:
            for pair in pairwise(word):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges.append(pair)
        if pair[0] + pair[1] not in tokens:  # two pairs can spell the same token; keep the ids dense
            tokens.append(pair[0] + pair[1])
        words = [_merge(word, pair) for word in words]
    return {token: index for index, token in enumerate(tokens)}, merges


def _merge(word: list[str], pair: tuple[str, str]) -> list[str]:
    merged, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(word[i] + word[i + 1])
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged


def clip_tokenizer(pad_token: str = "<|endoftext|>"):
    """A ``CLIPTokenizer`` built in memory (transformers 5 takes the vocabulary and merges as Python objects)."""
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab()
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=CLIP_MAX_LENGTH)


def clip_text_encoder(width: int, tokenizer, seed: int, component: str, *, with_projection: bool, hidden_act: str):
    """A 2-layer CLIP text encoder of ``width`` (projection to ``width`` too), seeded per component."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=4 * width,
        projection_dim=width,
        num_hidden_layers=2,  # SD3 reads hidden_states[-2], so one layer would leave only the embeddings
        # The released CLIPs' 64-wide heads where the width allows, else 16-wide ones.
        num_attention_heads=divisor_heads(width, 64 if width % 64 == 0 else 16),
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
        dropout=0.0,
        # The pooler takes the first end token; ids from the tokenizer, not CLIP's legacy eos id 2 (argmax rule).
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model_class = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    with seeded(seed, component):
        return model_class(config).eval()


def byte_level_tokenizer(specials: list[str], max_length: int, chat_template: str | None = None):
    """A byte-level tokenizer built in memory (one token per byte: any text encodes, none is unknown) with a
    decoder-only text encoder's special tokens (``specials``: bos, eos, unk, pad, then the template's markers, each
    one token wherever it appears in a text) and, where the pipeline applies one, a chat template of the release's
    form."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = [*specials, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    model = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=[], unk_token=specials[2]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    model.decoder = decoders.ByteLevel()
    bos, eos, unk, pad = specials[:4]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token=bos, eos_token=eos, unk_token=unk,
                                        pad_token=pad, model_max_length=max_length)  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": specials[4:]})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


# Qwen3's special tokens (bos, eos, unk, pad, then its thinking markers) and its chat template's form: the messages,
# then with the generation prompt the assistant's turn, an empty thinking block where thinking is off (FLUX.2 [klein]'s
# pipeline turns it off, Z-Image's on).
QWEN3_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|unk|>", "<|endoftext|>", "<think>", "</think>"]
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
