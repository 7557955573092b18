"""What trainstack tells a user who must fix something: `ConfigError` (a spec, a flag, a
file they named) and the helpers that keep every such message to one line."""

from __future__ import annotations


class ConfigError(ValueError):
    """A job spec the user must fix; the message is one line."""


def show(value: object) -> str:
    """A short one-line rendering of a user value for messages."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = "a very large integer"
    return text if len(text) <= 60 else text[:57] + "..."


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when it has none: what a
    one-line error says of an exception from a library."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def got(value: object) -> str:
    return "null" if value is None else f"{show(value)} ({type(value).__name__})"
