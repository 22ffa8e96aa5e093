"""Row-band patches of a latent image.

PipeFusion streams an image through the pipeline as M horizontal bands ("patches") of whole token rows. HunyuanDiT
flattens tokens row-major, so a band of token rows is one contiguous token range, and its 2D RoPE table is the same
contiguous row slice of ``get_2d_rotary_pos_embed``'s (cos, sin). Bands may be uneven (864 px → 54 token rows does not
divide by 4): the first ``rows % M`` bands get one extra row, like ``torch.tensor_split``. ``M`` is never changed.

Bands are cut by cost, not by rows, where one patch carries more than its rows: the step's first patch owns the plan's
streams (an MMDiT's text, ``lead_tokens`` tokens that go through every block with it), and a block's work grows with
the tokens it runs on (projections and MLP per token, attention per query token). So the first band gets as many
fewer rows as makes the patches' token counts, the text included, most even; otherwise a two-stage pipeline
alternates a heavy and a light patch and the light one's stage waits (SD3 at 512 px with 93 text tokens: 18 % more
tokens in patch 0 when cut by rows). Where the patches cut changes which K/V are stale, never an exact result.
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
    lead_tokens: int = 0  # tokens the band carries besides its rows (the first band: the plan's streams)

    @property
    def num_rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def num_tokens(self) -> int:
        return self.num_rows * self.token_cols

    @property
    def cost_tokens(self) -> int:
        """Tokens the band runs through every block: its rows' and those it carries (``lead_tokens``)."""
        return self.num_tokens + self.lead_tokens

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
    def cost_tokens(self) -> tuple[int, ...]:
        """Each band's tokens through every block, those it carries included (``PatchBand.cost_tokens``): the
        relative cost of a patch that the schedule and the planner use."""
        return tuple(band.cost_tokens for band in self.bands)

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


def patch_grid(
    latent_height: int, latent_width: int, num_patches: int, patch_size: int, lead_tokens: int = 0
) -> PatchGrid:
    """Split a latent into ``num_patches`` bands of whole token rows.

    Args:
        lead_tokens: tokens the first band carries through every block besides its rows (the plan's streams, e.g.
            an MMDiT's text): the bands are cut so that the largest patch, these tokens included, is as small as
            whole rows allow (``row_counts``). 0: rows as even as possible.

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
    bands, start = [], 0
    for index, rows in enumerate(row_counts(token_rows, token_cols, num_patches, lead_tokens)):
        lead = lead_tokens if index == 0 else 0
        bands.append(PatchBand(index, start, start + rows, token_cols, patch_size, lead))
        start += rows
    return PatchGrid(latent_height, latent_width, patch_size, tuple(bands))


def even_split(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` counts, the first ``rows % parts`` one larger (``torch.tensor_split``'s rule: the
    one home of it for patches, sequence-parallel chunks and the VAE decode's bands)."""
    base, extra = divmod(rows, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def row_counts(token_rows: int, token_cols: int, num_patches: int, lead_tokens: int = 0) -> list[int]:
    """Token rows of each band: the first band's count is the one (at least 1, leaving a row for every other band)
    that minimises the largest band's tokens, ``lead_tokens`` counted in the first; the other bands split the rest
    evenly. Among equal maxima the most rows go first, so ``lead_tokens=0`` gives ``torch.tensor_split``'s counts."""
    if num_patches == 1:
        return [token_rows]

    def largest(first: int) -> int:
        return max(first * token_cols + lead_tokens, max(even_split(token_rows - first, num_patches - 1)) * token_cols)

    first = min(range(token_rows - num_patches + 1, 0, -1), key=largest)  # min keeps the first (most rows) of ties
    return [first, *even_split(token_rows - first, num_patches - 1)]
