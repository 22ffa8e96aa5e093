"""``cache`` and ``compile``: the two ways a run goes faster on the same layout, skipping steps' blocks (step caching)
and compiling each rank's blocks (regional ``torch.compile``) or each stage pass as one captured graph."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator
from typing_extensions import Self

from xfuse.config.section import NonEmptyStr, PositiveInt, Seconds, Section, yaml_switch
from xfuse.errors import ConfigError


class CacheConfig(Section):
    """Step caching (``xfuse.parallel.step_cache``): skip a step's blocks after the first where the first block's
    residual barely changed since the last computed step, and add each skipped segment's cached residual instead.

    ``method``: ``off``; ``first_block`` (First-Block Cache, as diffusers' ``FirstBlockCacheConfig``: the cached
    residual as it was); ``taylor`` (the same decisions; the residual predicted to first order from the last two
    computed steps, TaylorSeer's Taylor step). ``threshold``: skip when the mean absolute change of the first block's
    residual, relative to its mean absolute value at the last computed step, is at most this (diffusers' default
    0.05; 0 skips only an unchanged residual). ``warmup_steps``: the first steps, always computed. ``max_skips``: at
    most this many steps skipped in a row (null: no limit, as diffusers).
    """

    SECTION: ClassVar[str] = "cache"
    method: Annotated[Literal["off", "first_block", "taylor"], BeforeValidator(yaml_switch)] = "off"
    threshold: Annotated[float, Field(ge=0.0)] = 0.05
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    max_skips: PositiveInt | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "off"


class CompileConfig(Section):
    """Compiling each rank's stage: its blocks (``regional``), or each stage pass as one graph captured once and
    replayed (``graphs``, ``regional+graphs``).

    ``mode``: ``off``; ``regional`` (``xfuse.parallel.regional_compile``: every block a rank keeps compiled in place,
    the blocks of one class sharing their graphs, the attention's K/V bookkeeping left eager); ``graphs``
    (``xfuse.parallel.pass_graphs``: each stage pass traced as one graph per pass kind and captured as a CUDA graph
    of its eager kernels, replayed every later step); ``regional+graphs`` (the same graphs compiled by Inductor, then
    captured). On a CPU nothing is captured: the graphs run as traced. ``backend``: ``torch.compile``'s
    (``inductor``; ``aot_eager`` traces without generating code; ``regional+graphs`` takes Inductor's; ``graphs``
    reads none: its kernels are the eager ones).
    ``dynamic``: ``torch.compile``'s (false: a graph per shape, and a rank sees few: the whole image, its patches,
    the text's lengths). ``warmup_sizes``: the request sizes (``WIDTHxHEIGHT``) compiled before
    the first request (empty: ``xfuse generate`` its request's size, ``xfuse serve`` its default size).
    ``max_shapes``: request shapes compiled per denoising engine at most; a request of a further shape runs eagerly
    on every rank and is counted. ``cache_dir``: where each rank keeps its compiled artefacts between launches (keyed
    by torch, model, layout and backend; null: none kept). ``timeout_s``: how long one rank may spend compiling one
    request shape; past it the rank names itself and the world stops.
    """

    SECTION: ClassVar[str] = "compile"
    mode: Annotated[Literal["off", "regional", "graphs", "regional+graphs"], BeforeValidator(yaml_switch)] = "off"
    backend: NonEmptyStr = "inductor"
    dynamic: bool = False
    warmup_sizes: list[Annotated[str, Field(pattern=r"^[1-9][0-9]*x[1-9][0-9]*$")]] = Field(
        default_factory=list, description="a list of request sizes 'WIDTHxHEIGHT' in pixels, e.g. ['1024x1024']"
    )
    max_shapes: PositiveInt = 8
    cache_dir: NonEmptyStr | None = None
    timeout_s: Seconds = 900.0

    @model_validator(mode="after")
    def _captured_inductor_is_inductors(self) -> Self:
        if self.mode == "regional+graphs" and self.backend != "inductor":
            raise ConfigError(
                "compile.backend",
                f"must be 'inductor' with compile.mode regional+graphs (Inductor's kernels captured as CUDA graphs); "
                f"use mode graphs to capture another backend's eager kernels (got {self.backend!r})",
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def graphs(self) -> bool:
        """Whether each stage pass runs as one captured graph (``graphs``, ``regional+graphs``)."""
        return self.mode in ("graphs", "regional+graphs")

    @property
    def warmup(self) -> list[tuple[int, int]]:
        """``warmup_sizes`` as (width, height) pairs."""
        return [(int(w), int(h)) for w, h in (size.split("x") for size in self.warmup_sizes)]
