"""Quantities as users write them and as trainstack prints them: bytes (`80GB`, `16GiB`),
bandwidths (`100GB/s`), FLOP/s (`989e12`) and durations."""

from __future__ import annotations

import re

from trainstack.errors import ConfigError

BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_QUANTITY = re.compile(r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-z]*)", re.IGNORECASE)


def parse_quantity(key: str, text: str, *, units: bool, example: str, suffix: str = "") -> float:
    """`80GB`, `16GiB`, `100GB/s` (with `suffix` "/s"), `989e12` as a positive number
    (GB = 1e9 bytes, GiB = 2**30); ConfigError naming `key` (a spec key or a flag)."""
    body = text.strip().removesuffix(suffix)
    match = _QUANTITY.fullmatch(body)
    unit = match[2].lower() if match else ""
    if match is None or unit not in BYTE_UNITS or (unit and not units) or float(match[1]) <= 0:
        form = "a positive number"
        if units:
            form += " with an optional unit B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        raise ConfigError(f"{key}={text}: not a quantity; allowed: {form}, e.g. {example}")
    return float(match[1]) * BYTE_UNITS[unit]


def format_bytes(n: float) -> str:
    """Decimal units, as the flags take them (80 GB = 80e9 bytes), to three significant
    digits: 1.15 GB, 16.8 MB, 105 GB."""
    for unit in ("B", "kB", "MB", "GB"):
        if round(n, 1) < 999.5:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:,.0f} TB" if n >= 999.5 else f"{n:.3g} TB"


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} µs"
