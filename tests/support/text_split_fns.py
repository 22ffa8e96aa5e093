"""Rank functions for the split text encoder's tests (importable by spawned ranks)."""


def tiny_text_encoder(kind: str):
    """The text encoders ``parallel.text_encoder: split`` is for, tiny and seeded (the same weights on every rank):
    FLUX.2 [dev]'s Mistral 3 and [klein]'s Qwen3 (their presets'), and a Qwen2.5-VL (Qwen-Image's), 6 layers."""
    import torch

    from xfuse.families.registry import load_pipeline

    if kind == "mistral3":
        return load_pipeline("flux2-tiny").text_encoder
    if kind == "qwen3":
        return load_pipeline("flux2-klein-tiny").text_encoder
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=300, max_position_embeddings=128,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision)).eval()


def split_against_whole(kind: str):
    """The encoder split over this world's ranks (one pipeline group, gloo): rank 0 runs two calls inside the group's
    lead (a padded batch of two with every hidden state, then without them) and the whole encoder on the same
    inputs; returns the largest differences of every output, or ``None`` on the serving ranks."""
    import copy

    import torch
    import torch.distributed as dist

    from xfuse.config import config_from_dict
    from xfuse.parallel.text_encoder_split import SplitTextEncoder, TextGroup
    from xfuse.runtime.world import init_parallel

    world = int(__import__("os").environ["WORLD_SIZE"])
    config = config_from_dict({"model": "flux2-tiny", "parallel": {"pipefusion_degree": world},
                               "comm": {"timeout_s": 60}})  # fmt: skip
    context = init_parallel(config)
    encoder = tiny_text_encoder(kind)
    whole = copy.deepcopy(encoder) if context.rank == 0 else None
    ranks = list(range(world))
    group = dist.new_group(ranks=ranks, backend="gloo")
    split = SplitTextEncoder(encoder, name="text_encoder", index=context.rank, ranks=ranks, channels=context.channels,
                             group=group, device=torch.device("cpu"))  # fmt: skip
    text = TextGroup({"text_encoder": split}, group)
    if context.rank != 0:
        text.serve()
        return None
    ids = torch.randint(4, 200, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # the second prompt left-padded
    calls = [dict(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False),
             dict(input_ids=ids[:1], attention_mask=mask[:1], use_cache=False)]  # fmt: skip
    with torch.no_grad(), text.leading():
        got = [encoder(**call) for call in calls]
    with torch.no_grad():
        expected = [whole(**call) for call in calls]
    diffs = {"logits": [float((g.logits - e.logits).abs().max()) for g, e in zip(got, expected, strict=True)],
             "hidden_states": [float((g - e).abs().max()) for g, e in
                               zip(got[0].hidden_states, expected[0].hidden_states, strict=True)],
             "no_hidden_states": got[1].hidden_states is None}  # fmt: skip
    return diffs
