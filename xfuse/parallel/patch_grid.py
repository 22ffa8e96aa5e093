"""Row-band patches of a latent image.

PipeFusion streams an image through the pipeline as M horizontal bands ("patches") of token rows. HunyuanDiT
flattens tokens row-major, so a band of token rows is one contiguous token range, and its 2D RoPE table is the same
contiguous row slice of ``get_2d_rotary_pos_embed``'s (cos, sin). Bands may be uneven (864 px → 54 token rows does not
divide by 4): the first ``rows % M`` bands get one extra row, like ``torch.tensor_split``. ``M`` is never changed.

Bands are cut by cost, not by rows, where one patch carries more than its rows: the step's first patch owns the plan's
streams (an MMDiT's text, ``lead_tokens`` tokens that go through every block with it), and a block's work grows with
the tokens it runs on (projections and MLP per token, attention per query token). So the first band gets as many
fewer tokens as makes the patches' token counts, the text included, even; otherwise a two-stage pipeline alternates
a heavy and a light patch and the light one's stage waits (SD3 at 512 px with 93 text tokens: 18 % more tokens in
patch 0 when cut by rows). Such a cut may fall inside a token row (``PatchBand``: the rows covering the band are
embedded and unpatchified, the band's tokens kept). Where the patches cut changes which K/V are stale, never an
exact result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from xfuse.errors import ConfigError

if TYPE_CHECKING:  # tensors are only handled here; the cut itself is pure (the planner imports it without torch)
    import torch


@dataclass(frozen=True)
class PatchBand:
    """One patch: tokens ``[token_start, token_stop)`` of the row-major token grid.

    A band cut by cost may start or end inside a token row. The model then embeds and unpatchifies the rows that
    cover it (``row_start … row_stop``, ``latent_rows``), keeps the band's own tokens of the embedding (``trim``),
    fills the other tokens of the output with zeros (``pad``) and the engine writes back only the band's pixels
    (``copy_pixels``): every per-token layer (patch embedding, output layer, elementwise scheduler step) is exact on
    any token range, and the blocks only ever see the band's tokens.
    """

    index: int
    token_start: int
    token_stop: int
    token_cols: int
    patch_size: int
    lead_tokens: int = 0  # tokens the band carries besides its own (the first band: the plan's streams)

    @property
    def row_start(self) -> int:
        """First token row the band covers (whole or in part)."""
        return self.token_start // self.token_cols

    @property
    def row_stop(self) -> int:
        """One past the last token row the band covers (whole or in part)."""
        return -(-self.token_stop // self.token_cols)

    @property
    def num_rows(self) -> int:
        """Token rows the band covers, whole or in part."""
        return self.row_stop - self.row_start

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start

    @property
    def whole_rows(self) -> bool:
        """Whether the band is whole token rows (then ``trim``, ``pad`` and ``copy_pixels`` are plain copies)."""
        return self.token_start % self.token_cols == 0 and self.token_stop % self.token_cols == 0

    @property
    def cost_tokens(self) -> int:
        """Tokens the band runs through every block: its own and those it carries (``lead_tokens``)."""
        return self.num_tokens + self.lead_tokens

    @property
    def tokens(self) -> slice:
        """Slice of the flattened token sequence (and of the RoPE cos/sin rows) this band covers."""
        return slice(self.token_start, self.token_stop)

    @property
    def row_tokens(self) -> slice:
        """Slice of the flattened token sequence of the rows that cover the band (``tokens`` when ``whole_rows``)."""
        return slice(self.row_start * self.token_cols, self.row_stop * self.token_cols)

    @property
    def latent_rows(self) -> slice:
        """Slice of latent rows (height axis of the (B, C, H, W) latent) of the rows that cover the band."""
        return slice(self.row_start * self.patch_size, self.row_stop * self.patch_size)

    def trim(self, row_tokens: torch.Tensor) -> torch.Tensor:
        """(B, covering rows' tokens, ...) -> (B, band tokens, ...): the band's own tokens."""
        offset = self.token_start - self.row_tokens.start
        return row_tokens[:, offset : offset + self.num_tokens]

    def pad(self, band_tokens: torch.Tensor) -> torch.Tensor:
        """(B, band tokens, X) -> (B, covering rows' tokens, X), zeros at the tokens of the other bands."""
        if self.whole_rows:
            return band_tokens
        shape = (band_tokens.shape[0], self.num_rows * self.token_cols, *band_tokens.shape[2:])
        padded = band_tokens.new_zeros(shape)
        self.trim(padded).copy_(band_tokens)
        return padded

    def copy_pixels(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the band's latent pixels from ``src`` into ``dest``, both (B, C, covering latent rows, W)."""
        if self.whole_rows:
            dest.copy_(src)
            return
        p, cols = self.patch_size, self.token_cols
        start = self.token_start - self.row_tokens.start  # in the covering rows' tokens
        first_row, first_col = divmod(start, cols)
        last_row, last_col = divmod(start + self.num_tokens, cols)  # exclusive
        if first_row == last_row:  # inside one row
            pieces = [(first_row, first_row + 1, first_col, last_col)]
        else:  # a partial first row, the whole rows between, a partial last row
            pieces = [(first_row, first_row + 1, first_col, cols)] if first_col else []
            first_row += 1 if first_col else 0
            pieces += [(first_row, last_row, 0, cols)] if first_row < last_row else []
            pieces += [(last_row, last_row + 1, 0, last_col)] if last_col else []
        for row_lo, row_hi, col_lo, col_hi in pieces:  # token rows/cols -> latent rows/cols (x patch_size)
            region = (slice(None), slice(None), slice(row_lo * p, row_hi * p), slice(col_lo * p, col_hi * p))
            dest[region] = src[region]


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
    """Split a latent into ``num_patches`` bands of tokens (``token_counts``).

    Args:
        lead_tokens: tokens the first band carries through every block besides its own (the plan's streams, e.g.
            an MMDiT's text): the bands are cut so that the patches' token counts, these included, are as even as
            tokens allow, a cut possibly inside a row. 0: whole rows as even as possible.

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
    for index, tokens in enumerate(token_counts(token_rows, token_cols, num_patches, lead_tokens)):
        lead = lead_tokens if index == 0 else 0
        bands.append(PatchBand(index, start, start + tokens, token_cols, patch_size, lead))
        start += tokens
    return PatchGrid(latent_height, latent_width, patch_size, tuple(bands))


def even_split(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` counts, the first ``rows % parts`` one larger (``torch.tensor_split``'s rule: the
    one home of it for patches, sequence-parallel chunks and the VAE decode's bands)."""
    base, extra = divmod(rows, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def token_counts(token_rows: int, token_cols: int, num_patches: int, lead_tokens: int = 0) -> list[int]:
    """Tokens of each band, top first.

    Without ``lead_tokens``: whole token rows as even as possible, ``torch.tensor_split``'s counts (``even_split``).
    With them the patches' costs (their tokens, ``lead_tokens`` counted in the first) are made as even as tokens
    allow: the first band gets its even share of the cost less ``lead_tokens``, at least one row's tokens (a text
    longer than a share leaves it one row), and the other bands split the rest evenly. Such cuts may fall inside a
    token row (FLUX at 512 px: 16 text tokens are half a row; by whole rows the best cut is 528 / 512 tokens).
    """
    if num_patches == 1 or not lead_tokens:
        return [rows * token_cols for rows in even_split(token_rows, num_patches)]
    image_tokens = token_rows * token_cols
    first = max(even_split(image_tokens + lead_tokens, num_patches)[0] - lead_tokens, token_cols)
    counts = [first, *even_split(image_tokens - first, num_patches - 1)]
    assert min(counts) > 0, (token_rows, token_cols, num_patches, lead_tokens)  # num_patches <= token_rows
    return counts


def check_sequence_chunks(grid: PatchGrid, ulysses: int, ring: int) -> None:
    """Every pass over ``grid`` (a patch, or the whole image) leaves each of the ``ulysses * ring`` ranks of an SP
    group at least one token; :class:`ConfigError` naming the degree otherwise (the same on every rank)."""
    degree, smallest = ulysses * ring, min(band.num_tokens for band in grid)
    if degree > 1 and smallest < degree:
        key = "parallel.ring_degree" if ulysses == 1 else "parallel.ulysses_degree"
        raise ConfigError(
            key,
            f"parallel.ulysses_degree ({ulysses}) x parallel.ring_degree ({ring}) = {degree} ranks share every "
            f"pass's tokens, but the smallest patch of this {grid.token_rows}x{grid.token_cols}-token image has "
            f"{smallest}: use fewer sequence-parallel ranks, fewer patches or a larger image",
        )
