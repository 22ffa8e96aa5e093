"""Validated configuration for xfuse, on pydantic.

Everything here is pure: no process group, no environment changes, no device queries, no file reads at import or
construction (``torch`` is not even imported). Each section is a frozen, strict pydantic model (``"2"`` is not 2,
``True`` is not 1, floats are finite, unknown keys are refused): pydantic checks the values against the field types,
their ranges and the allowed values in :mod:`xfuse.types`; one ``model_validator`` per rule that reads two keys. YAML
files and ``--set`` overrides are read by :mod:`xfuse.config_io`; the files a config names are checked where they are
opened (``xfuse.build.check_files``).

Every error is a :class:`ConfigError` whose ``.key`` is the full dotted key (``parallel.cfg_degree``) and whose
message reads ``<dotted.key>: <what is wrong and what is allowed> (got <repr>)`` (:func:`_config_error` words
pydantic's findings so).

YAML layout (every key optional)::

    model: tiny                      # local diffusers folder, a preset (xfuse.families.registry), or shapes
    parallel: {pipefusion_degree: 2, num_patches: null, warmup_steps: 1, cfg_degree: 1,
               placement: null, stage_split: null, ulysses_degree: 1, ring_degree: 1,
               vae_parallel: auto, video_patches: temporal,
               text_encoder: auto}   # placement null: the model family's default
    comm:     {backend: auto, timeout_s: 60.0, max_inflight: 2, socket_ifname: null, wait: auto,
               host_timeout_s: auto}
    cache:    {method: off, threshold: 0.05, warmup_steps: 0, max_skips: null}
    compile:  {mode: off, backend: inductor, dynamic: false, warmup_sizes: [], max_shapes: 8, cache_dir: null,
               timeout_s: 900.0}
    runtime:  {device: auto, dtype: float32}
    generation: {prompt: "...", negative_prompt: null, height: null, width: null,
                 num_inference_steps: 20, guidance_scale: 5.0, seed: 0,
                 num_frames: null, fps: 16, image: null,     # num_frames, fps, image: video models only (Wan)
                 lora: {}, controlnet: null, control_image: null, controlnet_conditioning_scale: 1.0,
                 control_guidance_start: 0.0, control_guidance_end: 1.0}   # xfuse generate's LoRA and ControlNet
    serve:    {host: 127.0.0.1, port: 8000, model_name: null, max_queue: 8, max_queued_work: auto,
               max_images_per_request: 4, max_batch: 1, batch_max_pixels: 262144, max_inflight: 1,
               max_side: 2048, max_pixels: 4194304, max_steps: 100, max_prompt_chars: 4000,
               max_body_bytes: 1048576, request_timeout_s: 300.0, heartbeat_interval_s: 1.0,
               heartbeat_timeout_s: 2.0, lora_adapters: {}}   # xfuse serve only; generation: the requests' defaults

Checks that need the model (block count, patch size, image size) are its family's (``ModelSpec.check_layout``), and
the world size is checked where the world is joined (``xfuse.runtime.world.init_parallel``); both run before any
communication.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from typing_extensions import Self

from xfuse.errors import ConfigError
from xfuse.types import Backend, Device, DtypeName, Placement, TextEncoderPlacement, VaeParallel, VideoPatches, Wait

MAX_PIPEFUSION_DEGREE = 8
MAX_SEQUENCE_DEGREE = 16  # Ulysses or Ring ranks of one SP group (16: two nodes of 8)
MAX_SEED = 2**63 - 1  # fits int64, so per-patch generator seeds can be derived without overflow surprises


def _yaml_switch(value: Any) -> Any:
    """``on`` / ``off`` as written: YAML 1.1 (PyYAML) reads the bare words as booleans, so ``vae_parallel: on`` in a
    file arrives as ``True``. Only real booleans are mapped; every other value is validated as given."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


NonEmptyStr = Annotated[str, Field(pattern=r"\S")]
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a served LoRA adapter's name (serve.lora_adapters)
PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0.0)]
SequenceDegree = Annotated[int, Field(ge=1, le=MAX_SEQUENCE_DEGREE)]

# --- pydantic's findings as ConfigErrors ----------------------------------------------------------------------------
# What a key allows is read from its JSON schema (pydantic's own account of the type, range and choices; a field's
# ``description`` where those alone would not say why).

# Common spellings of allowed values, for the did-you-mean hint only (never accepted silently).
_ALIASES = dict(gpu="cuda", fp32="float32", float="float32", fp16="float16", half="float16", bf16="bfloat16")
_KINDS = {"integer": "an integer", "number": "a finite number", "string": "a string", "array": "a list"}
_TYPES = {bool: "a boolean", str: "a string", type(None): "null"}


def _allowed(schema: dict[str, Any], base: dict[str, Any]) -> str:
    """What a key's value must be, in words: ``an integer from 1 to 8``, ``one of 'a', 'b' or null``."""
    if "description" in schema:
        return schema["description"]
    if "enum" in base:
        text = "one of " + ", ".join(map(repr, base["enum"]))
    else:
        text = "a non-empty string" if "pattern" in base else _KINDS.get(str(base.get("type")), f"a {base.get('type')}")
        lo, hi = base.get("minimum"), base.get("maximum")
        if "exclusiveMinimum" in base:
            text += f" > {base['exclusiveMinimum']}"
        elif lo is not None:
            text += f" from {lo} to {hi}" if hi is not None else f" >= {lo}"
    return text + (" or null" if "anyOf" in schema else "")


def _hint(error: Mapping[str, Any], value: Any, base: dict[str, Any], inner: list[Any]) -> str:
    """What is wrong beyond the range: an entry of a list or mapping, a wrong type, a near miss of a choice."""
    kind = base.get("type")
    if inner and kind in ("array", "object"):  # (a union's member tag is no entry: its description says it all)
        problem = error["msg"]
        if error["type"] == "string_pattern_mismatch":  # NonEmptyStr's pattern, or a format the key names
            pattern = error.get("ctx", {}).get("pattern")
            problem = (
                "must be a non-empty string" if pattern == r"\S" else f"{error['input']!r} does not match {pattern}"
            )
        return f"; entry {inner[0]!r}: {problem[0].lower()}{problem[1:]}"
    if error["type"] == "literal_error" and isinstance(value, str):
        guess = _ALIASES.get(value.lower())
        close = [guess] if guess in base["enum"] else difflib.get_close_matches(value, base["enum"], n=1)
        return f"; did you mean {close[0]!r}?" if close else ""
    if not error["type"].endswith("_type"):
        return ""
    quoted = isinstance(value, str) and kind in ("integer", "number")
    return f", not {_TYPES.get(type(value), type(value).__name__)}" + (
        " (write numbers without quotes)" if quoted else ""
    )


def _config_error(cls: type[_Section], exc: ValidationError, given: Any) -> ConfigError:
    """pydantic's first finding about ``given`` (the input of ``cls``) as a :class:`ConfigError` naming the dotted
    key, what is allowed and what was given. Unknown keys come first; a validator's own ConfigError passes through."""
    error = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    if isinstance(raised := error.get("ctx", {}).get("error"), ConfigError):
        return raised
    loc = list(error["loc"])
    if cls is XfuseConfig and len(loc) > 1:  # a key of a section
        cls, given = SECTIONS[str(loc[0])], given.get(loc[0]) if isinstance(given, Mapping) else None
        loc = loc[1:]
    if error["type"] == "model_type":  # a section (or the whole config) that is not a mapping
        section = SECTIONS[str(loc[0])] if loc else cls
        key = section.SECTION or "config"
        return ConfigError(
            key, f"must be a mapping with keys {', '.join(section.model_fields)} (got {error['input']!r})"
        )
    name, *inner = loc
    if error["type"] == "extra_forbidden":
        return _unknown_key_error(cls.SECTION or None, name, tuple(cls.model_fields))
    schema = cls.model_json_schema()["properties"][name]
    base = next((s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"), schema)
    value = given[name] if isinstance(given, Mapping) and name in given else error["input"]
    what = _hint(error, value, base, inner)
    if base.get("type") == "number" and type(value) is int:
        value = float(value)  # what the check saw
    shown = list(value) if isinstance(value, tuple) else value
    key = f"{cls.SECTION}.{name}" if cls.SECTION else str(name)
    return ConfigError(key, f"must be {_allowed(schema, base)}{what} (got {shown!r})")


def _unknown_key_error(section: str | None, key: Any, known: tuple[str, ...]) -> ConfigError:
    """``section.key: unknown key; did you mean ...? (allowed: ...)``. Also spots a key put in the wrong section."""
    dotted = f"{section}.{key}" if section else str(key)
    hint = ""
    close = difflib.get_close_matches(key, known, n=1) if isinstance(key, str) else []
    if close:
        hint = f"; did you mean {(section + '.' if section else '') + close[0]!r}?"
    elif homes := [s for s, c in SECTIONS.items() if s != section and key in c.model_fields]:
        hint = f"; it is a key of {'another section' if section else 'a section'}: write it under '{homes[0]}:' "
        hint += f"({homes[0]}.{key})"
    what = "unknown key" if section else "unknown section"
    return ConfigError(dotted, f"{what}{hint} (allowed: {', '.join(known)}) (got {key!r})")


# --- Sections --------------------------------------------------------------------------------------------------------


class _Section(BaseModel):
    """A config section: strict, frozen, unknown keys refused; built from keywords or (``model_validate``) from a
    mapping or the section itself, a wrong value raising a :class:`ConfigError`. ``SECTION``: its YAML name."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)
    SECTION: ClassVar[str] = ""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _config_error(type(self), exc, data) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        """The section from itself, a mapping of its keys, or None (its defaults)."""
        try:
            return super().model_validate({} if obj is None else obj, *args, **kwargs)
        except ValidationError as exc:
            raise _config_error(cls, exc, obj) from None

    def with_changes(self, **changes: Any) -> Self:
        """A copy with ``changes``, validated again (``model_copy(update=...)`` would not)."""
        return type(self)(**{**dict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain nested data (lists, no tuples); round-trips through :func:`config_from_dict` and YAML."""
        return self.model_dump(mode="json")


class ParallelConfig(_Section):
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
    not known: a CPU).
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
    vae_parallel: Annotated[VaeParallel, BeforeValidator(_yaml_switch)] = "auto"
    video_patches: VideoPatches = "temporal"
    text_encoder: TextEncoderPlacement = "auto"

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


class CommConfig(_Section):
    """Point-to-point communication settings. ``backend: auto`` means NCCL on CUDA, gloo on CPU.

    ``wait``: how a rank waits for a message (``xfuse.comm.p2p``). ``stream``: queued on the CUDA stream, the host
    goes on, a watchdog thread bounds it by ``timeout_s``; ``host``: the host blocks until the message is there,
    bounded by ``timeout_s`` (on CUDA one host/device synchronisation per message); ``auto``: stream on CUDA, host on
    CPU. ``stream`` on CPU runs the watchdog path over gloo (whose waits block anyway): a drill of the GPU path's
    failure handling.

    ``host_timeout_s``: how long a rank's host may go without finishing a task of the denoising loop outside its waits
    for messages before it reports ``HostStalled`` and the world stops (``xfuse.runtime.host_deadline``: a host blocked
    inside CUDA, where no wait runs to time out). ``auto``: twice ``timeout_s`` on CUDA, ``off`` on CPU, where the host
    computes each task itself and a large model's task has no bound.
    """

    SECTION: ClassVar[str] = "comm"
    backend: Backend = "auto"
    timeout_s: Seconds = 60.0
    max_inflight: PositiveInt = 2
    socket_ifname: NonEmptyStr | None = None
    wait: Wait = "auto"
    host_timeout_s: Annotated[
        Seconds | Literal["auto", "off"],
        BeforeValidator(_yaml_switch),  # ``--set comm.host_timeout_s=off`` arrives as False
        Field(description="'auto', 'off' or a finite number of seconds > 0"),
    ] = "auto"

    def resolved_host_timeout_s(self, device_type: str) -> float | None:
        """``host_timeout_s`` on a device type (``"cuda"`` or ``"cpu"``): seconds, or None for off; pure."""
        if self.host_timeout_s == "off" or (self.host_timeout_s == "auto" and device_type != "cuda"):
            return None
        return 2 * self.timeout_s if self.host_timeout_s == "auto" else float(self.host_timeout_s)

    def stream_ordered(self, device_type: str) -> bool:
        """Whether waits are stream-ordered on a device type (``"cuda"`` or ``"cpu"``); pure, no device query."""
        return self.wait == "stream" or (self.wait == "auto" and device_type == "cuda")

    def resolved_backend(self, device_type: str) -> str:
        """The process-group backend for a device type (``"cuda"`` or ``"cpu"``); pure, no device query."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if device_type == "cuda" else "gloo"


class CacheConfig(_Section):
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
    method: Annotated[Literal["off", "first_block", "taylor"], BeforeValidator(_yaml_switch)] = "off"
    threshold: Annotated[float, Field(ge=0.0)] = 0.05
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    max_skips: PositiveInt | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "off"


class CompileConfig(_Section):
    """Regional ``torch.compile`` of each rank's blocks (``xfuse.parallel.regional_compile``): every block a rank keeps
    compiled in place, the blocks of one class sharing their graphs, the attention's K/V bookkeeping left eager.

    ``mode``: ``off`` or ``regional``. ``backend``: ``torch.compile``'s (``inductor``; ``aot_eager`` traces without
    generating code). ``dynamic``: ``torch.compile``'s (false: a graph per shape, and a rank sees few: the whole
    image, its patches, the text's lengths). ``warmup_sizes``: the request sizes (``WIDTHxHEIGHT``) compiled before
    the first request (empty: ``xfuse generate`` its request's size, ``xfuse serve`` its default size).
    ``max_shapes``: request shapes compiled per denoising engine at most; a request of a further shape runs eagerly
    on every rank and is counted. ``cache_dir``: where each rank keeps its compiled artefacts between launches (keyed
    by torch, model, layout and backend; null: none kept). ``timeout_s``: how long one rank may spend compiling one
    request shape; past it the rank names itself and the world stops.
    """

    SECTION: ClassVar[str] = "compile"
    mode: Annotated[Literal["off", "regional"], BeforeValidator(_yaml_switch)] = "off"
    backend: NonEmptyStr = "inductor"
    dynamic: bool = False
    warmup_sizes: list[Annotated[str, Field(pattern=r"^[1-9][0-9]*x[1-9][0-9]*$")]] = Field(
        default_factory=list, description="a list of request sizes 'WIDTHxHEIGHT' in pixels, e.g. ['1024x1024']"
    )
    max_shapes: PositiveInt = 8
    cache_dir: NonEmptyStr | None = None
    timeout_s: Seconds = 900.0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def warmup(self) -> list[tuple[int, int]]:
        """``warmup_sizes`` as (width, height) pairs."""
        return [(int(w), int(h)) for w, h in (size.split("x") for size in self.warmup_sizes)]


class RuntimeConfig(_Section):
    """Device and dtype. ``device: auto`` means CUDA when available (resolved at launch, not here)."""

    SECTION: ClassVar[str] = "runtime"
    device: Device = "auto"
    dtype: DtypeName = "float32"

    def torch_dtype(self):
        """The ``torch.dtype`` for :attr:`dtype` (imports torch lazily)."""
        import torch

        return getattr(torch, self.dtype)


class GenerationConfig(_Section):
    """One request's parameters. ``height``/``width`` ``None`` means the model's default size.

    Video models only (``ModelSpec.video``; image models ignore them): ``num_frames`` ``None`` means the model's default
    clip (a preset's own, else the diffusers pipeline's: Wan 81); whether the VAE takes it (Wan: 4k + 1) needs the
    model and is checked by ``xfuse.build.default_video_size``. ``fps``: the frame rate ``xfuse generate`` writes.
    ``image``: image-to-video, the path of the clip's first frame (a family with an image-to-video pipeline on the same
    transformer: Wan 2.2 TI2V; ``xfuse.build.pipeline_class`` checks the model). ``lora``: ``xfuse generate``'s
    adapters and weights (``xfuse.build.check_lora_family`` checks the model; ``xfuse serve`` has its own,
    ``serve.lora_adapters``, picked per request). ``controlnet``: ``xfuse generate``'s ControlNet, a local diffusers
    ControlNet folder (SD3 / SD3.5 and FLUX.1 models; ``xfuse.build`` checks the model), with ``control_image`` and
    diffusers' ``controlnet_conditioning_scale``, ``control_guidance_start`` and ``control_guidance_end``. Whether the
    files exist is checked where they are opened (``xfuse.build.check_files``).
    """

    SECTION: ClassVar[str] = "generation"
    prompt: str = "A cat sitting on a windowsill at sunset, watercolor"
    negative_prompt: str | None = None
    height: PositiveInt | None = None
    width: PositiveInt | None = None
    num_inference_steps: PositiveInt = 20
    guidance_scale: Annotated[float, Field(ge=0.0)] = 5.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    num_frames: PositiveInt | None = None
    # 16, not diffusers' export_to_video default of 10: Wan 2.1's released examples export at fps=16 (diffusers'
    # WanPipeline example, the Wan2.1 repository's sample_fps), its 81-frame default being a 5 s clip.
    fps: PositiveInt = 16
    image: NonEmptyStr | None = None
    # xfuse generate: LoRA files or folders applied to the run, with their weights (SD3 / SD3.5, FLUX.1 and Wan models)
    lora: dict[NonEmptyStr, float] = Field(
        default_factory=dict, description="a mapping of LoRA files or folders to their weights (numbers)"
    )
    # xfuse generate: a ControlNet (a diffusers ControlNet folder) and its control image, as diffusers' arguments
    controlnet: NonEmptyStr | None = None
    control_image: NonEmptyStr | None = None
    controlnet_conditioning_scale: Annotated[float, Field(ge=0.0)] = 1.0
    control_guidance_start: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    control_guidance_end: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0

    @model_validator(mode="after")
    def _controlnet_with_its_image(self) -> Self:
        if (self.controlnet is None) != (self.control_image is None):
            given, missing = (
                ("controlnet", "control_image") if self.control_image is None else ("control_image", "controlnet")
            )
            raise ConfigError(
                f"generation.{missing}", f"is needed with generation.{given} (a ControlNet runs on a control image)"
            )
        return self

    @model_validator(mode="after")
    def _controlnet_without_image_to_video(self) -> Self:
        if self.controlnet is not None and self.image is not None:
            raise ConfigError("generation.controlnet", "does not run with generation.image (image-to-video)")
        return self

    @model_validator(mode="after")
    def _control_window_not_empty(self) -> Self:
        # An empty window: the ControlNet would act in no step (diffusers' SD3 and FLUX pipelines run it at scale 0)
        if self.control_guidance_start >= self.control_guidance_end:
            raise ConfigError(
                "generation.control_guidance_start",
                f"must be below generation.control_guidance_end (got {self.control_guidance_start} >= "
                f"{self.control_guidance_end})",
            )
        return self


class ServeConfig(_Section):
    """``xfuse serve``: where it listens and what one request may ask for. The ``generation`` section gives the
    defaults of a request's optional fields (size, steps, guidance, negative prompt)."""

    SECTION: ClassVar[str] = "serve"
    host: NonEmptyStr = "127.0.0.1"  # loopback unless the operator opens it
    port: Annotated[int, Field(ge=0, le=65535)] = 8000  # 0: any free port (printed at start-up)
    model_name: NonEmptyStr | None = None  # the id in /v1/models and the requests' ``model``; null: the model's name
    max_queue: PositiveInt = 8  # requests waiting behind the running one; more get 429 + Retry-After
    # the work waiting behind the running request, in megapixel-steps (width x height x steps x images / 10^6);
    # auto: max_queue requests of the default size and steps. A request that would pass it gets 429 + Retry-After
    max_queued_work: Annotated[
        Annotated[float, Field(gt=0.0)] | Literal["auto"],
        Field(description="'auto' or a number of megapixel-steps > 0"),
    ] = "auto"
    max_images_per_request: PositiveInt = 4  # the largest ``n``
    # requests the loop runs in one pipeline call (one image each, the same size, steps, guidance, negative prompt and
    # adapters, at most batch_max_pixels pixels); 1: one request at a time
    max_batch: PositiveInt = 1
    batch_max_pixels: Annotated[int, Field(ge=256)] = 512 * 512  # measured: batches of 4 still 1.12x at 512² here
    # pipeline calls (each a batch, or one request) the loop streams through the pipeline together when they queue
    # together with the same adapters: the next one's patches enter while the last one's leave
    # (xfuse.parallel.request_stream); not with sequence parallelism or compile; 1: one call at a time
    max_inflight: PositiveInt = 1
    max_side: Annotated[int, Field(ge=16)] = 2048  # pixels, width and height alike
    max_pixels: Annotated[int, Field(ge=256)] = 2048 * 2048  # width x height
    max_steps: PositiveInt = 100  # the largest ``num_inference_steps``
    max_prompt_chars: PositiveInt = 4000
    max_body_bytes: Annotated[int, Field(ge=1024)] = 1 << 20  # larger request bodies get 413 before they are read
    request_timeout_s: Seconds = 300.0  # a request not started within this is answered 503 and never runs
    heartbeat_interval_s: Annotated[  # rank 0 -> every rank while idle
        float,
        Field(
            gt=0.0,
            le=1.0,
            description="a number of seconds > 0 and at most 1.0 s: a dead or stalled rank must be noticed within "
            "about 2 s of idle time",
        ),
    ] = 1.0
    heartbeat_timeout_s: Seconds = 2.0  # a rank that does not answer within this is lost: the world stops
    # LoRA adapters every rank loads at start-up (name -> local file or folder); a request picks them by name
    lora_adapters: dict[str, NonEmptyStr] = Field(
        default_factory=dict, description="a mapping of adapter names to LoRA files or folders (paths on every rank)"
    )

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name in adapters:
            if not ADAPTER_NAME.fullmatch(name):
                raise ConfigError(
                    "serve.lora_adapters",
                    f"adapter names are 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit "
                    f"(got {name!r})",
                )
        return adapters


# --- Whole config ----------------------------------------------------------------------------------------------------


class XfuseConfig(_Section):
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
        """The bound of the longest wait for a message: ``comm.timeout_s``, and with ``compile.mode: regional``
        ``compile.timeout_s`` on top (the waits of a request whose peers compile new shapes first: a peer's compile
        bound ends the world naming that peer before a wait for it runs out)."""
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


SECTIONS = {
    c.SECTION: c
    for c in (ParallelConfig, CommConfig, CacheConfig, CompileConfig, RuntimeConfig, GenerationConfig, ServeConfig)
}
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


__all__ = ["MAX_PIPEFUSION_DEGREE", "MAX_SEED", "MAX_SEQUENCE_DEGREE", "SECTIONS", "TOP_LEVEL_KEYS", "ConfigError"]
__all__ += [
    "CacheConfig",
    "CommConfig",
    "CompileConfig",
    "GenerationConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "ServeConfig",
]
__all__ += ["XfuseConfig", "cache_config", "comm_config", "compile_config", "config_from_dict", "parallel_config"]
