"""Typed dataclass sections from plain mappings, with one-line errors.

The job spec's machinery, kept apart from its schema: unknown keys suggest the
nearest valid one, values are coerced to the field's type hint, and every failure is
a `ConfigError` naming the dotted key.
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from trainstack.errors import ConfigError, got, show

_TRUE_WORDS = frozenset({"true", "yes", "1"})
_FALSE_WORDS = frozenset({"false", "no", "0"})

_Section = TypeVar("_Section")


def section_to_dict(section: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            value = section_to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def build_section(cls: type[_Section], raw: object, *, prefix: str) -> _Section:
    """Build dataclass `cls` from `raw`; `prefix` is the dotted path of `raw` plus '.'."""
    if raw is None:
        return cls()
    types = field_types(cls)
    if not isinstance(raw, Mapping):
        where = prefix.rstrip(".") or "job spec"
        raise ConfigError(
            f"{where}: expected a mapping with keys {', '.join(types)}, got {got(raw)}"
        )
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in types:
            raise ConfigError(_unknown_key_message(prefix + str(key), prefix, list(types)))
        hint = types[key]
        if isinstance(hint, type) and is_dataclass(hint):
            kwargs[key] = build_section(hint, value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = coerce(value, hint, key=prefix + key)
    return cls(**kwargs)


def _unknown_key_message(dotted: str, prefix: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(dotted, [prefix + name for name in allowed], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ";"
    return f"unknown key {dotted!r}{hint} allowed: {', '.join(allowed)}"


def coerce(value: object, hint: Any, *, key: str) -> object:
    """`value` as the field type `hint`, or a ConfigError naming `key`."""
    if hint is bool:
        return _to_bool(value, key=key)
    if hint is int:
        return _to_int(value, key=key)
    if hint is float:
        return _to_float(value, key=key)
    if hint is str:
        if isinstance(value, str):
            return value
        hint_text = "; put it in quotes to pass it as text" if _is_scalar(value) else ""
        raise ConfigError(f"{key}: expected a string, got {got(value)}{hint_text}")
    if get_origin(hint) is tuple:
        return _to_tuple(value, get_args(hint), key=key)
    if get_origin(hint) is dict:  # a free-form mapping, checked by whoever reads it
        if value is None:
            return {}
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key}: expected a mapping with text keys, got {got(value)}")
        return copy.deepcopy(dict(value))
    raise TypeError(f"{key}: config fields of type {hint!r} are not supported")


def _to_bool(value: object, *, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise ConfigError(f"{key}: expected true or false, got {got(value)}")


def _to_int(value: object, *, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if number.is_integer():
            return int(number)
    raise ConfigError(f"{key}: expected an integer, got {got(value)}")


def _to_float(value: object, *, key: str) -> float:
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{key}={show(value)} is too large for a number") from None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected a number, got {got(value)}")


def _to_tuple(value: object, item_hints: tuple[Any, ...], *, key: str) -> tuple[object, ...]:
    if len(item_hints) == 2 and item_hints[1] is Ellipsis:  # tuple[T, ...]: any length
        if item_hints[0] is str and isinstance(value, str):  # one path, glob or name
            return (value,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {got(value)}")
        return tuple(coerce(item, item_hints[0], key=f"{key}[{i}]") for i, item in enumerate(value))
    if not isinstance(value, (list, tuple)) or len(value) != len(item_hints):
        kind = "numbers" if all(h is float for h in item_hints) else "values"
        raise ConfigError(f"{key}: expected a list of {len(item_hints)} {kind}, got {got(value)}")
    return tuple(
        coerce(item, hint, key=f"{key}[{i}]")
        for i, (item, hint) in enumerate(zip(value, item_hints, strict=True))
    )


def _is_scalar(value: object) -> bool:
    return isinstance(value, (int, float, bool))
