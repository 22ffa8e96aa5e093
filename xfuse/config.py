"""Validated configuration for xfuse, on pydantic.

Everything here is pure: no process group, no environment changes, no device queries at import or construction
(``torch`` is not even imported). Each section is a frozen pydantic dataclass (strict: ``"2"`` is not 2 and
``True`` is not 1; unknown keys are refused): pydantic checks the values against the field types and the allowed
values in :mod:`xfuse.types`, and :func:`_config_error` words its findings as xfuse's errors.

Every error is a :class:`ConfigError` whose ``.key`` is the full dotted key (``parallel.cfg_degree``) and whose
message reads ``<dotted.key>: <what is wrong and what is allowed> (got <repr>)``.

YAML layout (every key optional)::

    model: tiny                      # local diffusers folder, a preset (xfuse.families.registry), or shapes
    parallel: {pipefusion_degree: 2, num_patches: null, warmup_steps: 1, cfg_degree: 1,
               placement: null, stage_split: null, ulysses_degree: 1, ring_degree: 1,
               vae_parallel: auto}   # placement null: the model family's default
    comm:     {backend: auto, timeout_s: 60.0, max_inflight: 2, socket_ifname: null, wait: auto}
    runtime:  {device: auto, dtype: float32}
    generation: {prompt: "...", negative_prompt: null, height: null, width: null,
                 num_inference_steps: 20, guidance_scale: 5.0, seed: 0,
                 num_frames: null, fps: 16}   # num_frames, fps: video models only (Wan)
    serve:    {host: 127.0.0.1, port: 8000, model_name: null, max_queue: 8, max_images_per_request: 4,
               max_side: 2048, max_pixels: 4194304, max_steps: 100, max_prompt_chars: 4000,
               max_body_bytes: 1048576, request_timeout_s: 300.0, heartbeat_interval_s: 1.0,
               heartbeat_timeout_s: 2.0}   # xfuse serve only; generation holds the requests' defaults

Checks that need the model (block count, patch size, image size) are its family's (``ModelSpec.check_layout``), and
the world size is checked where the world is joined (``xfuse.runtime.world.init_parallel``); both run before any
communication.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.fields import FieldInfo

from xfuse.errors import ConfigError
from xfuse.types import Backend, Device, DtypeName, Placement, VaeParallel, VideoPatches, Wait

MAX_PIPEFUSION_DEGREE = 8
MAX_SEQUENCE_DEGREE = 16  # Ulysses or Ring ranks of one SP group (16: two nodes of 8)
# vae_parallel: auto decodes over the world from this many image pixels on. Measured (benchmarks/bench_vae.py, the
# shipped VAE, 2 ranks over gloo, docs/performance.md): 0.70x of rank 0 alone at 256 x 256 px (the messages of ~50
# layers cost more than half a small decode), 1.08x at 384 x 384, 1.55x at 512 x 512. A wider VAE gains sooner.
VAE_PARALLEL_MIN_PIXELS = 384 * 384
MAX_SEED = 2**63 - 1  # fits int64, so per-patch generator seeds can be derived without overflow surprises


def _yaml_switch(value: Any) -> Any:
    """``on`` / ``off`` as written: YAML 1.1 (PyYAML) reads the bare words as booleans, so ``vae_parallel: on`` in a
    file arrives as ``True``. Only real booleans are mapped; every other value is validated as given."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


# ----------------------------------------------------------------------------------------------------------------
# Field shapes: pydantic enforces the constraints, and _allowed() words an error from the same constraints
# ----------------------------------------------------------------------------------------------------------------


class Allowed(str):
    """Field metadata: what a value must be, in words, where the constraint alone would not say why."""


NonEmptyStr = Annotated[str, Field(pattern=r"\S")]
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a served LoRA adapter's name (serve.lora_adapters)
PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0.0)]
StageSplit = Annotated[
    tuple[PositiveInt, ...] | None,
    Field(strict=False),  # a YAML list becomes a tuple; its entries stay strict integers
    Allowed("a list of positive block counts, one per PipeFusion rank (parallel.pipefusion_degree entries), or null"),
]

# Settings are exact: strict types, unknown keys refused, floats finite.
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

# Common spellings of allowed values, for the did-you-mean hint only (never accepted silently).
_ALIASES = {
    "gpu": "cuda",
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """``int | None`` -> ``(int, True)``; ``int`` -> ``(int, False)``."""
    args = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return annotation, False


def _range_text(metadata: Sequence[Any]) -> str:
    lo = next((m.ge for m in metadata if isinstance(m, annotated_types.Ge)), None)
    hi = next((m.le for m in metadata if isinstance(m, annotated_types.Le)), None)
    above = next((m.gt for m in metadata if isinstance(m, annotated_types.Gt)), None)
    if above is not None:
        return f" > {above}"
    if lo is not None and hi is not None:
        return f" from {lo} to {hi}"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def _field_shape(info: FieldInfo) -> tuple[Any, bool, list[Any]]:
    """A field's base type, whether it may be null, and its constraints (``PositiveInt | None`` keeps them inside)."""
    base, nullable = _unwrap_optional(info.annotation)
    metadata = list(info.metadata)
    if get_origin(base) is Annotated:
        for m in base.__metadata__:
            metadata.extend(m.metadata if isinstance(m, FieldInfo) else [m])
        base = get_args(base)[0]
    return base, nullable, metadata


def _allowed(info: FieldInfo) -> str:
    """What a field's value must be, in words, from its type and constraints (or its :class:`Allowed` text)."""
    base, nullable, metadata = _field_shape(info)
    for m in metadata:
        if isinstance(m, Allowed):
            return str(m)
    if get_origin(base) is Literal:
        text = "one of " + ", ".join(repr(c) if isinstance(c, str) else str(c) for c in get_args(base))
    elif base is int:
        text = "an integer" + _range_text(metadata)
    elif base is float:
        text = "a finite number" + _range_text(metadata)
    elif base is str:
        nonempty = any(getattr(m, "pattern", None) for m in metadata)
        text = "a non-empty string" if nonempty else "a string"
    else:
        text = f"a {getattr(base, '__name__', base)}"
    return text + (" or null" if nullable else "")


def _type_hint(value: Any, base: Any) -> str:
    if value is None:
        return ", not null"
    if base is str:
        return " (quote it in YAML)"
    if isinstance(value, bool):
        return ", not a boolean"
    if isinstance(value, str):
        return ", not a string" + (" (write numbers without quotes)" if base in (int, float) else "")
    return f", not {type(value).__name__}"


def _choice_hint(value: Any, choices: Sequence[Any]) -> str:
    if not isinstance(value, str):
        return ""
    if value.lower() in _ALIASES and _ALIASES[value.lower()] in choices:
        return f"; did you mean {_ALIASES[value.lower()]!r}?"
    close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _config_error(cls: type, prefix: str, exc: ValidationError, given: Mapping[str, Any]) -> ConfigError:
    """pydantic's first finding about ``cls(**given)``, as a :class:`ConfigError` naming the dotted key, what is
    allowed and what was given. Unknown keys are reported first; an error a check raised itself passes through."""
    errors = sorted(exc.errors(), key=lambda e: e["type"] not in ("unexpected_keyword_argument", "extra_forbidden"))
    error = errors[0]
    raised = error.get("ctx", {}).get("error")
    if isinstance(raised, ConfigError):
        return raised
    name, *inner = error["loc"] or ("",)
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        return _unknown_key_error(prefix or None, name, _field_names(cls))
    info = cls.__pydantic_fields__[name]
    key = f"{prefix}.{name}" if prefix else str(name)
    value = given.get(name, error["input"])
    base, _, _ = _field_shape(info)
    if inner and get_origin(base) is dict:  # a mapping's entry
        problem = "must be a non-empty string" if error["type"] == "string_pattern_mismatch" else error["msg"].lower()
        what = f"; entry {inner[0]!r}: {problem}"
    elif inner:  # an entry of a list
        what = f"; entry {inner[0]} is not a positive integer"
    elif error["type"].endswith("_type"):
        what = _type_hint(value, base)
    elif error["type"] == "literal_error":
        what = _choice_hint(value, get_args(base))
    else:
        what = ""
        if base is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # what the check saw
    value_text = list(value) if isinstance(value, tuple) else value
    return ConfigError(key, f"must be {_allowed(info)}{what} (got {value_text!r})")


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


_T = TypeVar("_T")


def section(name: str) -> Callable[[type[_T]], type[_T]]:
    """Make ``cls`` the frozen, strict pydantic dataclass of config section ``name``; building it with a wrong value
    raises a :class:`ConfigError` (``dataclasses.replace`` re-validates the same way)."""

    def wrap(cls: type[_T]) -> type[_T]:
        cls = pydantic_dataclass(frozen=True, config=_STRICT)(cls)
        cls.SECTION = name  # type: ignore[attr-defined]
        validated_init = cls.__init__

        @functools.wraps(validated_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                validated_init(self, *args, **kwargs)
            except ValidationError as exc:
                given = {**dict(zip(_field_names(cls), args, strict=False)), **kwargs}
                raise _config_error(cls, name, exc, given) from None

        cls.__init__ = __init__  # type: ignore[method-assign]
        return cls

    return wrap


# ----------------------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------------------


class _Section:
    """Shared helpers of the sections. ``SECTION`` is the YAML section name (the key prefix)."""

    SECTION: ClassVar[str] = ""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return _field_names(cls)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None):
        """Build from a plain mapping, refusing unknown keys (with a did-you-mean)."""
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            raise ConfigError(cls.SECTION, f"must be a mapping with keys {', '.join(cls.keys())} (got {d!r})")
        for k in d:  # before any value: a misspelt key explains the values that follow
            if k not in cls.keys():
                raise _unknown_key_error(cls.SECTION, k, cls.keys())
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@section("parallel")
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
    ``VAE_PARALLEL_MIN_PIXELS`` pixels, where it was measured to gain.
    ``video_patches``: how a video family's patches cut the clip (``xfuse.parallel.video_layout``): ``temporal``,
    runs of consecutive frames (the model's own token order), or ``spatial``, strips of rows across every frame.
    """

    pipefusion_degree: Annotated[int, Field(ge=1, le=MAX_PIPEFUSION_DEGREE)] = 1
    num_patches: PositiveInt | None = None
    warmup_steps: Annotated[int, Field(ge=0)] = 1
    cfg_degree: Annotated[
        int,
        Field(ge=1, le=2),
        Allowed("1 or 2 (2 runs the unconditional and conditional CFG branches on two rank groups)"),
    ] = 1
    placement: Placement | None = None
    stage_split: StageSplit = None
    ulysses_degree: Annotated[
        int,
        Field(ge=1, le=MAX_SEQUENCE_DEGREE),
        Allowed(
            f"1 to {MAX_SEQUENCE_DEGREE} (ranks per pipeline stage splitting heads by all-to-all; must divide "
            "the model's attention heads)"
        ),  # fmt: skip
    ] = 1
    ring_degree: Annotated[
        int,
        Field(ge=1, le=MAX_SEQUENCE_DEGREE),
        Allowed(f"1 to {MAX_SEQUENCE_DEGREE} (ranks per pipeline stage passing K/V blocks around a ring)"),
    ] = 1
    vae_parallel: Annotated[VaeParallel, BeforeValidator(_yaml_switch)] = "auto"
    video_patches: VideoPatches = "temporal"

    def __post_init__(self) -> None:
        if self.stage_split is not None and len(self.stage_split) != self.pipefusion_degree:
            raise ConfigError(
                "parallel.stage_split",
                f"must be a list of positive block counts, one per PipeFusion rank (parallel.pipefusion_degree = "
                f"{self.pipefusion_degree} entries), or null; it has {len(self.stage_split)} entries "
                f"(got {list(self.stage_split)!r})",
            )

    @property
    def sequence_degree(self) -> int:
        """Ranks of one sequence-parallel group: ``ulysses_degree * ring_degree``."""
        return self.ulysses_degree * self.ring_degree

    @property
    def resolved_num_patches(self) -> int:
        """Number of patches M the engine uses: ``num_patches`` if set, else ``pipefusion_degree``."""
        return self.pipefusion_degree if self.num_patches is None else self.num_patches

    def vae_on_every_rank(self, world_size: int) -> bool:
        """Whether every rank loads the VAE (to decode its band when a call decodes in parallel): unless
        ``vae_parallel`` is ``off`` or the world has one rank, where rank 0 alone holds it."""
        return self.vae_parallel != "off" and world_size > 1

    def decodes_in_parallel(self, world_size: int, height: int, width: int, latent_rows: int) -> bool:
        """Whether a ``height`` x ``width`` px request (``latent_rows`` rows of latent) is decoded over every rank
        (``vae_parallel``). ``on`` with fewer latent rows than ranks is refused (:class:`ConfigError`): a band needs
        at least one row."""
        if not self.vae_on_every_rank(world_size):
            return False
        if latent_rows < world_size:
            if self.vae_parallel == "on":
                raise ConfigError(
                    "parallel.vae_parallel",
                    f"is on, but the latent has {latent_rows} rows for {world_size} ranks (one band of rows each): "
                    "use auto or off, or a taller image",
                )
            return False
        return self.vae_parallel == "on" or height * width >= VAE_PARALLEL_MIN_PIXELS


@section("comm")
class CommConfig(_Section):
    """Point-to-point communication settings. ``backend: auto`` means NCCL on CUDA, gloo on CPU.

    ``wait``: how a rank waits for a message (``xfuse.comm.p2p``). ``stream``: queued on the CUDA stream, the host
    goes on, a watchdog thread bounds it by ``timeout_s``; ``host``: the host blocks until the message is there,
    bounded by ``timeout_s`` (on CUDA one host/device synchronisation per message); ``auto``: stream on CUDA, host on
    CPU. ``stream`` on CPU runs the watchdog path over gloo (whose waits block anyway): a drill of the GPU path's
    failure handling.
    """

    backend: Backend = "auto"
    timeout_s: Seconds = 60.0
    max_inflight: PositiveInt = 2
    socket_ifname: NonEmptyStr | None = None
    wait: Wait = "auto"

    def stream_ordered(self, device_type: str) -> bool:
        """Whether waits are stream-ordered on a device type (``"cuda"`` or ``"cpu"``); pure, no device query."""
        return self.wait == "stream" or (self.wait == "auto" and device_type == "cuda")

    def resolved_backend(self, device_type: str) -> str:
        """The process-group backend for a device type (``"cuda"`` or ``"cpu"``); pure, no device query."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if device_type == "cuda" else "gloo"


@section("cache")
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

    method: Literal["off", "first_block", "taylor"] = "off"
    threshold: Annotated[float, Field(ge=0.0)] = 0.05
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    max_skips: PositiveInt | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@section("runtime")
class RuntimeConfig(_Section):
    """Device and dtype. ``device: auto`` means CUDA when available (resolved at launch, not here)."""

    device: Device = "auto"
    dtype: DtypeName = "float32"

    def torch_dtype(self):
        """The ``torch.dtype`` for :attr:`dtype` (imports torch lazily)."""
        import torch

        return getattr(torch, self.dtype)


@section("generation")
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
    diffusers' ``controlnet_conditioning_scale``, ``control_guidance_start`` and ``control_guidance_end``.
    """

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
    lora: Annotated[
        dict[NonEmptyStr, float], Allowed("a mapping of LoRA files or folders to their weights (numbers)")
    ] = dataclasses.field(default_factory=dict)
    # xfuse generate: a ControlNet (a diffusers ControlNet folder) and its control image, as diffusers' arguments
    controlnet: NonEmptyStr | None = None
    control_image: NonEmptyStr | None = None
    controlnet_conditioning_scale: Annotated[float, Field(ge=0.0)] = 1.0
    control_guidance_start: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    control_guidance_end: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0

    def __post_init__(self) -> None:
        for path in self.lora:
            if not os.path.exists(path):
                raise ConfigError("generation.lora", f"no LoRA file or folder at {path!r}")
        if self.image is not None and not os.path.isfile(self.image):
            raise ConfigError(
                "generation.image",
                f"must be an image file, the first frame of an image-to-video clip (not found: {self.image!r})",
            )
        self._check_controlnet()

    def _check_controlnet(self) -> None:
        if self.controlnet is not None and not os.path.isfile(os.path.join(self.controlnet, "config.json")):
            raise ConfigError(
                "generation.controlnet",
                f"must be a local diffusers ControlNet folder, with config.json (not found in {self.controlnet!r})",
            )
        if self.control_image is not None and not os.path.isfile(self.control_image):
            raise ConfigError("generation.control_image", f"must be an image file (not found: {self.control_image!r})")
        if (self.controlnet is None) != (self.control_image is None):
            given, missing = (
                ("generation.controlnet", "generation.control_image")
                if self.control_image is None
                else ("generation.control_image", "generation.controlnet")
            )
            raise ConfigError(missing, f"is needed with {given} (a ControlNet runs on a control image)")
        if self.controlnet is not None and self.image is not None:
            raise ConfigError("generation.controlnet", "does not run with generation.image (image-to-video)")
        # An empty window: the ControlNet would act in no step (diffusers' SD3 and FLUX pipelines run it at scale 0)
        if self.control_guidance_start >= self.control_guidance_end:
            raise ConfigError(
                "generation.control_guidance_start",
                f"must be below generation.control_guidance_end (got {self.control_guidance_start} >= "
                f"{self.control_guidance_end})",
            )


@section("serve")
class ServeConfig(_Section):
    """``xfuse serve``: where it listens and what one request may ask for. The ``generation`` section gives the
    defaults of a request's optional fields (size, steps, guidance, negative prompt)."""

    host: NonEmptyStr = "127.0.0.1"  # loopback unless the operator opens it
    port: Annotated[int, Field(ge=0, le=65535)] = 8000  # 0: any free port (printed at start-up)
    model_name: NonEmptyStr | None = None  # the id in /v1/models and the requests' ``model``; null: the model's name
    max_queue: PositiveInt = 8  # requests waiting behind the running one; more get 429 + Retry-After
    max_images_per_request: PositiveInt = 4  # the largest ``n``
    max_side: Annotated[int, Field(ge=16)] = 2048  # pixels, width and height alike
    max_pixels: Annotated[int, Field(ge=256)] = 2048 * 2048  # width x height
    max_steps: PositiveInt = 100  # the largest ``num_inference_steps``
    max_prompt_chars: PositiveInt = 4000
    max_body_bytes: Annotated[int, Field(ge=1024)] = 1 << 20  # larger request bodies get 413 before they are read
    request_timeout_s: Seconds = 300.0  # a request not started within this is answered 503 and never runs
    heartbeat_interval_s: Seconds = 1.0  # rank 0 -> every rank while idle
    heartbeat_timeout_s: Seconds = 2.0  # a rank that does not answer within this is lost: the world stops
    # LoRA adapters every rank loads at start-up (name -> local file or folder); a request picks them by name
    lora_adapters: Annotated[
        dict[str, NonEmptyStr], Allowed("a mapping of adapter names to LoRA files or folders (paths on every rank)")
    ] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, path in self.lora_adapters.items():
            if not ADAPTER_NAME.fullmatch(name):
                raise ConfigError(
                    "serve.lora_adapters",
                    f"adapter names are 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit "
                    f"(got {name!r})",
                )
            if not os.path.exists(path):  # as generation.lora: refused when the config is read, on every rank
                raise ConfigError(f"serve.lora_adapters.{name}", f"no LoRA file or folder at {path!r}")
        if self.heartbeat_interval_s > 1.0:
            raise ConfigError(
                "serve.heartbeat_interval_s",
                f"must be at most 1.0 s: a dead or stalled rank must be noticed within about 2 s of idle time "
                f"(got {self.heartbeat_interval_s!r})",
            )


_SECTIONS: dict[str, type[_Section]] = {
    c.SECTION: c for c in (ParallelConfig, CommConfig, CacheConfig, RuntimeConfig, GenerationConfig, ServeConfig)
}
TOP_LEVEL_KEYS: tuple[str, ...] = ("model", *_SECTIONS)


def _unknown_key_error(section: str | None, key: Any, known: Sequence[str]) -> ConfigError:
    """``section.key: unknown key; did you mean ...? (allowed: ...)``. Also spots a key put in the wrong section."""
    dotted = f"{section}.{key}" if section else str(key)
    what = "unknown key" if section else "unknown section"
    hint = ""
    if isinstance(key, str):
        close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {(section + '.' if section else '') + close[0]!r}?"
        else:
            homes = [s for s, c in _SECTIONS.items() if s != section and key in c.keys()]
            if homes:
                where = "another section" if section else "a section"
                hint = f"; it is a key of {where}: write it under '{homes[0]}:' ({homes[0]}.{key})"
    return ConfigError(dotted, f"{what}{hint} (allowed: {', '.join(known)}) (got {key!r})")


# ----------------------------------------------------------------------------------------------------------------
# Whole config
# ----------------------------------------------------------------------------------------------------------------

_S = TypeVar("_S", bound=_Section)


def _section_config(cls: type[_S], x: Any) -> _S:
    if x is None:
        return cls()
    if isinstance(x, cls):
        return x
    if isinstance(x, XfuseConfig):
        return getattr(x, cls.SECTION)
    if isinstance(x, Mapping):
        return cls.from_dict(x)
    raise ConfigError(
        cls.SECTION, f"must be a {cls.__name__} or a mapping with keys {', '.join(cls.keys())} (got {x!r})"
    )


def _given_section(cls: type[_Section], *, none_is_none: bool = False) -> Any:
    """A section field of :class:`XfuseConfig`: given as the section, a mapping, or None (the defaults; for the
    request sections, none at all)."""

    def build(x: Any) -> Any:
        return None if (x is None and none_is_none) else _section_config(cls, x)

    return BeforeValidator(build)


@section("")
class XfuseConfig:
    """The whole configuration. Sections may be given as their dataclasses or as plain dicts (they are validated)."""

    model: NonEmptyStr = "tiny"
    parallel: Annotated[ParallelConfig, _given_section(ParallelConfig)] = Field(default_factory=ParallelConfig)
    comm: Annotated[CommConfig, _given_section(CommConfig)] = Field(default_factory=CommConfig)
    cache: Annotated[CacheConfig, _given_section(CacheConfig)] = Field(default_factory=CacheConfig)
    runtime: Annotated[RuntimeConfig, _given_section(RuntimeConfig)] = Field(default_factory=RuntimeConfig)
    generation: Annotated[GenerationConfig | None, _given_section(GenerationConfig, none_is_none=True)] = Field(
        default_factory=GenerationConfig
    )
    serve: Annotated[ServeConfig | None, _given_section(ServeConfig, none_is_none=True)] = Field(
        default_factory=ServeConfig
    )

    def __post_init__(self) -> None:
        p, g = self.parallel, self.generation
        # Cross-section checks that need no world and no model.
        if g is not None and p.warmup_steps > g.num_inference_steps:
            raise ConfigError(
                "parallel.warmup_steps",
                f"must be <= generation.num_inference_steps ({g.num_inference_steps}); "
                f"warm-up = all steps runs every step on the whole image (got {p.warmup_steps})",
            )
        if g is not None and p.cfg_degree == 2 and g.guidance_scale <= 1.0:
            raise ConfigError(
                "parallel.cfg_degree",
                f"2 needs classifier-free guidance, which diffusers runs only when "
                f"generation.guidance_scale > 1 (guidance_scale is {g.guidance_scale}); use "
                f"cfg_degree 1 or a larger guidance_scale (got {p.cfg_degree})",
            )
        if self.serve is not None and self.serve.heartbeat_interval_s >= self.comm.timeout_s:
            raise ConfigError(
                "serve.heartbeat_interval_s",
                f"must be below comm.timeout_s ({self.comm.timeout_s} s), or idle ranks waiting for the next "
                f"heartbeat time out (got {self.serve.heartbeat_interval_s!r})",
            )
        if self.comm.backend == "nccl" and self.runtime.device == "cpu":
            raise ConfigError(
                "comm.backend",
                "'nccl' needs CUDA tensors but runtime.device is 'cpu'; use 'gloo' or 'auto', "
                "or set runtime.device to 'cuda' or 'auto' (got 'nccl')",
            )

    @property
    def world_size(self) -> int:
        """Ranks this config needs: ``cfg_degree * pipefusion_degree * ulysses_degree * ring_degree``."""
        par = self.parallel
        return par.cfg_degree * par.pipefusion_degree * par.sequence_degree

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists, no tuples); round-trips through :func:`config_from_dict` and YAML."""
        sections = {name: getattr(self, name) for name in _SECTIONS}
        return {"model": self.model, **{name: None if s is None else s.to_dict() for name, s in sections.items()}}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def parallel_config(x: ParallelConfig | Mapping[str, Any] | None) -> ParallelConfig:
    """Accept a :class:`ParallelConfig`, a plain dict with the same keys, an :class:`XfuseConfig`, or None."""
    return _section_config(ParallelConfig, x)


def comm_config(x: CommConfig | Mapping[str, Any] | None) -> CommConfig:
    """Accept a :class:`CommConfig`, a plain dict with the same keys, an :class:`XfuseConfig`, or None."""
    return _section_config(CommConfig, x)


def cache_config(x: CacheConfig | Mapping[str, Any] | None) -> CacheConfig:
    """Accept a :class:`CacheConfig`, a plain dict with the same keys, an :class:`XfuseConfig`, or None."""
    return _section_config(CacheConfig, x)


def config_from_dict(d: Mapping[str, Any] | None) -> XfuseConfig:
    """Validate a plain nested dict (as read from YAML) into an :class:`XfuseConfig`."""
    if d is None:
        d = {}
    if not isinstance(d, Mapping):
        raise ConfigError("config", f"must be a mapping with sections {', '.join(TOP_LEVEL_KEYS)} (got {d!r})")
    for k in d:
        if k not in TOP_LEVEL_KEYS:
            raise _unknown_key_error(None, k, TOP_LEVEL_KEYS)
    # A section written with no keys (``parallel:``) is that section's defaults, request sections included.
    return XfuseConfig(**{k: (_SECTIONS[k].from_dict(v) if k in _SECTIONS else v) for k, v in d.items()})


# ----------------------------------------------------------------------------------------------------------------
# YAML loading and --set overrides
# ----------------------------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e3`` / ``5e-1`` as floats (YAML 1.2; PyYAML's 1.1 rules need a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_override(text: str) -> tuple[str, Any]:
    """``"parallel.stage_split=[3,5]"`` -> ``("parallel.stage_split", [3, 5])``; the value is a YAML scalar/list."""
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError("--set", f"must be KEY=VALUE, e.g. parallel.warmup_steps=2 (got {text!r})")
    key, raw = text.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if len(parts) == 1:
        if key == "model":
            pass
        elif key in _SECTIONS:
            raise ConfigError(
                key, f"is a section; set one of its keys, e.g. {key}.{_SECTIONS[key].keys()[0]}=... (got {text!r})"
            )
        else:
            raise (
                _unknown_key_error(None, key, TOP_LEVEL_KEYS)
                if key
                else ConfigError("--set", f"must be KEY=VALUE with a non-empty KEY (got {text!r})")
            )
    elif len(parts) == 2:
        section, name = parts
        if section == "model":
            raise ConfigError("model", f"is a plain string, set it with model=VALUE (got {text!r})")
        if section not in _SECTIONS:
            raise _unknown_key_error(None, section, TOP_LEVEL_KEYS)
        if name not in _SECTIONS[section].keys():
            raise _unknown_key_error(section, name, _SECTIONS[section].keys())
    else:
        raise ConfigError(key, f"keys have the form SECTION.KEY (or model), e.g. parallel.num_patches (got {text!r})")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(
            key,
            f"value is not valid YAML ({exc.__class__.__name__}); quote strings that contain "
            f"':' or start with '[' (got {raw!r})",
        ) from None
    return key, value


def apply_overrides(d: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of the raw nested dict ``d`` with ``--set`` style overrides applied (later ones win)."""
    if isinstance(overrides, str):  # a bare string would be iterated character by character
        overrides = [overrides]
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in d.items()}
    for text in overrides:
        key, value = parse_override(text)
        if "." not in key:
            out[key] = value
            continue
        section, name = key.split(".")
        current = out.get(section)
        if current is None:
            current = {}
        elif not isinstance(current, dict):
            raise ConfigError(
                section, f"must be a mapping with keys {', '.join(_SECTIONS[section].keys())} (got {current!r})"
            )
        current[name] = value
        out[section] = current
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a config file into a raw dict (no validation beyond 'it is a mapping')."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_Loader)
    except FileNotFoundError:
        raise ConfigError(p, f"config file not found (looked at {os.path.abspath(p)!r})") from None
    except IsADirectoryError:
        raise ConfigError(p, "is a directory, expected a YAML config file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(p, f"not valid YAML: {exc}") from None
    if data is None:  # empty file: all defaults
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            p,
            f"the top level must be a mapping with sections {', '.join(TOP_LEVEL_KEYS)} "
            f"(got a {type(data).__name__}: {data!r})",
        )
    return data


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> XfuseConfig:
    """Load a YAML file (or start from defaults when ``path`` is None), apply ``--set`` overrides, validate."""
    raw = read_yaml(path) if path is not None else {}
    return config_from_dict(apply_overrides(raw, overrides))


__all__ = [
    "MAX_PIPEFUSION_DEGREE",
    "MAX_SEQUENCE_DEGREE",
    "TOP_LEVEL_KEYS",
    "CommConfig",
    "ConfigError",
    "GenerationConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "ServeConfig",
    "XfuseConfig",
    "apply_overrides",
    "comm_config",
    "config_from_dict",
    "load_config",
    "parallel_config",
    "parse_override",
    "read_yaml",
]
