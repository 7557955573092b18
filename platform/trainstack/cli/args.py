"""What the commands share: `--set` overrides, `--address`, `--storage-option`, and the
one-line error every command prints on a bad input."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from trainstack.config import ConfigError


def error(message: str, *, code: int) -> int:
    print(f"trainstack: error: {message}", file=sys.stderr)
    return code


def add_overrides(parser: argparse.ArgumentParser, *, what: str) -> None:
    """`--set KEY=VALUE` (repeatable), collected in `args.overrides`."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override {what} (repeatable)",
    )


def add_set_and_address(parser: argparse.ArgumentParser, *, what: str) -> None:
    add_overrides(parser, what=what)
    parser.add_argument(
        "--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else local)"
    )


def store_option(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of `--storage-option`; the value read as YAML (`true`, `5`, text)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--storage-option {text!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)
