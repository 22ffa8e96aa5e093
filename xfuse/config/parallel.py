"""``parallel``: how the work is split across ranks (PipeFusion, CFG and sequence-parallel degrees, the stage
placement, the VAE decode, the video patches and the text encoders' placement)."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BeforeValidator, Field, model_validator
from typing_extensions import Self

from xfuse.config.section import PositiveInt, Section, yaml_switch
from xfuse.errors import ConfigError
from xfuse.types import Adapter, Placement, TextEncoderPlacement, VaeParallel, VideoPatches

MAX_PIPEFUSION_DEGREE = 8
MAX_SEQUENCE_DEGREE = 16  # Ulysses or Ring ranks of one SP group (16: two nodes of 8)
SequenceDegree = Annotated[int, Field(ge=1, le=MAX_SEQUENCE_DEGREE)]


class ParallelConfig(Section):
    """How the work is split across ranks.

    ``num_patches`` is kept exactly as given (``None`` means "one patch per stage"); use
    :attr:`resolved_num_patches` for the value the engine runs with. ``placement`` ``None`` means the model
    family's default (``ModelSpec.default_placement``: balanced for HunyuanDiT's long skips, linear otherwise;
    ``balanced`` is folded's route with per-rank totals even to one block, see ``xfuse.parallel.stage_plan``).
    ``stage_split`` lists block counts per chunk, one entry per PipeFusion rank: for ``folded`` the chunk sizes of the
    first half of the blocks (the mirrored chunks of the second half are equal), for ``linear`` and ``balanced`` the
    blocks per rank (``balanced``: at least 2 each; the planner splits each rank's blocks between the way out and
    the way back). Whether the split fits the model's block count is checked by ``ModelSpec.check_layout``.
    ``vae_parallel``: the VAE decode split in row bands over every rank of the world (``xfuse.parallel.vae_decode``,
    exact); ``auto`` does so when the world has more than one rank and the image has at least
    ``VAE_PARALLEL_MIN_PIXELS`` pixels (``xfuse.parallel.vae_decode.decodes_in_parallel``), where it was measured to
    gain. ``video_patches``: how a video family's patches cut the clip (``xfuse.parallel.video_layout``):
    ``temporal``, runs of consecutive frames (the model's own token order), or ``spatial``, strips of rows across
    every frame. ``text_encoder``: where the text encoders run (``xfuse.perf.memory.text_encoder_placement``):
    ``rank0``, whole on global rank 0's device; ``split``, each text encoder's layers split over the pipeline group
    of rank 0, every rank running its layers once per prompt and handing the hidden state on
    (``xfuse.parallel.text_encoder_split``; a text encoder whose layers cannot be split stays whole on rank 0);
    ``offload``, on rank 0 with its weights in host memory, each module streamed to the device when it runs;
    ``auto``, the first of these three with which every rank fits its device's memory (``rank0`` where the memory is
    not known: a CPU). ``adapter``: what runs a rank's share of the transformer: ``family``, the family's hand-written
    stage; ``generic``, the model's own diffusers forward driven through its context-parallel plan and attention
    dispatcher (``xfuse.families.generic``; a family with a ``ForwardPlan``, checked by ``ModelSpec.check_layout``).
    """

    SECTION: ClassVar[str] = "parallel"
    pipefusion_degree: Annotated[int, Field(ge=1, le=MAX_PIPEFUSION_DEGREE)] = 1
    num_patches: PositiveInt | None = None
    warmup_steps: Annotated[int, Field(ge=0)] = 1
    cfg_degree: Annotated[
        int,
        Field(
            ge=1, le=2, description="1 or 2 (2 runs the unconditional and conditional CFG branches on two rank groups)"
        ),
    ] = 1
    placement: Placement | None = None
    stage_split: Annotated[
        tuple[PositiveInt, ...] | None,
        Field(
            strict=False,  # a YAML list becomes a tuple; its entries stay strict integers
            description="a list of positive block counts, one per PipeFusion rank (parallel.pipefusion_degree "
            "entries), or null",
        ),
    ] = None
    ulysses_degree: Annotated[
        SequenceDegree,
        Field(
            description=f"1 to {MAX_SEQUENCE_DEGREE} (ranks per pipeline stage splitting heads by all-to-all; at "
            "most the model's attention heads)"
        ),
    ] = 1
    ring_degree: Annotated[
        SequenceDegree,
        Field(description=f"1 to {MAX_SEQUENCE_DEGREE} (ranks per pipeline stage passing K/V blocks around a ring)"),
    ] = 1
    vae_parallel: Annotated[VaeParallel, BeforeValidator(yaml_switch)] = "auto"
    video_patches: VideoPatches = "temporal"
    text_encoder: TextEncoderPlacement = "auto"
    adapter: Adapter = "family"

    @model_validator(mode="after")
    def _one_split_entry_per_rank(self) -> Self:
        if self.stage_split is not None and len(self.stage_split) != self.pipefusion_degree:
            raise ConfigError(
                "parallel.stage_split",
                f"must be a list of positive block counts, one per PipeFusion rank (parallel.pipefusion_degree = "
                f"{self.pipefusion_degree} entries), or null; it has {len(self.stage_split)} entries "
                f"(got {list(self.stage_split)!r})",
            )
        return self

    @property
    def sequence_degree(self) -> int:
        """Ranks of one sequence-parallel group: ``ulysses_degree * ring_degree``."""
        return self.ulysses_degree * self.ring_degree

    @property
    def world_size(self) -> int:
        """Ranks this layout needs: ``cfg_degree * pipefusion_degree * ulysses_degree * ring_degree``."""
        return self.cfg_degree * self.pipefusion_degree * self.sequence_degree

    @property
    def resolved_num_patches(self) -> int:
        """Number of patches M the engine uses: ``num_patches`` if set, else ``pipefusion_degree``."""
        return self.pipefusion_degree if self.num_patches is None else self.num_patches
