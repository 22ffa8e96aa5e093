"""Bytes a plan moves and holds and the speedup its schedule allows, from shapes alone (no torch, no processes).

``comm_volume`` is the contract the communication counters are tested against: per denoising step, the whole image
passes every hand-off once whatever the number of patches (warm-up and pipelined steps move the same bytes; only the
stepped latent of a linear placement moves one token row more per cut inside a row, with both patches it splits).
"""

from __future__ import annotations

from collections.abc import Callable

from xfuse.parallel.patch_grid import PatchGrid
from xfuse.parallel.schedule import build_schedule
from xfuse.parallel.stage_plan import StagePlan

KINDS = ("hidden", "skip", "latent")


def comm_volume(
    plan: StagePlan,
    grid: PatchGrid,
    *,
    hidden_size: int,
    batch: int,
    latent_batch: int | None = None,
    in_channels: int = 4,
    dtype_bytes: int = 4,
    stream_tokens: dict[str, int] | None = None,
    control_residuals: dict[int, int] | None = None,
) -> dict[int, dict[str, int]]:
    """Bytes each rank sends per denoising step, by kind.

    Args:
        plan, grid: the stage plan and patch grid of the request.
        hidden_size: transformer width (HunyuanDiT ``inner_dim``).
        batch: transformer batch (2 × images with classifier-free guidance batched as [uncond, cond]).
        latent_batch: batch of the latent the scheduler steps (images); defaults to ``batch``.
        in_channels: latent channels.
        dtype_bytes: bytes per element of the model dtype.
        stream_tokens: tokens of each of the plan's streams (an MMDiT's text length T); a stream crosses each
            hand-off once per step as (B, T, hidden), with the step's first patch.
        control_residuals: with a ControlNet, the residuals each other rank takes per pass
            (``ControlResiduals.counts``): the embedding rank sends each its (B, tokens, hidden) residuals of every
            patch, the whole image once per step.

    Returns:
        ``{rank: {"hidden": bytes, "skip": bytes, "latent": bytes, <stream>: bytes}}`` for every rank of the plan
        (and ``"control"`` with ``control_residuals``).
    """
    latent_batch = batch if latent_batch is None else latent_batch
    stream_tokens = stream_tokens or {}
    missing = set(plan.streams) - set(stream_tokens)
    if missing:
        raise ValueError(f"comm_volume: give the token count of the plan's streams {sorted(missing)}")
    activation = batch * grid.num_tokens * hidden_size * dtype_bytes  # (B, tokens, hidden)
    kinds = KINDS + plan.streams + (("control",) if control_residuals is not None else ())
    volume = {rank: dict.fromkeys(kinds, 0) for rank in range(plan.degree)}
    for count in (control_residuals or {}).values():
        volume[plan.embed_rank]["control"] += count * activation
    for handoff in plan.handoffs:
        volume[handoff.src_rank]["hidden"] += activation
        for stream in plan.streams:
            volume[handoff.src_rank][stream] += batch * stream_tokens[stream] * hidden_size * dtype_bytes
    for skip in plan.cross_rank_skips:
        volume[skip.src_rank]["skip"] += activation
    if plan.output_rank != plan.embed_rank:  # linear: the stepped latent goes back to the embedding rank
        # each patch's covering rows (a cut inside a token row sends that row with both of its patches)
        rows = sum(band.num_rows for band in grid) * grid.patch_size
        latent = latent_batch * in_channels * rows * grid.latent_width * dtype_bytes
        volume[plan.output_rank]["latent"] += latent
    return volume


def keeps_stale_kv(num_patches: int, warmup_steps: int, num_steps: int, cached: bool) -> bool:
    """Whether a request's passes keep the whole image's stale K/V buffers at all (``PipeFusionEngine``'s
    ``keep_kv``): only with more than one patch, where some step is pipelined or step caching has every computed
    whole-image step store them. One patch (a sequence-parallel layout's default) or exact mode: none."""
    return num_patches > 1 and (warmup_steps < num_steps or cached)


def kv_buffer_bytes(
    plan: StagePlan,
    grid: PatchGrid,
    *,
    hidden_size: int,
    batch: int,
    dtype_bytes: int = 4,
    attentions: Callable[[int], int] = lambda block: 1,
) -> dict:
    """Bytes of the full-image stale K/V buffers each rank holds: K and V of (B, tokens, hidden) per attention
    module that mixes image tokens (``attentions(block)`` of them in a block; SD3.5's dual-attention blocks: 2)."""
    per_module = 2 * batch * grid.num_tokens * hidden_size * dtype_bytes
    return {rank: per_module * sum(attentions(b) for b in plan.blocks_of(rank)) for rank in range(plan.degree)}


def receive_buffer_bytes(
    plan: StagePlan,
    grid: PatchGrid,
    *,
    hidden_size: int,
    batch: int,
    latent_batch: int,
    in_channels: int,
    dtype_bytes: int = 4,
    stream_tokens: dict[str, int] | None = None,
) -> dict[int, int]:
    """Bytes of the receive buffers each rank's pool keeps (``xfuse.comm.buffers``: one per message shape in flight,
    kept for the next request of the shape): per hand-off, skip or latent it receives, one for a whole-image pass
    and the patches' (together at most a whole image in flight): twice a whole image's (B, tokens, hidden), and the
    plan's streams (B, T, hidden) with them."""
    stream_tokens = stream_tokens or {}
    image = batch * grid.num_tokens * hidden_size * dtype_bytes
    streams = sum(batch * stream_tokens[s] * hidden_size * dtype_bytes for s in plan.streams)
    held = dict.fromkeys(range(plan.degree), 0)
    for handoff in plan.handoffs:
        held[handoff.dst_rank] += 2 * (image + streams)
    for skip in plan.cross_rank_skips:
        held[skip.dst_rank] += 2 * image
    if plan.output_rank != plan.embed_rank:  # linear: the stepped latent rows come back to the embedding rank
        rows = sum(band.num_rows for band in grid) * grid.patch_size
        held[plan.embed_rank] += 2 * latent_batch * in_channels * rows * grid.latent_width * dtype_bytes
    return held


def speedup_ceiling(
    plan: StagePlan, patch_tokens: tuple[int, ...], *, num_steps: int, warmup_steps: int, batch_parts: int
) -> float:
    """The speedup over one rank that the schedule itself allows when only the blocks cost: every block on a patch
    in proportion to the patch's tokens (``patch_tokens``, ``PatchGrid.cost_tokens``: a step's first patch counts the
    text it carries), no communication, no per-pass or per-patch overheads. One rank runs every block on the whole
    image every step (M mean patches); the plan's ranks take the simulated schedule's makespan (fill, drain, the
    warm-up steps' batch parts, and the waits unequal patches cause)."""
    warmup, patches = min(warmup_steps, num_steps), len(patch_tokens)
    schedule = build_schedule(plan, num_steps, warmup, patches, batch_parts, tuple(patch_tokens))
    return num_steps * plan.num_blocks * patches / schedule.makespan
