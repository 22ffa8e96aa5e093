"""What the packed-latent MMDiT stages (FLUX.1, FLUX.2) share: their latent viewed as a grid of token rows, RoPE over
[text, image] position ids computed once per request and sliced per band, and the embedding and output layer on a
band's tokens.

The latent the engine steps is the pipeline's packed latent viewed as a grid: packed ``(B, rows * cols, C * 4)`` ->
``(B, C * 4, rows, cols)``, one latent row per packed token row, so a patch is a band of packed token rows (2 VAE
latent rows each) and the scheduler, elementwise, steps it unchanged. A band's position ids must keep their rows in
the whole image, so the whole image's RoPE table is computed once and a band takes its rows.
"""

from __future__ import annotations

import torch

from xfuse.families.common.mmdit import JointConditioning, JointStage
from xfuse.parallel.patch_grid import PatchBand


def packed_to_grid(packed: torch.Tensor, token_rows: int) -> torch.Tensor:
    """FluxPipeline's packed latents (B, rows * cols, C4) -> the engine's grid (B, C4, rows, cols)."""
    batch, tokens, channels = packed.shape
    grid = packed.reshape(batch, token_rows, tokens // token_rows, channels)  # (B, rows, cols, C4)
    return grid.permute(0, 3, 1, 2)  # -> (B, C4, rows, cols)


def grid_to_packed(grid: torch.Tensor) -> torch.Tensor:
    """The engine's grid (B, C4, rows, cols) -> FluxPipeline's packed latents (B, rows * cols, C4)."""
    return grid.permute(0, 2, 3, 1).flatten(1, 2)  # (B, rows, cols, C4) -> (B, rows * cols, C4)


class PackedJointStage(JointStage):
    """Base of the packed-latent MMDiT stages: double-stream blocks then single-stream ones as one chain (the block
    lists ``transformer_blocks`` and ``single_transformer_blocks``), ``x_embedder`` on the embedding rank,
    ``norm_out`` and ``proj_out`` on the output rank. A family adds its processors and its conditioning."""

    blocks_attrs = ("transformer_blocks", "single_transformer_blocks")
    embed_modules = ("x_embedder",)
    output_modules = ("norm_out", "proj_out")

    def rotary_embedding(self, text_ids: torch.Tensor, image_ids: torch.Tensor):
        """(cos, sin), each (T + image tokens, head_dim): ``FluxPosEmbed`` over the whole image, as
        ``FluxTransformer2DModel.forward`` computes it from ``cat(txt_ids, img_ids)``."""
        return self.transformer.pos_embed(torch.cat((text_ids, image_ids), dim=0))

    def block_kwargs(self, cond: JointConditioning, band: PatchBand | None, owner: bool) -> dict:
        """The RoPE rows of this pass's sequence: [text (owner only), the image tokens of the band (or of this
        rank's chunk of it)]."""
        cos, sin = cond.rope
        text_len = cond.text.shape[1]
        text = self.text_tokens()  # the text tokens this rank holds (all, or its SP chunk)
        self.joint.text_tokens = text.stop - text.start if owner else 0
        tokens = self.hidden_tokens(band)  # the image tokens this pass's hidden states are
        if tokens == slice(0, len(cos) - text_len) and text == slice(0, text_len):
            return {"image_rotary_emb": (cos, sin)}
        rows = slice(text_len + tokens.start, text_len + tokens.stop)
        if not owner:
            return {"image_rotary_emb": (cos[rows], sin[rows])}
        return {"image_rotary_emb": tuple(torch.cat([x[text], x[rows]]) for x in (cos, sin))}

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C4, rows, cols) packed latent rows -> (B, band tokens, hidden): the patch embedding (``x_embedder``;
        Qwen-Image's ``img_in``: ``embed_modules[0]``) on the packed tokens."""
        tokens = grid_to_packed(latent_rows)  # (B, rows * cols, C4)
        embedder = getattr(self.transformer, self.embed_modules[0])
        return embedder(tokens if band is None else band.trim(tokens))  # (B, band tokens, hidden)

    def head(
        self, hidden: torch.Tensor, cond: JointConditioning, token_cols: int, band: PatchBand | None = None
    ) -> torch.Tensor:
        """(B, band tokens, hidden) -> (B, C4, rows, token_cols) of the rows covering the band: mirrors the end of
        ``diffusers.FluxTransformer2DModel.forward`` (packed output), as engine grid rows."""
        model = self.transformer
        out = model.proj_out(model.norm_out(hidden, cond.temb))  # (B, band tokens, C4)
        out = out if band is None else band.pad(out)  # -> (B, covering rows' tokens, C4)
        return packed_to_grid(out, out.shape[1] // token_cols)
