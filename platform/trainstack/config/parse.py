"""Loading a job spec: YAML (safe_load), `--set KEY=VALUE` overrides, the mapping →
`JobConfig` (validated) and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from trainstack.config.checks import validate
from trainstack.config.fields import build_section, field_types, section_to_dict
from trainstack.config.sections import JobConfig
from trainstack.errors import ConfigError, got, show

# PyYAML's constructors raise plain exceptions for a bad explicit tag (`!!int x`,
# `!!bool maybe`, `!!timestamp bad`), and its composer recurses once per nesting level.
_YAML_CONSTRUCTOR_ERRORS = (ValueError, LookupError, AttributeError, TypeError, RecursionError)


def load_config(path: str, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a YAML job spec (safe_load), apply `a.b=c` overrides, validate."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read job spec {str(path)!r}: {_os_reason(e)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read job spec {str(path)!r}: not UTF-8 text") from None
    try:
        raw = yaml.safe_load(text)
    except (yaml.YAMLError, *_YAML_CONSTRUCTOR_ERRORS) as e:
        raise ConfigError(f"cannot parse job spec {str(path)!r}: {_yaml_problem(e)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"job spec {str(path)!r}: top level must be a mapping of sections "
            f"({', '.join(field_types(JobConfig))}), got {got(raw)}"
        )
    return config_from_dict(apply_overrides(raw, overrides))


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of `raw` with each `a.b=c` override applied (c parsed as YAML).

    Mappings along each dotted path are copied, so `raw` is never mutated; missing or
    null ones are created. An empty value (`tracking.uri=`) is the empty string.
    """
    result = dict(raw)
    for override in overrides:
        key, value = parse_override(override)
        result = set_key(result, key, value, what="--set")
    return result


def parse_override(override: str) -> tuple[str, object]:
    """`a.b=c` -> `("a.b", c parsed as YAML)`; an empty value is the empty string."""
    key, sep, text = override.partition("=")
    if not sep or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"--set {show(override)}: expected key.sub=value")
    return key.strip(), _parse_override_value(override, text)


def set_key(raw: dict[str, Any], key: str, value: object, *, what: str) -> dict[str, Any]:
    """Return a copy of `raw` with dotted `key` set to `value`; `what` names the source
    of the key in errors (`--set`, a sweep file).

    Mappings along the path are copied, so `raw` is never mutated; missing or null ones
    are created.
    """
    parts = [part.strip() for part in key.split(".")]
    if not all(parts):
        raise ConfigError(f"{what} {show(key)}: expected a dotted key like train.steps")
    result = dict(raw)
    node = result
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"{what} {show(key)}: {where!r} is {show(child)}, not a mapping")
        node[part] = node = dict(child)
    node[parts[-1]] = value
    return result


def _parse_override_value(override: str, text: str) -> object:
    if not text.strip():
        return ""
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, *_YAML_CONSTRUCTOR_ERRORS) as e:
        raise ConfigError(
            f"--set {show(override)}: value is not valid YAML: {_yaml_problem(e)}"
        ) from None


def _os_reason(e: OSError) -> str:
    if isinstance(e, FileNotFoundError):
        return "no such file"
    if isinstance(e, IsADirectoryError):
        return "is a directory"
    if isinstance(e, PermissionError):
        return "permission denied"
    return (e.strerror or type(e).__name__).lower()


def _yaml_problem(e: BaseException) -> str:
    """One line from a PyYAML error: where, then what."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem or e.context}"
    if isinstance(e, RecursionError):
        return "nested too deeply"
    lines = str(e).splitlines()
    return lines[0] if lines else type(e).__name__


def config_from_dict(raw: object) -> JobConfig:
    """Build and validate a JobConfig from a plain mapping (YAML or JSON shaped).

    Keys must be fields of the section they are in; values are coerced to the field's
    type (`"4"` -> 4, `"1e-3"` -> 0.001, `"yes"` -> True, `[0.9, 0.99]` -> a tuple).
    A null section means its defaults.
    """
    cfg = build_section(JobConfig, _local_servers_as_text(_elastic_shorthand(raw)), prefix="")
    validate(cfg)
    return cfg


def _elastic_shorthand(raw: object) -> object:
    """`scaling.num_workers: {min: m, max: n}` as `num_workers: n` and `min_workers: m`."""
    scaling = raw.get("scaling") if isinstance(raw, Mapping) else None
    workers = scaling.get("num_workers") if isinstance(scaling, Mapping) else None
    if not isinstance(workers, Mapping):
        return raw
    assert isinstance(raw, Mapping) and isinstance(scaling, Mapping)
    if set(workers) != {"min", "max"}:
        raise ConfigError(
            f"scaling.num_workers: expected a number or {{min: M, max: N}}, got "
            f"{show(dict(workers))}"
        )
    if "min_workers" in scaling:
        raise ConfigError(
            "scaling: give the elastic range once, as num_workers: {min, max} or as "
            "num_workers and min_workers"
        )
    rest = {k: v for k, v in scaling.items() if k != "num_workers"}
    scaling = {**rest, "num_workers": workers["max"], "min_workers": workers["min"]}
    return {**raw, "scaling": scaling}


def _local_servers_as_text(raw: object) -> object:
    """`strategy.local_servers: 2` (a YAML number) as the text "2" its field holds."""
    strategy = raw.get("strategy") if isinstance(raw, Mapping) else None
    count = strategy.get("local_servers") if isinstance(strategy, Mapping) else None
    if not isinstance(count, int) or isinstance(count, bool):
        return raw
    assert isinstance(raw, Mapping) and isinstance(strategy, Mapping)
    return {**raw, "strategy": {**strategy, "local_servers": str(count)}}


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) that `config_from_dict` turns back into `cfg`."""
    return section_to_dict(cfg)
