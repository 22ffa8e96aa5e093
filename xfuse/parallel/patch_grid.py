"""Row-band patches of a latent image.

PipeFusion streams an image through the pipeline as M horizontal bands ("patches") of whole token rows. HunyuanDiT
flattens tokens row-major, so a band of token rows is one contiguous token range, and its 2D RoPE table is the same
contiguous row slice of ``get_2d_rotary_pos_embed``'s (cos, sin). Bands may be uneven (864 px → 54 token rows does not
divide by 4): the first ``rows % M`` bands get one extra row, like ``torch.tensor_split``. ``M`` is never changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from xfuse.errors import ConfigError


@dataclass(frozen=True)
class PatchBand:
    """One patch: token rows ``[row_start, row_stop)`` of the token grid."""

    index: int
    row_start: int
    row_stop: int
    token_cols: int
    patch_size: int

    @property
    def num_rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def num_tokens(self) -> int:
        return self.num_rows * self.token_cols

    @property
    def tokens(self) -> slice:
        """Slice of the flattened token sequence (and of the RoPE cos/sin rows) this band covers."""
        return slice(self.row_start * self.token_cols, self.row_stop * self.token_cols)

    @property
    def latent_rows(self) -> slice:
        """Slice of latent rows (height axis of the (B, C, H, W) latent) this band covers."""
        return slice(self.row_start * self.patch_size, self.row_stop * self.patch_size)


@dataclass(frozen=True)
class PatchGrid:
    """M row bands over an ``latent_height × latent_width`` latent cut into ``patch_size`` tokens."""

    latent_height: int
    latent_width: int
    patch_size: int
    bands: tuple[PatchBand, ...]

    @property
    def num_patches(self) -> int:
        return len(self.bands)

    @property
    def token_rows(self) -> int:
        return self.latent_height // self.patch_size

    @property
    def token_cols(self) -> int:
        return self.latent_width // self.patch_size

    @property
    def num_tokens(self) -> int:
        return self.token_rows * self.token_cols

    def __iter__(self):
        return iter(self.bands)

    def __getitem__(self, index: int) -> PatchBand:
        return self.bands[index]


def patch_grid(latent_height: int, latent_width: int, num_patches: int, patch_size: int) -> PatchGrid:
    """Split a latent into ``num_patches`` bands of whole token rows.

    Raises:
        ConfigError: ``parallel.num_patches`` outside ``1 … token rows``, or a latent side that is not a multiple of
            ``patch_size`` (named ``generation.height`` / ``generation.width``; ``ModelSpec.check_layout`` says it in
            pixels first, with the family's VAE factor).
    """
    for key, side in (("generation.height", latent_height), ("generation.width", latent_width)):
        if side <= 0 or side % patch_size:
            raise ConfigError(
                key,
                f"the latent side must be a positive multiple of the patch size {patch_size} (got {side})",
            )
    token_rows, token_cols = latent_height // patch_size, latent_width // patch_size
    if not isinstance(num_patches, int) or isinstance(num_patches, bool) or not 1 <= num_patches <= token_rows:
        raise ConfigError(
            "parallel.num_patches",
            f"must be an integer from 1 to the number of token rows, {token_rows} for a latent of "
            f"{latent_height}x{latent_width} with patch size {patch_size} (got {num_patches!r})",
        )
    base, extra = divmod(token_rows, num_patches)
    bands, start = [], 0
    for index in range(num_patches):
        stop = start + base + (1 if index < extra else 0)
        bands.append(PatchBand(index, start, stop, token_cols, patch_size))
        start = stop
    return PatchGrid(latent_height, latent_width, patch_size, tuple(bands))
