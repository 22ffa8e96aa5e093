"""The whole configuration (:class:`XfuseConfig`: ``model`` and one field per section, and the rules that read keys of
two sections), the sections by YAML name, and a config from plain nested data."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import Field, field_validator, model_validator
from typing_extensions import Self

from xfuse.config.parallel import ParallelConfig
from xfuse.config.requests import GenerationConfig, ServeConfig
from xfuse.config.runtime import CommConfig, RuntimeConfig
from xfuse.config.section import NonEmptyStr, Section, sections
from xfuse.config.speed import CacheConfig, CompileConfig
from xfuse.errors import ConfigError


class XfuseConfig(Section):
    """The whole configuration. Sections may be given as their models or as plain mappings (they are validated);
    ``None`` is a section's defaults, and for ``generation`` and ``serve`` (the request sections) no section at all."""

    model: NonEmptyStr = "tiny"
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    generation: GenerationConfig | None = Field(default_factory=GenerationConfig)
    serve: ServeConfig | None = Field(default_factory=ServeConfig)

    @property
    def longest_wait_s(self) -> float:
        """The bound of the longest wait for a message: ``comm.timeout_s``, and with a ``compile.mode`` other than
        ``off`` ``compile.timeout_s`` on top (the waits of a request whose peers compile new shapes first: a peer's
        compile bound ends the world naming that peer before a wait for it runs out)."""
        return self.comm.timeout_s + (self.compile.timeout_s if self.compile.enabled else 0.0)

    @field_validator("parallel", "comm", "cache", "compile", "runtime", mode="before")
    @classmethod
    def _none_is_the_defaults(cls, value: Any) -> Any:
        return {} if value is None else value

    @model_validator(mode="after")
    def _warmup_within_the_steps(self) -> Self:
        p, g = self.parallel, self.generation
        if g is not None and p.warmup_steps > g.num_inference_steps:
            raise ConfigError(
                "parallel.warmup_steps",
                f"must be <= generation.num_inference_steps ({g.num_inference_steps}); "
                f"warm-up = all steps runs every step on the whole image (got {p.warmup_steps})",
            )
        return self

    @model_validator(mode="after")
    def _cfg_parallel_needs_guidance(self) -> Self:
        p, g = self.parallel, self.generation
        if g is not None and p.cfg_degree == 2 and g.guidance_scale <= 1.0:
            raise ConfigError(
                "parallel.cfg_degree",
                f"2 needs classifier-free guidance, which diffusers runs only when "
                f"generation.guidance_scale > 1 (guidance_scale is {g.guidance_scale}); use "
                f"cfg_degree 1 or a larger guidance_scale (got {p.cfg_degree})",
            )
        return self

    @model_validator(mode="after")
    def _heartbeat_within_the_comm_timeout(self) -> Self:
        if self.serve is not None and self.serve.heartbeat_interval_s >= self.comm.timeout_s:
            raise ConfigError(
                "serve.heartbeat_interval_s",
                f"must be below comm.timeout_s ({self.comm.timeout_s} s), or idle ranks waiting for the next "
                f"heartbeat time out (got {self.serve.heartbeat_interval_s!r})",
            )
        return self

    @model_validator(mode="after")
    def _streams_run_what_one_stage_state_holds(self) -> Self:
        if self.serve is None or self.serve.max_inflight == 1:
            return self
        p = self.parallel
        conflicts = [
            ("parallel.ulysses_degree", p.ulysses_degree != 1, "1"),
            ("parallel.ring_degree", p.ring_degree != 1, "1"),
            ("compile.mode", self.compile.enabled, "off"),
        ]
        for key, conflicts_with_streams, allowed in conflicts:
            if conflicts_with_streams:
                raise ConfigError(
                    "serve.max_inflight",
                    f"streams calls through the pipeline only with {key} {allowed} (each request's sequence-"
                    f"parallel exchanges and compiled shapes are its own); use 1, or {key} {allowed} "
                    f"(got {self.serve.max_inflight})",
                )
        return self

    @model_validator(mode="after")
    def _captured_passes_exchange_outside(self) -> Self:
        p = self.parallel
        if self.compile.graphs and p.sequence_degree > 1:
            raise ConfigError(
                "compile.mode",
                f"{self.compile.mode} captures whole stage passes, and sequence parallelism exchanges inside a pass "
                f"(parallel.ulysses_degree {p.ulysses_degree}, parallel.ring_degree {p.ring_degree}); use off or "
                f"regional with sequence parallelism, or both degrees 1 (got {self.compile.mode!r})",
            )
        return self

    @model_validator(mode="after")
    def _nccl_needs_cuda(self) -> Self:
        if self.comm.backend == "nccl" and self.runtime.device == "cpu":
            raise ConfigError(
                "comm.backend",
                "'nccl' needs CUDA tensors but runtime.device is 'cpu'; use 'gloo' or 'auto', "
                "or set runtime.device to 'cuda' or 'auto' (got 'nccl')",
            )
        return self

    @property
    def world_size(self) -> int:
        """Ranks this config needs (``ParallelConfig.world_size``)."""
        return self.parallel.world_size

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS = sections()  # parallel, comm, cache, compile, runtime, generation, serve: XfuseConfig's order
TOP_LEVEL_KEYS: tuple[str, ...] = tuple(XfuseConfig.model_fields)


# A section from itself, a mapping of its keys, or None (its defaults), as ``from_pretrained(parallel=...)`` takes it.
parallel_config = ParallelConfig.model_validate
comm_config = CommConfig.model_validate
cache_config = CacheConfig.model_validate
compile_config = CompileConfig.model_validate


def config_from_dict(d: Mapping[str, Any] | None) -> XfuseConfig:
    """Validate a plain nested dict (as read from YAML) into an :class:`XfuseConfig`. A section written with no keys
    (``parallel:``) is that section's defaults, the request sections' included."""
    if isinstance(d, Mapping):
        d = {k: {} if v is None and k in SECTIONS else v for k, v in d.items()}
    return XfuseConfig.model_validate(d)
