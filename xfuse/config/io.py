"""Reading a config: YAML files (with YAML 1.2's floats) and ``--set KEY=VALUE`` overrides, into the raw nested dict
that :func:`xfuse.config.config_from_dict` validates. Keys are checked there, once (unknown keys and sections with a
did-you-mean); here only the shape of an override (``model=VALUE`` or ``SECTION.KEY=VALUE``) and the YAML."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from xfuse.config.whole import SECTIONS, TOP_LEVEL_KEYS, XfuseConfig, config_from_dict
from xfuse.errors import ConfigError


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
    section, _, name = key.partition(".")
    if not key:
        raise ConfigError("--set", f"must be KEY=VALUE with a non-empty KEY (got {text!r})")
    if "." in name:
        raise ConfigError(key, f"keys have the form SECTION.KEY (or model), e.g. parallel.num_patches (got {text!r})")
    if section == "model" and name:
        raise ConfigError("model", f"is a plain string, set it with model=VALUE (got {text!r})")
    if section in SECTIONS and not name:
        example = next(iter(SECTIONS[section].model_fields))
        raise ConfigError(key, f"is a section; set one of its keys, e.g. {key}.{example}=... (got {text!r})")
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
        section, _, name = key.partition(".")
        if not name:
            out[key] = value
            continue
        current = {} if out.get(section) is None else out[section]
        if not isinstance(current, dict):
            raise ConfigError(section, f"must be a mapping of keys to set {key} in (got {current!r})")
        out[section] = {**current, name: value}
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


__all__ = ["apply_overrides", "load_config", "parse_override", "read_yaml"]
