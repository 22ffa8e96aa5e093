"""Validated configuration for xfuse.

Everything here is pure: no process group, no environment changes, no device queries at import or construction
(``torch`` is not even imported). Style model: torchtitan's ``ParallelDims`` -- a frozen dataclass that validates
itself in ``__post_init__`` and fails with a readable message.

Every error is a :class:`ConfigError` whose ``.key`` is the full dotted key (``parallel.cfg_degree``) and whose
message reads ``<dotted.key>: <what is wrong and what is allowed> (got <repr>)``.

YAML layout (every key optional)::

    model: tiny                      # local diffusers folder, a preset (xfuse.families.registry), or shapes
    parallel: {pipefusion_degree: 2, num_patches: null, warmup_steps: 1, cfg_degree: 1,
               placement: null, stage_split: null}   # placement null: the model family's default
    comm:     {backend: auto, timeout_s: 60.0, max_inflight: 2, socket_ifname: null, wait: auto}
    runtime:  {device: auto, dtype: float32}
    generation: {prompt: "...", negative_prompt: null, height: null, width: null,
                 num_inference_steps: 20, guidance_scale: 5.0, seed: 0}
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
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from xfuse.errors import ConfigError
from xfuse.parallel.stage_plan import PLACEMENTS

# ----------------------------------------------------------------------------------------------------------------
# Allowed values
# ----------------------------------------------------------------------------------------------------------------

# PLACEMENTS ("balanced", "folded", "linear") is the planner's own list, imported from xfuse.parallel.stage_plan.
BACKENDS: tuple[str, ...] = ("auto", "nccl", "gloo")
WAITS: tuple[str, ...] = ("auto", "stream", "host")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
MAX_PIPEFUSION_DEGREE = 8
CFG_DEGREES: tuple[int, ...] = (1, 2)
MAX_SEED = 2**63 - 1  # fits int64, so per-patch generator seeds can be derived without overflow surprises


# ----------------------------------------------------------------------------------------------------------------
# Small validators (each returns the value, possibly normalised: int -> float for float fields, list -> tuple)
# ----------------------------------------------------------------------------------------------------------------


def _type_hint(value: Any) -> str:
    if isinstance(value, bool):
        return ", not a boolean"
    if isinstance(value, str):
        return ", not a string (write numbers without quotes)"
    return f", not {type(value).__name__}"


def _range_text(lo: int | float | None, hi: int | float | None) -> str:
    if lo is not None and hi is not None:
        return f"from {lo} to {hi}"
    if lo is not None:
        return f">= {lo}"
    if hi is not None:
        return f"<= {hi}"
    return ""


def _check_int(
    key: str, value: Any, *, lo: int | None = None, hi: int | None = None, allow_none: bool = False
) -> int | None:
    allowed = " ".join(p for p in ("an integer", _range_text(lo, hi)) if p)
    if allow_none:
        allowed += " or null"
    if value is None:
        if allow_none:
            return None
        raise ConfigError(key, f"must be {allowed}, not null (got None)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be {allowed}{_type_hint(value)} (got {value!r})")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(key, f"must be {allowed} (got {value!r})")
    return value


def _check_float(key: str, value: Any, *, lo: float, lo_inclusive: bool) -> float:
    allowed = f"a finite number {'>=' if lo_inclusive else '>'} {lo}"
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = ", not null" if value is None else _type_hint(value)
        raise ConfigError(key, f"must be {allowed}{hint} (got {value!r})")
    value = float(value)
    if not math.isfinite(value) or value < lo or (value == lo and not lo_inclusive):
        raise ConfigError(key, f"must be {allowed} (got {value!r})")
    return value


# Common spellings of allowed values, for the did-you-mean hint only (never accepted silently).
_ALIASES = {
    "gpu": "cuda",
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}


def _check_choice(key: str, value: Any, choices: Sequence[Any]) -> Any:
    # bool == 1 in Python; never let True pass as 1.
    if isinstance(value, bool) or value not in choices or type(value) is not type(choices[0]):
        allowed = ", ".join(repr(c) if isinstance(c, str) else str(c) for c in choices)
        hint = ""
        if isinstance(value, str) and value.lower() in _ALIASES and _ALIASES[value.lower()] in choices:
            hint = f"; did you mean {_ALIASES[value.lower()]!r}?"
        elif isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
            if close:
                hint = f"; did you mean {close[0]!r}?"
        raise ConfigError(key, f"must be one of {allowed}{hint} (got {value!r})")
    return value


def _check_str(key: str, value: Any, *, allow_none: bool = False, nonempty: bool = False) -> str | None:
    allowed = ("a non-empty string" if nonempty else "a string") + (" or null" if allow_none else "")
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise ConfigError(key, f"must be {allowed} (quote it in YAML) (got {value!r})")
    if nonempty and not value.strip():
        raise ConfigError(key, f"must be {allowed} (got {value!r})")
    return value


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclass: normalise in __post_init__


# ----------------------------------------------------------------------------------------------------------------
# Section dataclasses
# ----------------------------------------------------------------------------------------------------------------


class _Section:
    """Shared helpers for the section dataclasses. ``SECTION`` is the YAML section name (the key prefix)."""

    SECTION: ClassVar[str] = ""

    def _key(self, name: str) -> str:
        return f"{self.SECTION}.{name}"

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None):
        """Build from a plain mapping, refusing unknown keys (with a did-you-mean)."""
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            raise ConfigError(cls.SECTION, f"must be a mapping with keys {', '.join(cls.keys())} (got {d!r})")
        for k in d:
            if k not in cls.keys():
                raise _unknown_key_error(cls.SECTION, k, cls.keys())
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True)
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
    """

    SECTION: ClassVar[str] = "parallel"

    pipefusion_degree: int = 1
    num_patches: int | None = None
    warmup_steps: int = 1
    cfg_degree: int = 1
    placement: str | None = None
    stage_split: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_int(self._key("pipefusion_degree"), self.pipefusion_degree, lo=1, hi=MAX_PIPEFUSION_DEGREE)
        _check_int(self._key("num_patches"), self.num_patches, lo=1, allow_none=True)
        _check_int(self._key("warmup_steps"), self.warmup_steps, lo=0)
        if (
            isinstance(self.cfg_degree, bool)
            or self.cfg_degree not in CFG_DEGREES
            or not isinstance(self.cfg_degree, int)
        ):
            raise ConfigError(
                self._key("cfg_degree"),
                f"must be 1 or 2 (2 runs the unconditional and conditional CFG branches on two "
                f"rank groups) (got {self.cfg_degree!r})",
            )
        if self.placement is not None:
            _check_choice(self._key("placement"), self.placement, PLACEMENTS)
        _set(self, "stage_split", self._checked_split())

    def _checked_split(self) -> tuple[int, ...] | None:
        key, split = self._key("stage_split"), self.stage_split
        if split is None:
            return None
        what = (
            "a list of positive block counts, one per PipeFusion rank "
            f"(parallel.pipefusion_degree = {self.pipefusion_degree} entries), or null"
        )
        if isinstance(split, (str, bytes)) or not isinstance(split, Sequence):
            raise ConfigError(key, f"must be {what} (got {split!r})")
        for i, n in enumerate(split):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(key, f"must be {what}; entry {i} is not a positive integer (got {list(split)!r})")
        if len(split) != self.pipefusion_degree:
            raise ConfigError(key, f"must be {what}; it has {len(split)} entries (got {list(split)!r})")
        return tuple(split)

    @property
    def resolved_num_patches(self) -> int:
        """Number of patches M the engine uses: ``num_patches`` if set, else ``pipefusion_degree``."""
        return self.pipefusion_degree if self.num_patches is None else self.num_patches


@dataclass(frozen=True)
class CommConfig(_Section):
    """Point-to-point communication settings. ``backend: auto`` means NCCL on CUDA, gloo on CPU.

    ``wait``: how a rank waits for a message (``xfuse.comm.p2p``). ``stream``: queued on the CUDA stream, the host
    goes on, a watchdog thread bounds it by ``timeout_s``; ``host``: the host blocks until the message is there,
    bounded by ``timeout_s`` (on CUDA one host/device synchronisation per message); ``auto``: stream on CUDA, host on
    CPU. ``stream`` on CPU runs the watchdog path over gloo (whose waits block anyway): a drill of the GPU path's
    failure handling.
    """

    SECTION: ClassVar[str] = "comm"

    backend: str = "auto"
    timeout_s: float = 60.0
    max_inflight: int = 2
    socket_ifname: str | None = None
    wait: str = "auto"

    def __post_init__(self) -> None:
        _check_choice(self._key("backend"), self.backend, BACKENDS)
        _set(self, "timeout_s", _check_float(self._key("timeout_s"), self.timeout_s, lo=0.0, lo_inclusive=False))
        _check_int(self._key("max_inflight"), self.max_inflight, lo=1)
        _check_str(self._key("socket_ifname"), self.socket_ifname, allow_none=True, nonempty=True)
        _check_choice(self._key("wait"), self.wait, WAITS)

    def stream_ordered(self, device_type: str) -> bool:
        """Whether waits are stream-ordered on a device type (``"cuda"`` or ``"cpu"``); pure, no device query."""
        return self.wait == "stream" or (self.wait == "auto" and device_type == "cuda")

    def resolved_backend(self, device_type: str) -> str:
        """The process-group backend for a device type (``"cuda"`` or ``"cpu"``); pure, no device query."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if device_type == "cuda" else "gloo"


@dataclass(frozen=True)
class RuntimeConfig(_Section):
    """Device and dtype. ``device: auto`` means CUDA when available (resolved at launch, not here)."""

    SECTION: ClassVar[str] = "runtime"

    device: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_choice(self._key("device"), self.device, DEVICES)
        _check_choice(self._key("dtype"), self.dtype, DTYPES)

    def torch_dtype(self):
        """The ``torch.dtype`` for :attr:`dtype` (imports torch lazily)."""
        import torch

        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class GenerationConfig(_Section):
    """One request's parameters. ``height``/``width`` ``None`` means the model's default size."""

    SECTION: ClassVar[str] = "generation"

    prompt: str = "A cat sitting on a windowsill at sunset, watercolor"
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int = 20
    guidance_scale: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_str(self._key("prompt"), self.prompt)
        _check_str(self._key("negative_prompt"), self.negative_prompt, allow_none=True)
        _check_int(self._key("height"), self.height, lo=1, allow_none=True)
        _check_int(self._key("width"), self.width, lo=1, allow_none=True)
        _check_int(self._key("num_inference_steps"), self.num_inference_steps, lo=1)
        _set(
            self,
            "guidance_scale",
            _check_float(self._key("guidance_scale"), self.guidance_scale, lo=0.0, lo_inclusive=True),
        )
        _check_int(self._key("seed"), self.seed, lo=0, hi=MAX_SEED)


@dataclass(frozen=True)
class ServeConfig(_Section):
    """``xfuse serve``: where it listens and what one request may ask for. The ``generation`` section gives the
    defaults of a request's optional fields (size, steps, guidance, negative prompt)."""

    SECTION: ClassVar[str] = "serve"

    host: str = "127.0.0.1"  # loopback unless the operator opens it
    port: int = 8000  # 0: any free port (printed at start-up)
    model_name: str | None = None  # the id in /v1/models and the requests' ``model``; null: the model's name
    max_queue: int = 8  # requests waiting behind the running one; more get 429 + Retry-After
    max_images_per_request: int = 4  # the largest ``n``
    max_side: int = 2048  # pixels, width and height alike
    max_pixels: int = 2048 * 2048  # width x height
    max_steps: int = 100  # the largest ``num_inference_steps``
    max_prompt_chars: int = 4000
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 before they are read
    request_timeout_s: float = 300.0  # a request not started within this is answered 503 and never runs
    heartbeat_interval_s: float = 1.0  # rank 0 -> every rank while idle
    heartbeat_timeout_s: float = 2.0  # a rank that does not answer within this is lost: the world stops

    def __post_init__(self) -> None:
        _check_str(self._key("host"), self.host, nonempty=True)
        _check_int(self._key("port"), self.port, lo=0, hi=65535)
        _check_str(self._key("model_name"), self.model_name, allow_none=True, nonempty=True)
        _check_int(self._key("max_queue"), self.max_queue, lo=1)
        _check_int(self._key("max_images_per_request"), self.max_images_per_request, lo=1)
        _check_int(self._key("max_side"), self.max_side, lo=16)
        _check_int(self._key("max_pixels"), self.max_pixels, lo=256)
        _check_int(self._key("max_steps"), self.max_steps, lo=1)
        _check_int(self._key("max_prompt_chars"), self.max_prompt_chars, lo=1)
        _check_int(self._key("max_body_bytes"), self.max_body_bytes, lo=1024)
        for name in ("request_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s"):
            _set(self, name, _check_float(self._key(name), getattr(self, name), lo=0.0, lo_inclusive=False))
        if self.heartbeat_interval_s > 1.0:
            raise ConfigError(
                self._key("heartbeat_interval_s"),
                f"must be at most 1.0 s: a dead or stalled rank must be noticed within about 2 s of idle time "
                f"(got {self.heartbeat_interval_s!r})",
            )


_SECTIONS: dict[str, type[_Section]] = {
    c.SECTION: c for c in (ParallelConfig, CommConfig, RuntimeConfig, GenerationConfig, ServeConfig)
}
TOP_LEVEL_KEYS: tuple[str, ...] = ("model", *_SECTIONS)
# Sections a pipeline built from Python has none of (None): the defaults of ``xfuse generate``'s and ``xfuse serve``'s
# requests, and the server's settings.
REQUEST_SECTIONS: tuple[str, ...] = ("generation", "serve")


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


@dataclass(frozen=True)
class XfuseConfig:
    """The whole configuration. Sections may be given as dataclasses or plain dicts (they are validated)."""

    model: str = "tiny"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    generation: GenerationConfig | None = field(default_factory=GenerationConfig)
    serve: ServeConfig | None = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        _check_str("model", self.model, nonempty=True)
        for name, cls in _SECTIONS.items():
            if name in REQUEST_SECTIONS and getattr(self, name) is None:
                continue  # no request defaults, no server: a pipeline built from Python
            _set(self, name, _section_config(cls, getattr(self, name)))
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
        """Ranks this config needs: ``pipefusion_degree * cfg_degree``."""
        return self.parallel.pipefusion_degree * self.parallel.cfg_degree

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists, no tuples); round-trips through :func:`config_from_dict` and YAML."""
        sections = {name: getattr(self, name) for name in _SECTIONS}
        return {"model": self.model, **{name: None if s is None else s.to_dict() for name, s in sections.items()}}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _section_config(cls: type[_Section], x: Any) -> Any:
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


def parallel_config(x: ParallelConfig | Mapping[str, Any] | None) -> ParallelConfig:
    """Accept a :class:`ParallelConfig`, a plain dict with the same keys, an :class:`XfuseConfig`, or None."""
    return _section_config(ParallelConfig, x)


def comm_config(x: CommConfig | Mapping[str, Any] | None) -> CommConfig:
    """Accept a :class:`CommConfig`, a plain dict with the same keys, an :class:`XfuseConfig`, or None."""
    return _section_config(CommConfig, x)


def runtime_config(x: RuntimeConfig | Mapping[str, Any] | None) -> RuntimeConfig:
    return _section_config(RuntimeConfig, x)


def generation_config(x: GenerationConfig | Mapping[str, Any] | None) -> GenerationConfig:
    return _section_config(GenerationConfig, x)


def serve_config(x: ServeConfig | Mapping[str, Any] | None) -> ServeConfig:
    return _section_config(ServeConfig, x)


def config_from_dict(d: Mapping[str, Any] | None) -> XfuseConfig:
    """Validate a plain nested dict (as read from YAML) into an :class:`XfuseConfig`."""
    if d is None:
        d = {}
    if not isinstance(d, Mapping):
        raise ConfigError("config", f"must be a mapping with sections {', '.join(TOP_LEVEL_KEYS)} (got {d!r})")
    for k in d:
        if k not in TOP_LEVEL_KEYS:
            raise _unknown_key_error(None, k, TOP_LEVEL_KEYS)
    kwargs: dict[str, Any] = {}
    if "model" in d:
        kwargs["model"] = d["model"]
    for name, cls in _SECTIONS.items():
        if name in d:
            kwargs[name] = cls.from_dict(d[name])
    return XfuseConfig(**kwargs)


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
    "BACKENDS",
    "CFG_DEGREES",
    "DEVICES",
    "DTYPES",
    "MAX_PIPEFUSION_DEGREE",
    "PLACEMENTS",
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
    "generation_config",
    "load_config",
    "parallel_config",
    "parse_override",
    "read_yaml",
    "runtime_config",
    "serve_config",
]
