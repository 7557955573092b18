"""Fuzzing the job spec: only ConfigError ever escapes, and whatever builds round-trips."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainstack.config import (
    ConfigError,
    JobConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    validate,
)

SECTIONS: dict[str, Any] = {
    name: hint for name, hint in get_type_hints(JobConfig).items() if dataclasses.is_dataclass(hint)
}
SECTION_FIELDS = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}
DOTTED_KEYS = ["name"] + [f"{s}.{k}" for s, keys in SECTION_FIELDS.items() for k in keys]

WORDS = st.sampled_from(
    [
        *["gpt", "mlp", "markov", "adamw", "sgd", "ddp", "bf16", "cosine", "sqrt", "mlflow"],
        *["none", "auto", "jsonl", "dpp", "", "true", "no", "4", "1e-3", "nan", "-inf", "job-1"],
    ]
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-3, max_value=300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0, max_value=1),
    st.text(max_size=12),
    WORDS,
)
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6) | st.integers(), inner, max_size=3)
    ),
    max_leaves=8,
)


def plausible(section: str, key: str) -> st.SearchStrategy[Any]:
    """Values near the field's type and range, so that a fair share of specs build."""
    default = getattr(SECTIONS[section](), key)
    if isinstance(default, bool):
        return st.booleans() | st.sampled_from(["yes", "0", "True"])
    if isinstance(default, int):
        return st.just(default) | st.just(str(default)) | st.integers(-1, 64)
    if isinstance(default, float):
        return st.just(default) | st.just(repr(default)) | st.floats(0, 1)
    if isinstance(default, tuple):
        return st.just(list(default)) | st.lists(st.floats(0, 1), min_size=2, max_size=2)
    if dataclasses.is_dataclass(default):  # a nested section (model.moe, model.lora)
        return st.just(dataclasses.asdict(default)) | st.none() | WORDS
    return st.just(default) | WORDS


@st.composite
def section_dicts(draw: st.DrawFn, section: str) -> dict[Any, Any]:
    raw: dict[Any, Any] = {}
    for key in draw(st.lists(st.sampled_from(SECTION_FIELDS[section]), max_size=4, unique=True)):
        wild = draw(st.integers(0, 9)) == 0
        raw[key] = draw(anything if wild else plausible(section, key))
    if draw(st.integers(0, 29)) == 0:
        raw[draw(st.text(max_size=8))] = draw(anything)
    return raw


@st.composite
def job_dicts(draw: st.DrawFn) -> object:
    if draw(st.integers(0, 19)) == 0:
        return draw(anything)
    raw: dict[Any, Any] = {}
    for section in draw(st.lists(st.sampled_from(list(SECTIONS)), max_size=6, unique=True)):
        wild = draw(st.integers(0, 19)) == 0
        raw[section] = draw(anything if wild else section_dicts(section) | st.none())
    if draw(st.booleans()):
        wild = draw(st.integers(0, 4)) == 0
        raw["name"] = draw(scalars if wild else st.sampled_from(["job-1", "a.b_c", "", "a b"]))
    if draw(st.integers(0, 19)) == 0:
        raw[draw(st.text(max_size=8))] = draw(anything)
    return raw


YAML_SNIPPETS = [
    *["3", "0", "-1", "1e-3", "0.5", "true", "no", "[1]", "null", "gpt", "sgd", "bf16", ".inf"],
    *["", "'quoted'", "[0.9", "[0.9, 0.99]", "{a: 1}", "!!int x", "!!bool maybe", "a: b: c"],
]
yaml_values = st.sampled_from(YAML_SNIPPETS) | st.text(max_size=10)
override_keys = st.sampled_from(DOTTED_KEYS) | st.text(max_size=10)
well_formed = st.builds(lambda k, v: f"{k}={v}", st.sampled_from(DOTTED_KEYS), yaml_values)
overrides = st.lists(
    well_formed | well_formed | st.builds(lambda k, v: f"{k}={v}", override_keys, yaml_values),
    max_size=4,
) | st.lists(st.text(max_size=15), max_size=2)


def check_outcome(build: Any) -> None:
    """Run `build`; a ConfigError must be one line, a result must validate and round-trip."""
    try:
        cfg = build()
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert isinstance(cfg, JobConfig)
    validate(cfg)
    for value in (cfg.optim.lr, cfg.model.dropout, cfg.scaling.cpus_per_worker):
        assert math.isfinite(value)
    assert config_from_dict(config_to_dict(cfg)) == cfg
    assert cfg.grad_accum_steps >= 1


@settings(max_examples=400, deadline=None)
@given(raw=job_dicts())
def test_random_dicts_raise_only_config_error(raw: object) -> None:
    check_outcome(lambda: config_from_dict(raw))


@settings(max_examples=400, deadline=None)
@given(base=job_dicts().filter(lambda r: isinstance(r, dict)), sets=overrides)
def test_random_overrides_raise_only_config_error(base: dict[str, Any], sets: list[str]) -> None:
    check_outcome(lambda: config_from_dict(apply_overrides(base, sets)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=40) | st.builds(yaml.safe_dump, job_dicts()), sets=overrides)
def test_random_yaml_files_raise_only_config_error(
    tmp_path_factory: pytest.TempPathFactory, text: str, sets: list[str]
) -> None:
    path: Path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    check_outcome(lambda: load_config(str(path), sets))


@settings(max_examples=100, deadline=None)
@given(
    steps=st.integers(1, 10**6),
    micro=st.integers(1, 64),
    workers=st.integers(1, 16),
    accum=st.integers(1, 8),
    lr=st.floats(1e-8, 10),
)
def test_consistent_specs_always_build(
    steps: int, micro: int, workers: int, accum: int, lr: float
) -> None:
    cfg = config_from_dict(
        {
            "train": {
                "steps": steps,
                "micro_batch_size": micro,
                "global_batch_size": micro * workers * accum,
            },
            "scaling": {"num_workers": workers},
            "optim": {"lr": lr, "warmup_steps": steps - 1},
        }
    )
    assert cfg.grad_accum_steps == accum
    assert config_from_dict(config_to_dict(cfg)) == cfg
