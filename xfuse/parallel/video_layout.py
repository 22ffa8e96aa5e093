"""A video latent seen by the engine as one tall image: the patch direction of video PipeFusion.

The engine cuts a (B, C, H, W) latent into bands of token rows (``xfuse.parallel.patch_grid``). A video DiT's latent is
(B, C, F, H, W) and its tokens are frames x rows x columns (frame-major, Wan's order). Every layer of such a DiT except
self-attention is per token, and self-attention over the whole video is the same whatever order its keys are in (each
token's RoPE carries its own frame, row and column). So the video can be laid out as one image of ``F * H`` latent rows
in either of two token orders, and the engine's row bands become:

- ``temporal``: frames, then rows (the model's own order). The image is the frames stacked; a band is a run of
  consecutive frames (a cut may fall inside a frame, between two token rows).
- ``spatial``: token rows, then frames. Each token row of every frame in turn (the ``patch_size`` latent rows of one
  token row stay together, so the patch embedding never mixes frames); a band is a horizontal strip of the whole clip.

The layout only reorders: ``to_grid`` / ``from_grid`` are exact inverses, and ``token_order`` is the permutation a
family applies to its whole-video position table (RoPE) so that the band's slice of it is the band's tokens'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xfuse.errors import ConfigError
from xfuse.types import VIDEO_PATCHES


@dataclass(frozen=True)
class VideoLayout:
    """How a (B, C, frames, height, width) latent maps to the engine's (B, C, frames * height, width) grid.

    Attributes:
        direction: ``temporal`` (bands of frames) or ``spatial`` (bands of rows across all frames).
        frames, height, width: the latent's frames, rows and columns.
        patch_size: latent rows (and columns) per token; a token spans one frame (temporal patch 1).
    """

    direction: str
    frames: int
    height: int
    width: int
    patch_size: int

    def __post_init__(self):
        if self.direction not in VIDEO_PATCHES:
            allowed = ", ".join(VIDEO_PATCHES)
            raise ConfigError("parallel.video_patches", f"must be one of {allowed} (got {self.direction!r})")
        if self.height % self.patch_size or self.width % self.patch_size:
            raise ValueError(f"a {self.height}x{self.width} latent is not whole {self.patch_size}-pixel patches")

    @property
    def grid_height(self) -> int:
        """Latent rows of the engine's image: every frame's rows."""
        return self.frames * self.height

    def to_grid(self, video: torch.Tensor) -> torch.Tensor:
        """(B, C, F, H, W) -> (B, C, F*H, W) in this layout's row order (a copy for ``spatial``)."""
        batch, channels, frames, height, width = video.shape
        if self.direction == "temporal":
            return video.reshape(batch, channels, frames * height, width)  # (B, C, F*H, W): frame-major rows
        p = self.patch_size
        video = video.reshape(batch, channels, frames, height // p, p, width)  # (B, C, F, h, p, W)
        video = video.permute(0, 1, 3, 2, 4, 5)  # -> (B, C, h, F, p, W): token rows outermost
        return video.reshape(batch, channels, frames * height, width)  # -> (B, C, h*F*p, W)

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """(B, C, F*H, W) in this layout -> (B, C, F, H, W); the inverse of ``to_grid``."""
        batch, channels, _, width = grid.shape
        frames, height, p = self.frames, self.height, self.patch_size
        if self.direction == "temporal":
            return grid.reshape(batch, channels, frames, height, width)
        video = grid.reshape(batch, channels, height // p, frames, p, width)  # (B, C, h, F, p, W)
        video = video.permute(0, 1, 3, 2, 4, 5)  # -> (B, C, F, h, p, W)
        return video.reshape(batch, channels, frames, height, width)  # -> (B, C, F, H, W)

    def token_order(self, device=None) -> torch.Tensor:
        """(tokens,) indices: entry ``i`` is the model's (frame-major) index of this layout's token ``i``; indexing a
        frame-major per-token table with it gives the table in this layout's order."""
        frames, rows, cols = self.frames, self.height // self.patch_size, self.width // self.patch_size
        model_index = torch.arange(frames * rows * cols, device=device).reshape(frames, rows, cols)  # (F, h, w)
        if self.direction == "spatial":
            model_index = model_index.transpose(0, 1)  # (F, h, w) -> (h, F, w)
        return model_index.reshape(-1)
