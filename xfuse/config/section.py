"""The base of every config section (strict, frozen, unknown keys refused; a wrong value a
:class:`~xfuse.errors.ConfigError` worded by :mod:`xfuse.config.messages`), the value types the sections share, and the
sections by YAML name."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from typing_extensions import Self

from xfuse.config.messages import config_error


def yaml_switch(value: Any) -> Any:
    """``on`` / ``off`` as written: YAML 1.1 (PyYAML) reads the bare words as booleans, so ``vae_parallel: on`` in a
    file arrives as ``True``. Only real booleans are mapped; every other value is validated as given."""
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


NonEmptyStr = Annotated[str, Field(pattern=r"\S")]
PositiveInt = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0.0)]

_DEFINED: dict[str, type[Section]] = {}  # the section classes by YAML name, the whole config's ("") among them


def sections() -> dict[str, type[Section]]:
    """Every section class by its YAML name, in the whole config's order (its fields': ``xfuse.config.whole``)."""
    return {name: _DEFINED[name] for name in _DEFINED[""].model_fields if name in _DEFINED}


class Section(BaseModel):
    """A config section: strict, frozen, unknown keys refused; built from keywords or (``model_validate``) from a
    mapping or the section itself, a wrong value raising a :class:`ConfigError`. ``SECTION``: its YAML name."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)
    SECTION: ClassVar[str] = ""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        _DEFINED.setdefault(cls.SECTION, cls)  # the first class of a name is the section (a subclass is no other)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(type(self), exc, data, sections()) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        """The section from itself, a mapping of its keys, or None (its defaults)."""
        try:
            return super().model_validate({} if obj is None else obj, *args, **kwargs)
        except ValidationError as exc:
            raise config_error(cls, exc, obj, sections()) from None

    def with_changes(self, **changes: Any) -> Self:
        """A copy with ``changes``, validated again (``model_copy(update=...)`` would not)."""
        return type(self)(**{**dict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain nested data (lists, no tuples); round-trips through ``xfuse.config.config_from_dict`` and YAML."""
        return self.model_dump(mode="json")
