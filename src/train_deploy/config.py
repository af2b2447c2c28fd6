"""Validation of parameter blocks into typed dataclasses, once, at the edge.

Every stage declares its configuration as ``@dataclass(kw_only=True, slots=True)`` classes and builds
them with :func:`from_mapping`, which rejects unknown keys and wrong types with the dotted key in a
one-line message, e.g. ``corpus.tokenizer.vocab_size: expected int, got 'big'``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")


class ConfigError(ValueError):
    """A parameter block does not describe a valid configuration; the message names the key."""


def from_mapping(cls: type[T], data: Mapping[str, Any] | None, where: str) -> T:
    """Build dataclass ``cls`` from ``data``; ``where`` is the dotted name used in error messages."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (known: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], data[name], f"{where}.{name}") for name in fields if name in data}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{where}: {exc}") from None


def to_dict(obj: Any) -> dict[str, Any]:
    """Return a plain, JSON-ready dict of a (nested) configuration dataclass."""
    return dataclasses.asdict(obj)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if origin is Literal:
        allowed = get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = get_args(hint)[:1] or (Any,)
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        item = get_args(hint)[1] if len(get_args(hint)) == 2 else Any
        return {k: _coerce(item, v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, key)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported annotation {hint!r}")  # a bug in a config class, not user input


def check(condition: bool, key: str, message: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{key}: {message}")


def check_range(key: str, value: float | None, low: float, high: float | None = None, *, open_low: bool = False,
                open_high: bool = False, note: str = "") -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``low <= value <= high`` (strictly at an open end);
    a null value passes (its key allows null). The message states the range, the value and ``note``."""
    if value is None:
        return
    above = value > low if open_low else value >= low
    below = high is None or (value < high if open_high else value <= high)
    if above and below:
        return
    if high is not None:
        allowed = f"be in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    elif open_low:
        allowed = "be positive" if low == 0 else f"be greater than {low}"
    else:
        allowed = "not be negative" if low == 0 else f"be at least {low}"
    raise ConfigError(f"{key}: must {allowed} (got {value!r}){'; ' + note if note else ''}")
