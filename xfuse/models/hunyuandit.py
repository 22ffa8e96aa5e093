"""HunyuanDiT adapter: one rank's share of a diffusers ``HunyuanDiT2DModel``, run whole-image or patch by patch.

Nothing of diffusers is copied: the diffusers blocks, embedders and output layer run as they are. What this file
adds is (a) sharding — blocks a rank does not run are replaced by ``nn.Identity`` so the kept parameters keep their
names (``blocks.12.attn1.to_q.weight``) and their global index, which HunyuanDiT's skip wiring depends on; and
(b) two attention processors: self-attention through a ``StaleKVCache`` (PipeFusion), cross-attention with the
text K/V computed once per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb, get_2d_rotary_pos_embed
from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiT2DModel
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid
from torch import nn

from xfuse.parallel.patch_grid import PatchBand
from xfuse.parallel.stage_plan import Segment, StagePlan, skip_pairs
from xfuse.parallel.stale_kv import StaleKVCache


def _project_heads(attn: Attention, x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    batch, seq, _ = x.shape
    return proj(x).view(batch, seq, attn.heads, -1).transpose(1, 2)  # (B, S, D) -> (B, heads, S, head_dim)


def _attend(attn: Attention, query, key, value) -> torch.Tensor:
    out = F.scaled_dot_product_attention(query, key, value)  # (B, heads, S, head_dim)
    out = out.transpose(1, 2).flatten(2).to(query.dtype)  # -> (B, S, heads * head_dim)
    return attn.to_out[1](attn.to_out[0](out))


class StaleKVSelfAttnProcessor:
    """HunyuanDiT self-attention (qk-norm, 2D RoPE on q and k) whose K/V go through a ``StaleKVCache``.

    ``image_rotary_emb`` holds the RoPE rows of exactly the tokens being computed, so K is rotated with its global
    positions before it is stored.
    """

    def __init__(self, cache: StaleKVCache, layer: int):
        self.cache, self.layer = cache, layer

    def __call__(
        self,
        attn: Attention,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        image_rotary_emb=None,
    ):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("StaleKVSelfAttnProcessor is for unmasked self-attention only")
        query = attn.norm_q(_project_heads(attn, hidden_states, attn.to_q))
        key = attn.norm_k(_project_heads(attn, hidden_states, attn.to_k))
        value = _project_heads(attn, hidden_states, attn.to_v)
        query = apply_rotary_emb(query, image_rotary_emb)
        key = apply_rotary_emb(key, image_rotary_emb)
        key, value = self.cache.update(self.layer, key, value)
        return _attend(attn, query, key, value)


class CachedCrossAttnProcessor:
    """HunyuanDiT cross-attention (RoPE on the image queries only) with the text K/V computed once per request.

    The cache is keyed on the text tensor object: the engine passes the same tensor for every step and patch of a
    request, and a different one invalidates the entry.
    """

    def __init__(self) -> None:
        self._text: torch.Tensor | None = None
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        self._text, self._kv = None, None

    def __call__(
        self,
        attn: Attention,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        image_rotary_emb=None,
    ):
        if attention_mask is not None:
            raise ValueError("CachedCrossAttnProcessor does not take an attention mask")
        if self._text is not encoder_hidden_states:
            key = attn.norm_k(_project_heads(attn, encoder_hidden_states, attn.to_k))
            value = _project_heads(attn, encoder_hidden_states, attn.to_v)
            self._text, self._kv = encoder_hidden_states, (key, value)
        query = apply_rotary_emb(attn.norm_q(_project_heads(attn, hidden_states, attn.to_q)), image_rotary_emb)
        return _attend(attn, query, *self._kv)


@dataclass
class Conditioning:
    """What every block of one denoising step needs besides the hidden states."""

    temb: torch.Tensor  # (B, hidden)
    text: torch.Tensor  # (B, 77 + 256, cross_attention_dim): BERT and projected T5 states, padding swapped in
    rope: tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (tokens, head_dim), row-major over the whole image


def text_states(
    model: HunyuanDiT2DModel,
    encoder_hidden_states,
    text_embedding_mask,
    encoder_hidden_states_t5,
    text_embedding_mask_t5,
) -> torch.Tensor:
    """The cross-attention input, as ``HunyuanDiT2DModel.forward`` builds it: constant for a whole request."""
    batch, seq, _ = encoder_hidden_states_t5.shape
    t5 = model.text_embedder(encoder_hidden_states_t5.view(-1, encoder_hidden_states_t5.shape[-1]))
    t5 = t5.view(batch, seq, -1)  # (B*S, D_t5) -> (B, S, D)
    text = torch.cat([encoder_hidden_states, t5], dim=1)  # (B, 77 + 256, D)
    mask = torch.cat([text_embedding_mask, text_embedding_mask_t5], dim=-1).unsqueeze(2).bool()  # (B, 333, 1)
    return torch.where(mask, text, model.text_embedding_padding)


def rotary_embedding(config, latent_height: int, latent_width: int, device=None):
    """The 2D RoPE (cos, sin), each (tokens, head_dim), exactly as ``HunyuanDiTPipeline`` builds it."""
    grid = (latent_height // config.patch_size, latent_width // config.patch_size)  # token rows, token cols
    base_size = 512 // 8 // config.patch_size
    crops = get_resize_crop_region_for_grid(grid, base_size)
    return get_2d_rotary_pos_embed(config.attention_head_dim, crops, grid, device=device, output_type="pt")


class HunyuanDiTStage(nn.Module):
    """The part of a ``HunyuanDiT2DModel`` that one pipeline rank runs.

    Args:
        transformer: the diffusers model; it is modified in place (blocks of other ranks dropped, processors set).
        plan: the stage plan; ``rank``: this rank. Patch embedding is kept on ``plan.embed_rank`` and the output
            layer on ``plan.output_rank``; the small conditioning embedders are kept on every rank so that no rank
            needs ``temb`` or text states sent to it.
    """

    def __init__(self, transformer: HunyuanDiT2DModel, plan: StagePlan, rank: int):
        super().__init__()
        if transformer.config.num_layers != plan.num_layers:
            raise ValueError(
                f"stage plan is for {plan.num_layers} blocks but the transformer has {transformer.config.num_layers}"
            )
        self.plan, self.rank = plan, rank
        self.block_ids = plan.blocks_of(rank)
        for index in range(plan.num_layers):
            if index not in self.block_ids:
                transformer.blocks[index] = nn.Identity()
        if rank != plan.embed_rank:
            transformer.pos_embed = None
        if rank != plan.output_rank:
            transformer.norm_out, transformer.proj_out = None, None
        self.transformer = transformer
        self.kv_cache = StaleKVCache()
        self._cross = []
        for index in self.block_ids:
            block = transformer.blocks[index]
            block.attn1.set_processor(StaleKVSelfAttnProcessor(self.kv_cache, index))
            cross = CachedCrossAttnProcessor()
            block.attn2.set_processor(cross)
            self._cross.append(cross)
        pairs = skip_pairs(plan.num_layers)
        self.skip_source = {consumer: producer for producer, consumer in pairs}  # consumer block -> producer block
        self.skip_producers = {producer for producer, _ in pairs}

    @classmethod
    def from_pretrained(cls, folder: str, plan: StagePlan, rank: int, torch_dtype=None) -> HunyuanDiTStage:
        """Load only what ``rank`` runs from a diffusers folder's ``transformer/*.safetensors``.

        The model is built without memory (accelerate's ``init_empty_weights``), sharded, and only the remaining
        tensors are read from the checkpoint, so a rank's peak memory is its share, not the whole transformer.
        """
        import glob
        import os

        from accelerate import init_empty_weights
        from accelerate.utils import set_module_tensor_to_device
        from safetensors import safe_open

        config = HunyuanDiT2DModel.load_config(folder, subfolder="transformer", local_files_only=True)
        with init_empty_weights():
            model = HunyuanDiT2DModel.from_config(config)
        stage = cls(model, plan, rank)
        wanted = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
        files = sorted(glob.glob(os.path.join(folder, "transformer", "*.safetensors")))
        if not files:
            raise ValueError(f"{folder!r}: no transformer/*.safetensors (xfuse loads safetensors checkpoints)")
        loaded = set()
        for file in files:
            with safe_open(file, framework="pt") as checkpoint:
                for key in checkpoint.keys():
                    if key in wanted:
                        tensor = checkpoint.get_tensor(key)
                        dtype = torch_dtype if torch_dtype is not None and tensor.is_floating_point() else None
                        # Without a dtype accelerate casts to the empty model's (float32) dtype.
                        set_module_tensor_to_device(model, key, "cpu", value=tensor, dtype=dtype or tensor.dtype)
                        loaded.add(key)
        missing = {name for name, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(
                f"{folder!r}: the checkpoint lacks {len(missing)} tensors of rank {rank}'s stage, "
                f"e.g. {sorted(missing)[:3]}"
            )
        return stage.eval()

    @property
    def config(self):
        return self.transformer.config

    @property
    def hidden_size(self) -> int:
        return self.transformer.inner_dim

    def begin_request(self, num_tokens: int) -> None:
        """Start a request: forget every K/V of the previous one."""
        self.kv_cache.reset(num_tokens)
        for cross in self._cross:
            cross.reset()

    def conditioning(self, timestep, text, encoder_hidden_states_t5, image_meta_size, style, rope) -> Conditioning:
        """Per-step conditioning: ``temb`` from timestep, pooled T5 states and size/style (cheap, per token-free)."""
        temb = self.transformer.time_extra_emb(
            timestep, encoder_hidden_states_t5, image_meta_size, style, hidden_dtype=timestep.dtype
        )  # (B, hidden)
        return Conditioning(temb, text, rope)

    def embed(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, rows, W) latent band -> (B, tokens, hidden)."""
        return self.transformer.pos_embed(latents)

    def run_segment(
        self,
        hidden: torch.Tensor,
        segment: Segment,
        cond: Conditioning,
        band: PatchBand | None,
        skips: dict[int, torch.Tensor],
        keep_kv: bool = True,
    ) -> torch.Tensor:
        """Run ``segment``'s blocks on ``hidden`` (B, tokens, hidden): the band's tokens, or the whole image.

        ``skips`` maps a producer block to its output for this patch: producers add to it, consumers pop from it.
        ``keep_kv=False`` (whole image only): do not store this pass's K/V, no patch will read them.
        """
        self.kv_cache.store_whole = keep_kv
        cos, sin = cond.rope
        rope = (cos, sin) if band is None else (cos[band.tokens], sin[band.tokens])  # (tokens, head_dim) each
        self.kv_cache.tokens = None if band is None else band.tokens
        for index in segment.blocks:
            skip = skips.pop(self.skip_source[index]) if index in self.skip_source else None
            hidden = self.transformer.blocks[index](
                hidden, temb=cond.temb, encoder_hidden_states=cond.text, image_rotary_emb=rope, skip=skip
            )
            if index in self.skip_producers:
                skips[index] = hidden
        return hidden

    def head(self, hidden: torch.Tensor, cond: Conditioning, token_cols: int) -> torch.Tensor:
        """(B, tokens, hidden) -> model output (B, out_channels, rows * p, token_cols * p) of the same band."""
        model = self.transformer
        out = model.proj_out(model.norm_out(hidden, cond.temb.to(torch.float32)))  # (B, tokens, p*p*C)
        p, channels = model.config.patch_size, model.out_channels
        batch, tokens = out.shape[:2]
        out = out.reshape(batch, tokens // token_cols, token_cols, p, p, channels)  # (B, h, w, p, q, C)
        out = torch.einsum("nhwpqc->nchpwq", out)  # (B, C, h, p, w, q)
        return out.reshape(batch, channels, (tokens // token_cols) * p, token_cols * p)  # (B, C, h*p, w*q)


def staged_forward(
    stages: dict[int, HunyuanDiTStage],
    latents: torch.Tensor,
    timestep: torch.Tensor,
    *,
    encoder_hidden_states,
    text_embedding_mask,
    encoder_hidden_states_t5,
    text_embedding_mask_t5,
    image_meta_size,
    style,
    image_rotary_emb,
    grid=None,
) -> torch.Tensor:
    """Run every rank's stage in one process, in route order: ``HunyuanDiT2DModel.forward`` rebuilt from stages.

    With ``grid`` the image goes through the route patch by patch (patches in order, each through every stage),
    attending to the K/V buffers as they are; without, the whole image goes at once and refills them. Used by the
    tests and the degree-1 path; the multi-rank engine runs the same stage methods on separate ranks.
    """
    plan = next(iter(stages.values())).plan
    any_stage = next(iter(stages.values()))
    text = text_states(
        any_stage.transformer,
        encoder_hidden_states,
        text_embedding_mask,
        encoder_hidden_states_t5,
        text_embedding_mask_t5,
    )
    cond = any_stage.conditioning(timestep, text, encoder_hidden_states_t5, image_meta_size, style, image_rotary_emb)
    token_cols = latents.shape[-1] // any_stage.config.patch_size
    bands = [None] if grid is None else list(grid)
    outputs = []
    for band in bands:
        rows = slice(None) if band is None else band.latent_rows
        hidden = stages[plan.embed_rank].embed(latents[:, :, rows])  # (B, C, rows, W) -> (B, tokens, hidden)
        skips: dict[int, torch.Tensor] = {}
        for segment in plan.route:
            hidden = stages[segment.rank].run_segment(hidden, segment, cond, band, skips)
        outputs.append(stages[plan.output_rank].head(hidden, cond, token_cols))
    return torch.cat(outputs, dim=2)  # bands stacked along latent rows: (B, C_out, H, W)


def denoise_request(
    stage: HunyuanDiTStage,
    *,
    latents,
    timesteps,
    scheduler,
    prompt_embeds,
    prompt_attention_mask,
    prompt_embeds_2,
    prompt_attention_mask_2,
    image_meta_size,
    style,
    guidance_scale: float,
    guidance_rescale: float = 0.0,
    cfg_half=None,
    extra_step_kwargs=None,
    generator=None,
    on_step_end=None,
    on_progress=None,
):
    """The engine's ``DenoiseRequest`` for HunyuanDiT, built from what ``HunyuanDiTPipeline`` prepares.

    Text inputs are batched as the pipeline batches them: [uncond, cond] when ``guidance_scale > 1``. With CFG
    parallelism (``cfg_half=(cfg_rank, exchange)``) they are this rank's half only (0: uncond, 1: cond) and
    ``exchange(noise, step, patch)`` returns the other half's noise prediction of the same rows. The
    cross-attention input is computed once here, so every step and patch passes the same tensor (which lets
    ``CachedCrossAttnProcessor`` reuse the text K/V).
    """
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import rescale_noise_cfg

    from xfuse.parallel.engine import DenoiseRequest

    do_cfg = guidance_scale > 1
    copies = 2 if do_cfg and cfg_half is None else 1
    model_batch = latents.shape[0] * copies
    rope = rotary_embedding(stage.config, latents.shape[-2], latents.shape[-1], device=latents.device)
    text = text_states(
        stage.transformer, prompt_embeds, prompt_attention_mask, prompt_embeds_2, prompt_attention_mask_2
    )

    def conditioning(step: int, t: torch.Tensor) -> Conditioning:
        t_batch = torch.tensor([t] * model_batch, device=latents.device).to(dtype=latents.dtype)  # as diffusers
        return stage.conditioning(t_batch, text, prompt_embeds_2, image_meta_size, style, rope)

    def model_input(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([rows] * copies) if copies > 1 else rows  # (B, C, h, W) -> (copies*B, C, h, W)

    def guide(output: torch.Tensor, step: int, patch) -> torch.Tensor:
        noise, _ = output.chunk(2, dim=1)  # learned sigma: keep the first half of the channels
        if not do_cfg:
            return noise
        if cfg_half is None:
            uncond, cond = noise.chunk(2)
        else:
            cfg_rank, exchange = cfg_half
            other = exchange(noise.contiguous(), step, patch)
            uncond, cond = (noise, other) if cfg_rank == 0 else (other, noise)
        guided = uncond + guidance_scale * (cond - uncond)
        if guidance_rescale > 0.0:  # whole-image statistics: the pipeline allows it in whole-image steps only
            guided = rescale_noise_cfg(guided, cond, guidance_rescale=guidance_rescale)
        return guided

    return DenoiseRequest(
        latents=latents,
        timesteps=timesteps,
        scheduler=scheduler,
        conditioning=conditioning,
        model_input=model_input,
        guide=guide,
        model_batch=model_batch,
        extra_step_kwargs=extra_step_kwargs or {},
        generator=generator,
        on_step_end=on_step_end,
        on_progress=on_progress,
    )
