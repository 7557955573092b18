"""The tables of kinds name the code of each kind by import path, imported only when a
job uses it: every path must name something callable, or a job of that kind fails late."""

import pytest

from trainstack.kinds import DATA_KINDS, KINDS, MODEL_KINDS, load

PATHS = sorted(
    {
        (kind.name, path)
        for table, fields in (
            (KINDS, ("build", "plan_layout", "model_checks")),
            (MODEL_KINDS, ("build", "spec_check")),
            (DATA_KINDS, ("build", "spec_check", "data_check")),
        )
        for kind in table.values()
        for field in fields
        for path in (
            getattr(kind, field)
            if isinstance(getattr(kind, field), tuple)
            else (getattr(kind, field),)
        )
        if path
    }
)


@pytest.mark.parametrize(("kind", "path"), PATHS, ids=[f"{k}-{p}" for k, p in PATHS])
def test_every_path_a_kind_names_is_callable(kind: str, path: str) -> None:
    assert callable(load(path)), f"{kind}: {path}"
