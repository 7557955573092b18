"""Importing what a job spec names by `package.module:attribute` (models, losses).

The driver imports every target once before Ray starts, so a wrong path is one line
and exit 2 there; workers import the same path from the code the job ships to them
(the working directory, `PYTHONPATH` or an installed package).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from trainstack.errors import ConfigError


def import_target(path: str, *, key: str) -> Any:
    """The object `path` (`package.module:attr.sub`) names; `key` is the spec key, for errors."""
    module_name, _, attr_path = path.partition(":")
    _search_working_directory()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and not module_name.startswith(e.name):
            # The module exists but something it imports does not.
            raise ConfigError(f"{key}={path!r}: importing {module_name!r} failed: {e}") from None
        searched = ", ".join(p or "." for p in sys.path[:8])
        raise ConfigError(
            f"{key}={path!r}: no module named {module_name!r} (searched sys.path: {searched}); "
            "run from the directory holding it, add it to PYTHONPATH, or pip install it"
        ) from None
    except Exception as e:  # the user's module raised while importing
        raise ConfigError(
            f"{key}={path!r}: importing {module_name!r} raised {type(e).__name__}: {_line(e)}"
        ) from None
    value: Any = module
    for depth, name in enumerate(attr_path.split(".")):
        if not hasattr(value, name):
            owner = ".".join([module_name, *attr_path.split(".")[:depth]])
            names = sorted(n for n in dir(value) if not n.startswith("_"))
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise ConfigError(
                f"{key}={path!r}: {owner!r} has no attribute {name!r}; it has: {shown or 'nothing'}"
            )
        value = getattr(value, name)
    return value


def call_target(path: str, args: dict[str, Any], *, key: str, args_key: str, makes: str) -> Any:
    """What `path(**args)` returns: the target imported, checked to be callable and
    called, any failure one ConfigError line (`key`, `args_key`: the spec keys; `makes`:
    what the target should build, for the message)."""
    target = import_target(path, key=key)
    if not callable(target):
        raise ConfigError(
            f"{key}={path!r} is a {type(target).__name__}, not callable; allowed: a class "
            f"or a function returning {makes}"
        )
    try:
        return target(**args)
    except Exception as e:  # the user's code raised: say so in one line
        raise ConfigError(
            f"{key}={path!r} raised {describe_exception(e)} when called with {args_key}={args!r}"
        ) from None


def _search_working_directory() -> None:
    """Find packages in the directory the command runs from, as `python -m` would (a
    console script's sys.path does not have it). Ray's workers search the driver's
    working directory too. Appended, so it never shadows an installed module."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else "(no message)"


def describe_exception(e: BaseException) -> str:
    """`Type: first line of the message`, for one-line errors about user code."""
    return f"{type(e).__name__}: {_line(e)}"
