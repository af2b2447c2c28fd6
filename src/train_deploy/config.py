"""The project's parameter blocks as typed classes, validated once, at the edge.

Each block is a pydantic dataclass made by :func:`block`: ``extra="forbid"`` (a typo is an error), strict types (``1``
is no ``true``, ``"3"`` no number), the allowed range as field constraints (``Field(ge=1)``), cross-field rules in
``__post_init__``, and each field's docstring as its description, so that :func:`schema` holds everything the
reference in ``docs/configuration.md`` says (``tools/config_reference.py`` writes it). The types hold the defaults;
``conf/base`` sets only what a project changes.

Pydantic dataclasses rather than models: they stay dataclasses, so ``dataclasses.replace``/``asdict`` and the
hand-offs' JSON (``train_deploy.handoffs.to_json``) keep working where stages pass configurations on.

:func:`from_mapping` builds a block from a parameter mapping and turns pydantic's errors into one line that names
the dotted key and what is allowed, never the whole value: ``corpus.tokenizer.vocab_size: must be in [32, 1000000]
(got 7)``. Strict pydantic dataclasses take nested blocks only as instances, so :func:`from_mapping` builds the
nested ones first (which also gives every error its dotted prefix). The hand-off descriptions
(``train_deploy.handoffs``) are read back by pydantic too, with :func:`error_text` for their errors.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, TypeVar, get_args, get_origin

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.dataclasses import is_pydantic_dataclass

T = TypeVar("T")

CONFIG = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)
"""Every block: unknown keys refused, no coercion between types, field docstrings as descriptions."""

_SHOWN = 40
"""Characters of a refused value an error repeats (a long path or text is cut)."""


class ConfigError(ValueError):
    """A parameter block does not describe a valid configuration; the message names the key."""


def block(cls: type[T]) -> type[T]:
    """``cls`` as a validated configuration block (keyword-only, slotted, :data:`CONFIG`)."""
    return pydantic_dataclass(kw_only=True, slots=True, config=CONFIG)(cls)


def setting(default: Any, *, note: str = "", unit: str = "", **constraints: Any) -> Any:
    """A field's default and constraints (``ge``, ``lt``, …, as :func:`pydantic.Field`) with what its range error
    adds: ``note`` after it (``0 = off``), ``unit`` inside it (``must be a positive number of seconds``)."""
    extra = {name: text for name, text in (("note", note), ("unit", unit)) if text}
    return Field(default, json_schema_extra=extra or None, **constraints)


@cache
def schema(cls: type) -> dict[str, Any]:
    """The JSON schema of block ``cls`` (nested blocks under ``$defs``): types, defaults, ranges, descriptions."""
    return TypeAdapter(cls).json_schema()


def from_mapping(cls: type[T], data: Mapping[str, Any] | T | None, where: str) -> T:
    """Build ``cls`` from ``data``, or return ``data`` when it is one already; ``where`` is the dotted name used in
    error messages."""
    if isinstance(data, cls):  # built once for the run (train_deploy.hooks.life.RunLife): passed on as it is
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    if not is_pydantic_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a configuration block (made by @block)")  # a bug, not user input
    fields = cls.__pydantic_fields__
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {name: from_mapping(nested, value, f"{where}.{name}")
              if (nested := nested_block(fields[name].annotation)) and isinstance(value, Mapping) else value
              for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ValidationError as exc:
        raise ConfigError(_one_line(cls, exc.errors()[0], where)) from None


def nested_block(annotation: Any) -> type | None:
    """The dataclass a field holds (``Block`` or ``Block | None``), or None."""
    members = [a for a in get_args(annotation) if a is not type(None)] if get_origin(annotation) in (
        typing.Union, types.UnionType) else [annotation]
    return members[0] if len(members) == 1 and isinstance(members[0], type) and dataclasses.is_dataclass(
        members[0]) else None


def to_dict(obj: Any) -> dict[str, Any]:
    """Return a plain, JSON-ready dict of a (nested) configuration dataclass."""
    return dataclasses.asdict(obj)


def unset_values(config: Any, given: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """The values of block ``config`` that ``given`` (its parameter mapping) leaves to the defaults, by dotted key
    (``training.schedule.seed``): with the given ones, what the run's MLflow parameters must hold, since the
    parameter files hold only what differs from the types."""
    given = given or {}
    found = {}
    for name, value in to_dict(config).items() if dataclasses.is_dataclass(config) else config.items():
        key = f"{where}.{name}"
        if isinstance(value, dict) and value and isinstance(given.get(name, {}), Mapping):
            found |= unset_values(value, given.get(name), key)
        elif name not in given:
            found[key] = value
    return found


_EXPECTED = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
             "list": "a list", "dict": "a mapping"}


def _one_line(cls: type, error: Mapping[str, Any], where: str) -> str:
    """Pydantic's ``error`` about block ``cls`` at ``where`` as ``<dotted key>: <what is allowed> (got <value>)``."""
    loc = error["loc"]
    if error["type"] in ("value_error", "assertion_error") and isinstance(error["ctx"]["error"], ConfigError):
        return str(error["ctx"]["error"])  # a cross-field rule names its own key
    key = where + "".join(f".{part}" if i == 0 else f"[{part}]" for i, part in enumerate(loc)
                          if i == 0 or isinstance(part, int))
    if error["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        field = schema(cls)["properties"][loc[0]]
        note = f"; {field['note']}" if "note" in field else ""
        shown = _shown(error.get("input"))
        return f"{key}: must {allowed_range(numeric_part(field) or {}, field.get('unit', ''))} (got {shown}){note}"
    return f"{key}: {error_text(error)}"


def error_text(error: Mapping[str, Any]) -> str:
    """What pydantic's ``error`` says is wrong, in the project's words, without the key: ``expected an integer, got
    'many'``, ``required``, ``unknown key``; a refused value is cut to 40 characters."""
    kind, shown = error["type"], _shown(error.get("input"))
    if kind == "literal_error":
        return f"{shown} is not one of {error['ctx']['expected'].replace(' or ', ', ')}"
    if kind.endswith("_type") and kind.removesuffix("_type") in _EXPECTED:
        return f"expected {_EXPECTED[kind.removesuffix('_type')]}, got {shown}"
    if kind == "too_short":
        return f"must hold at least {error['ctx']['min_length']} (got {shown})"
    if kind in ("missing_keyword_only_argument", "missing", "missing_argument"):
        return "required"
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return "unknown key"
    return error["msg"].removeprefix("Value error, ")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN - 1] + "…"


def numeric_part(field: Mapping[str, Any]) -> dict[str, Any] | None:
    """The integer or number schema within a field's schema (itself, a list's items, an ``anyOf`` member)."""
    if field.get("type") in ("integer", "number"):
        return dict(field)
    if field.get("type") == "array":
        return numeric_part(field.get("items", {}))
    return next(filter(None, (numeric_part(member) for member in field.get("anyOf", ()))), None)


def allowed_range(field: Mapping[str, Any], unit: str = "") -> str:
    """What a numeric schema allows, as the end of ``must …``: ``be in [0, 1)``, ``be at least 1``, ``be positive``
    (``be a positive number of seconds`` with ``unit``)."""
    low, open_low = (field["exclusiveMinimum"], True) if "exclusiveMinimum" in field else (field.get("minimum"), False)
    high, open_high = ((field["exclusiveMaximum"], True) if "exclusiveMaximum" in field
                       else (field.get("maximum"), False))
    if low is not None and high is not None:
        return f"be in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    if low is not None:
        if open_low:
            return (f"be a positive number of {unit}" if unit else "be positive") if low == 0 \
                else f"be greater than {low}"
        return "not be negative" if low == 0 else f"be at least {low}"
    if high is not None:
        return f"be below {high}" if open_high else f"be at most {high}"
    return "be a number"


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
