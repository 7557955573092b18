"""The one-line refusals every family of checks shares."""

from __future__ import annotations

import difflib
import math

from trainstack.errors import ConfigError, show


def require(key: str, ok: bool, value: object, allowed: str) -> None:
    """Raise unless `ok`; a non-finite float never passes a range check."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={show(value)} is not a finite number; allowed: {allowed}")
    if not ok:
        raise ConfigError(f"{key}={show(value)} is out of range; allowed: {allowed}")


def cap(key: str, value: float, most: int, *, why: str = "") -> None:
    """Raise when a count is past `most`, the ceiling of what can run."""
    if value > most:
        raise ConfigError(
            f"{key}={show_number(value)} is out of range; allowed: at most {most:,}{why}"
        )


def show_number(value: float) -> str:
    """`value` for a message; a huge one (a YAML `1e30` read as an integer) as `1e+30`."""
    if abs(value) < 10**15:
        return show(value)
    try:
        return f"{float(value):.3g}"
    except OverflowError:
        return "a number past 1e308"


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value in allowed:
        return
    close = difflib.get_close_matches(value, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{key}={show(value)} is not one of {', '.join(allowed)}{hint}")


def next_multiple(value: int, step: int) -> int:
    return -(-value // step) * step
