"""pydantic's findings about a config worded as :class:`~xfuse.errors.ConfigError`: the dotted key, what it allows
and what was given (``<dotted.key>: <what is wrong and what is allowed> (got <repr>)``).

What a key allows is read from its JSON schema (pydantic's own account of the type, range and choices; a field's
``description`` where those alone would not say why). The functions are given the config's sections by YAML name
(``xfuse.config.section.sections``), to point a key written in the wrong section to its home; nothing here imports a
section.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from xfuse.errors import ConfigError

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


def config_error(cls: Any, exc: ValidationError, given: Any, sections: Mapping[str, Any]) -> ConfigError:
    """pydantic's first finding about ``given`` (the input of ``cls``, a section class or the whole config's, whose
    ``SECTION`` is empty) as a :class:`ConfigError` naming the dotted key, what is allowed and what was given; the
    config's ``sections`` by YAML name. Unknown keys come first; a validator's own ConfigError passes through."""
    error = min(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    if isinstance(raised := error.get("ctx", {}).get("error"), ConfigError):
        return raised
    loc = list(error["loc"])
    if not cls.SECTION and len(loc) > 1:  # a key of a section
        cls, given = sections[str(loc[0])], given.get(loc[0]) if isinstance(given, Mapping) else None
        loc = loc[1:]
    if error["type"] == "model_type":  # a section (or the whole config) that is not a mapping
        section = sections[str(loc[0])] if loc else cls
        key = section.SECTION or "config"
        return ConfigError(
            key, f"must be a mapping with keys {', '.join(section.model_fields)} (got {error['input']!r})"
        )
    name, *inner = loc
    if error["type"] == "extra_forbidden":
        return _unknown_key_error(cls.SECTION or None, name, tuple(cls.model_fields), sections)
    schema = cls.model_json_schema()["properties"][name]
    base = next((s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"), schema)
    value = given[name] if isinstance(given, Mapping) and name in given else error["input"]
    what = _hint(error, value, base, inner)
    if base.get("type") == "number" and type(value) is int:
        value = float(value)  # what the check saw
    shown = list(value) if isinstance(value, tuple) else value
    key = f"{cls.SECTION}.{name}" if cls.SECTION else str(name)
    return ConfigError(key, f"must be {_allowed(schema, base)}{what} (got {shown!r})")


def _unknown_key_error(
    section: str | None, key: Any, known: tuple[str, ...], sections: Mapping[str, Any]
) -> ConfigError:
    """``section.key: unknown key; did you mean ...? (allowed: ...)``. Also spots a key put in the wrong section."""
    dotted = f"{section}.{key}" if section else str(key)
    hint = ""
    close = difflib.get_close_matches(key, known, n=1) if isinstance(key, str) else []
    if close:
        hint = f"; did you mean {(section + '.' if section else '') + close[0]!r}?"
    elif homes := [s for s, c in sections.items() if s != section and key in c.model_fields]:
        hint = f"; it is a key of {'another section' if section else 'a section'}: write it under '{homes[0]}:' "
        hint += f"({homes[0]}.{key})"
    what = "unknown key" if section else "unknown section"
    return ConfigError(dotted, f"{what}{hint} (allowed: {', '.join(known)}) (got {key!r})")
