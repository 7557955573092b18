"""The sweep file: a base job spec, fixed overrides, a search space over spec keys,
and how to search it.

    name: demo-sweep
    base: ../jobs/configs/demo.yaml        # relative to the sweep file
    set: {train.steps: 300}                # every trial
    space:
      strategy.kind: [ddp, zero]           # a list: every value (grid) or a choice
      strategy.stage: {values: [1, 2], when: {strategy.kind: zero}}
      optim.lr: loguniform(1e-4, 1e-2)     # a distribution: drawn per trial
    search: {algorithm: grid, num_samples: 1, max_concurrent_trials: 0}
    objective: {metric: eval_loss}
    scheduler: {kind: asha, grace_fraction: 0.25, reduction_factor: 2}

Everything a user can get wrong is a `ConfigError` naming the key, before Ray starts:
unknown keys (in the file or in the space), empty spaces and lists, malformed or
inverted distributions, conditions on keys that come later, and any combination of
the space that is not a valid job spec.
"""

from __future__ import annotations

import difflib
import itertools
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from trainstack.config import (
    ConfigError,
    JobConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_override,
    set_key,
)
from trainstack.config.fields import build_section, field_types
from trainstack.errors import got, show

DISTRIBUTIONS = ("uniform", "loguniform", "randint", "lograndint")
SEARCH_ALGORITHMS = ("auto", "grid", "random", "optuna")
OBJECTIVE_METRICS = {"eval_loss": "min", "tokens_per_s": "max"}
SCHEDULERS = ("asha", "fifo")
MAX_COMBINATIONS = 10_000
"""Largest product of the space's lists; each combination is validated up front."""
SWEEP_KEYS = (
    *("name", "base", "set", "space", "search", "objective", "scheduler", "failure"),
    "storage_path",
)

_DISTRIBUTION = re.compile(r"^\s*(\w+)\s*\(\s*([^,()]+?)\s*,\s*([^,()]+?)\s*\)\s*$")


@dataclass(frozen=True, kw_only=True)
class Distribution:
    kind: str
    """`uniform`, `loguniform` (floats), `randint`, `lograndint` (integers, both ends included)."""
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.kind}({self.low:g}, {self.high:g})"

    @property
    def is_integer(self) -> bool:
        return self.kind in ("randint", "lograndint")

    def ends(self) -> tuple[float, float]:
        """The lowest and highest value a draw can take."""
        if self.is_integer:
            return int(self.low), int(self.high)
        return self.low, self.high


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """One key of the search space."""

    key: str
    values: tuple[Any, ...] = ()
    """A list domain: every value (grid search) or a uniform choice (random search)."""
    distribution: Distribution | None = None
    when: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    """The key applies only where each named key has one of these values."""

    def applies(self, values: Mapping[str, Any]) -> bool:
        return all(values.get(key) in allowed for key, allowed in self.when)

    def describe(self) -> str:
        domain = str(self.distribution) if self.distribution else show(list(self.values))
        if not self.when:
            return domain
        conditions = ", ".join(f"{k} in {list(v)}" for k, v in self.when)
        return f"{domain} when {conditions}"


@dataclass(kw_only=True)
class SearchConfig:
    algorithm: str = "auto"
    """`grid` (every combination of the lists, distributions drawn), `random` (every key
    drawn), `optuna` (TPE; needs `pip install optuna`), `auto`: optuna if installed, else grid."""
    num_samples: int = 1
    """grid: repetitions of the whole grid; random and optuna: number of trials."""
    max_concurrent_trials: int = 0
    """Trials at once; 0: as many as the cluster's CPUs and GPUs hold."""
    seed: int = 0
    """Seed of the random draws (random, grid's distributions, optuna)."""


@dataclass(kw_only=True)
class ObjectiveConfig:
    metric: str = "eval_loss"
    """`eval_loss` (held-out loss at equal tokens, minimised) or `tokens_per_s` (maximised)."""
    loss_bound: float = 0.0
    """tokens_per_s only: the best trial must end at or below this held-out loss (0: any)."""

    @property
    def mode(self) -> str:
        return OBJECTIVE_METRICS[self.metric]


@dataclass(kw_only=True)
class SchedulerConfig:
    kind: str = "asha"
    """`asha` (stop trials that trail at equal tokens) or `fifo` (run every trial to the end)."""
    grace_fraction: float = 0.25
    """asha: the first comparison comes after this fraction of a trial's tokens, in (0, 1]."""
    reduction_factor: int = 2
    """asha: at each comparison about 1/reduction_factor of the trials go on (>= 2)."""


@dataclass(kw_only=True)
class FailurePolicy:
    max_failures: int = 1
    """Retries of a failed trial (it resumes from its own checkpoints); -1: unlimited."""


@dataclass(kw_only=True)
class SweepConfig:
    name: str
    path: Path
    """The sweep file."""
    base_path: Path
    base: dict[str, Any]
    """The base job spec with `set:` applied (raw mapping, validated)."""
    fixed: dict[str, Any]
    """The `set:` overrides, as written."""
    space: tuple[Dimension, ...]
    search: SearchConfig = field(default_factory=SearchConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    failure: FailurePolicy = field(default_factory=FailurePolicy)
    storage_path: str = ".cache/sweeps"

    @property
    def sweep_dir(self) -> Path:
        return (Path(self.storage_path).expanduser() / self.name).resolve()

    def single_valued(self) -> set[str]:
        """Space keys with one value: implied by their conditions, not worth a label."""
        return {dim.key for dim in self.space if len(dim.values) == 1}

    def trial_overrides(self, chosen: Mapping[str, Any]) -> dict[str, Any]:
        """The keys of `chosen` whose conditions hold, in space order."""
        view = flat_spec(self.base)
        applied: dict[str, Any] = {}
        for dim in self.space:
            if dim.key in chosen and dim.applies(view):
                applied[dim.key] = view[dim.key] = chosen[dim.key]
        return applied

    def trial_config(self, overrides: Mapping[str, Any], *, name: str) -> JobConfig:
        raw = self.base
        for key, value in overrides.items():
            raw = set_key(raw, key, value, what="sweep space key")
        return config_from_dict(set_key(raw, "name", name, what="sweep"))

    def grid(self) -> list[dict[str, Any]]:
        """Every distinct combination of the lists, conditions applied, in file order."""
        lists = [dim for dim in self.space if dim.distribution is None]
        seen: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for values in itertools.product(*(dim.values for dim in lists)):
            applied = self.trial_overrides(
                {dim.key: v for dim, v in zip(lists, values, strict=True)}
            )
            seen.setdefault(tuple((k, repr(v)) for k, v in applied.items()), applied)
        return list(seen.values())

    def corner_trials(self) -> Iterator[dict[str, Any]]:
        """Every grid combination with the distributions at their lower, then upper ends:
        the trials that bound what any draw can ask of the job spec and the cluster."""
        for combo in self.grid():
            for end in (0, 1):
                chosen = dict(combo)
                for dim in self.space:
                    if dim.distribution is not None:
                        chosen[dim.key] = dim.distribution.ends()[end]
                yield self.trial_overrides(chosen)


def load_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> SweepConfig:
    """Read and check a sweep file; `overrides` (`key=value`) join its `set:`."""
    path = Path(path)
    raw = _read_yaml(path)
    unknown = [key for key in raw if key not in SWEEP_KEYS]
    if unknown:
        raise ConfigError(_unknown(f"sweep file {str(path)!r}", str(unknown[0]), SWEEP_KEYS))
    name = raw.get("name") or path.stem
    if not isinstance(name, str):
        raise ConfigError(f"sweep name: expected text, got {got(name)}")
    if "base" not in raw or not isinstance(raw["base"], str):
        raise ConfigError(
            f"sweep file {str(path)!r}: 'base' must name the job spec to start from, "
            f"e.g. base: ../jobs/configs/demo.yaml (got {got(raw.get('base'))})"
        )
    base_path = (path.parent / raw["base"]).resolve()
    fixed = raw.get("set") or {}
    if not isinstance(fixed, dict):
        raise ConfigError(f"sweep set: expected a mapping of spec keys, got {got(fixed)}")
    fixed = {**fixed, **dict(parse_override(o) for o in overrides)}
    base_cfg = load_config(str(base_path))
    base = config_to_dict(base_cfg)
    for key, value in fixed.items():
        spec_field(str(key), where="sweep set")
        base = set_key(base, str(key), value, what="sweep set")
    base = config_to_dict(_valid(base, f"the base spec with set: {show(fixed)}"))
    sweep = SweepConfig(
        name=name,
        path=path,
        base_path=base_path,
        base=base,
        fixed=fixed,
        space=_parse_space(raw.get("space")),
        search=build_section(SearchConfig, raw.get("search"), prefix="search."),
        objective=build_section(ObjectiveConfig, raw.get("objective"), prefix="objective."),
        scheduler=build_section(SchedulerConfig, raw.get("scheduler"), prefix="scheduler."),
        failure=build_section(FailurePolicy, raw.get("failure"), prefix="failure."),
        storage_path=str(raw.get("storage_path") or ".cache/sweeps"),
    )
    sweep = _with_valid_name(sweep)
    _check_settings(sweep)
    _check_trials(sweep)
    return sweep


def spec_field(key: str, *, where: str) -> Any:
    """The type of job-spec field `key` (dotted), or a ConfigError naming the nearest key."""
    section: Any = JobConfig
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if section is dict:  # free-form (deepspeed:): any key below it
            return Any
        types = field_types(section)
        if part not in types:
            prefix = ".".join(parts[:depth])
            names = [f"{prefix}.{n}" if prefix else n for n in types]
            raise ConfigError(_unknown(where, key, names))
        hint = types[part]
        section = dict if str(hint).startswith("dict") else hint
        if depth < len(parts) - 1 and not (section is dict or is_dataclass(section)):
            raise ConfigError(f"{where}: {key!r}: {'.'.join(parts[: depth + 1])} has no keys")
    if is_dataclass(section):
        raise ConfigError(f"{where}: {key!r} is a section; name one of its keys")
    return section


def flat_spec(spec: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"strategy": {"kind": "ddp"}}` -> `{"strategy.kind": "ddp"}`."""
    flat: dict[str, Any] = {}
    for key, value in spec.items():
        if isinstance(value, Mapping) and key != "deepspeed":
            flat.update(flat_spec(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read sweep file {str(path)!r}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"cannot parse sweep file {str(path)!r}: {first}") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"sweep file {str(path)!r}: top level must be a mapping with keys "
            f"{', '.join(SWEEP_KEYS)}; got {got(raw)}"
        )
    return raw


def _parse_space(raw: object) -> tuple[Dimension, ...]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"sweep space: expected a non-empty mapping of spec keys to lists or "
            f"distributions, e.g. strategy.kind: [ddp, zero]; got {got(raw)}"
        )
    keys = [str(key) for key in raw]
    dims: list[Dimension] = []
    for key, entry in zip(keys, raw.values(), strict=True):
        where = f"sweep space.{key}"
        spec_field(key, where="sweep space")
        when: tuple[tuple[str, tuple[Any, ...]], ...] = ()
        if isinstance(entry, dict):
            extra = [k for k in entry if k not in ("values", "when")]
            if extra or "values" not in entry:
                raise ConfigError(
                    f"{where}: a conditional entry has keys values and when "
                    f"(e.g. {{values: [1, 2], when: {{strategy.kind: zero}}}}); got {show(entry)}"
                )
            later = keys[keys.index(key) :]
            when = _parse_when(entry.get("when"), where=where, later=later)
            entry = entry["values"]
        dims.append(_parse_domain(key, entry, where=where, when=when))
    return tuple(dims)


def _parse_when(
    raw: object, *, where: str, later: list[str]
) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """Conditions may name base-spec keys and space keys listed before this one."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"{where}.when: expected a mapping like {{strategy.kind: zero}}, got {got(raw)}"
        )
    conditions = []
    for key, allowed in raw.items():
        spec_field(str(key), where=f"{where}.when")
        if str(key) in later:
            raise ConfigError(
                f"{where}.when: {key!r} must be listed in the space before the key it decides"
            )
        values = tuple(allowed) if isinstance(allowed, list) else (allowed,)
        conditions.append((str(key), values))
    return tuple(conditions)


def _parse_domain(
    key: str, entry: object, *, where: str, when: tuple[tuple[str, tuple[Any, ...]], ...]
) -> Dimension:
    if isinstance(entry, list):
        if not entry:
            raise ConfigError(f"{where}: the list of values is empty; give at least one")
        return Dimension(key=key, values=tuple(entry), when=when)
    if isinstance(entry, str) and (match := _DISTRIBUTION.match(entry)):
        return Dimension(key=key, distribution=_distribution(match, where=where), when=when)
    raise ConfigError(
        f"{where}: expected a list of values or a distribution "
        f"({'|'.join(DISTRIBUTIONS)})(low, high), got {got(entry)}; a fixed value goes under set:"
    )


def _distribution(match: re.Match[str], *, where: str) -> Distribution:
    kind, low_text, high_text = match.groups()
    if kind not in DISTRIBUTIONS:
        raise ConfigError(_unknown(where, kind, DISTRIBUTIONS, what="distribution"))
    try:
        low, high = float(low_text), float(high_text)
    except ValueError:
        raise ConfigError(f"{where}: {match.string.strip()}: bounds must be numbers") from None
    dist = Distribution(kind=kind, low=low, high=high)
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ConfigError(f"{where}: {dist}: needs finite bounds with low < high")
    if kind.startswith("log") and low <= 0:
        raise ConfigError(f"{where}: {dist}: a log distribution needs low > 0")
    if dist.is_integer and not (low.is_integer() and high.is_integer()):
        raise ConfigError(f"{where}: {dist}: {kind} needs integer bounds")
    return dist


def _with_valid_name(sweep: SweepConfig) -> SweepConfig:
    try:
        config_from_dict({"name": f"{sweep.name}-00000_00000"})
    except ConfigError:
        raise ConfigError(
            f"sweep name={show(sweep.name)} is not a valid run name; allowed: letters, "
            "digits, '.', '_' and '-', starting with a letter or digit"
        ) from None
    return sweep


def _check_settings(sweep: SweepConfig) -> None:
    s, o, sch = sweep.search, sweep.objective, sweep.scheduler
    _choice("search.algorithm", s.algorithm, SEARCH_ALGORITHMS)
    if s.num_samples < 1:
        raise ConfigError(f"search.num_samples={s.num_samples} is out of range; allowed: >= 1")
    if s.max_concurrent_trials < 0:
        raise ConfigError(
            f"search.max_concurrent_trials={s.max_concurrent_trials} is out of range; "
            "allowed: >= 0 (0: what the cluster holds)"
        )
    _choice("objective.metric", o.metric, tuple(OBJECTIVE_METRICS))
    if o.loss_bound < 0 or (o.loss_bound and o.metric != "tokens_per_s"):
        raise ConfigError(
            f"objective.loss_bound={o.loss_bound}: allowed only with metric tokens_per_s, >= 0"
        )
    _choice("scheduler.kind", sch.kind, SCHEDULERS)
    if not 0 < sch.grace_fraction <= 1:
        raise ConfigError(
            f"scheduler.grace_fraction={sch.grace_fraction} is out of range; allowed: (0, 1]"
        )
    if sch.reduction_factor < 2:
        raise ConfigError(
            f"scheduler.reduction_factor={sch.reduction_factor} is out of range; allowed: >= 2"
        )
    if sweep.failure.max_failures < -1:
        raise ConfigError(
            f"failure.max_failures={sweep.failure.max_failures} is out of range; "
            "allowed: >= -1 (-1: unlimited)"
        )
    needs_eval = o.metric == "eval_loss" or o.loss_bound
    if needs_eval and not sweep.base["data"]["eval_samples"]:
        raise ConfigError(
            f"objective.metric={o.metric} needs held-out data: set data.eval_samples > 0 "
            "in the base spec or under set:"
        )


def _check_trials(sweep: SweepConfig) -> None:
    combinations = math.prod(len(d.values) for d in sweep.space if d.distribution is None)
    if combinations > MAX_COMBINATIONS:
        raise ConfigError(
            f"sweep space: its lists make {combinations:,} combinations; allowed: at most "
            f"{MAX_COMBINATIONS:,} (use distributions, or fewer values)"
        )
    for overrides in sweep.corner_trials():
        try:
            sweep.trial_config(overrides, name=sweep.name)
        except ConfigError as err:
            raise ConfigError(
                f"sweep: trial {show(overrides)} is not a valid job spec: {err}"
            ) from None


def _valid(raw: dict[str, Any], what: str) -> JobConfig:
    try:
        return config_from_dict(raw)
    except ConfigError as err:
        raise ConfigError(f"sweep: {what} is not a valid job spec: {err}") from None


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(_unknown(key, value, allowed, what="value"))


def _unknown(
    where: str, key: str, allowed: tuple[str, ...] | list[str], *, what: str = "key"
) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: unknown {what} {key!r}{hint} (allowed: {', '.join(allowed)})"
