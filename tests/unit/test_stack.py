"""trainstack's dependency ranges: one table (trainstack/stack.py) that pyproject.toml
declares, the checks `trainstack doctor` and pre-flight make against it, and what a
job's runtime environment installs on a cluster."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from trainstack.stack import (
    DEPENDENCIES,
    dependency,
    found_from,
    install_command,
    job_requirements,
    stack_problem,
    versions_here,
)

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> tuple[list[str], dict[str, list[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"], project["optional-dependencies"]


def test_pyproject_declares_exactly_the_table_and_no_exact_pin() -> None:
    core, extras = _declared()
    assert sorted(core) == sorted(d.requirement for d in DEPENDENCIES if d.needed_by is None)
    for dep in DEPENDENCIES:
        if dep.needed_by is not None:
            assert dep.requirement in extras[dep.needed_by], dep.name
    for requirement in [*core, *(r for reqs in extras.values() for r in reqs)]:
        assert "==" not in requirement, requirement
    # the dev extra may not narrow a range the table declares
    by_name = {re.split(r"[\[<>=!~]", r)[0]: r for r in extras["dev"]}
    for dep in DEPENDENCIES:
        if dep.name in by_name:
            assert by_name[dep.name] == dep.requirement, dep.name


def test_every_bounded_range_has_a_top_so_an_untested_release_is_outside() -> None:
    for name in ("torch", "ray", "deepspeed", "mlflow", "transformers"):
        assert "<" in dependency(name).versions, name


@pytest.mark.parametrize(
    ("name", "version", "inside"),
    [
        ("torch", "2.13.0+cpu", True),  # a local build label is the same release
        ("torch", "2.11.0+cu130", True),
        ("torch", "2.10.0", False),
        ("torch", "2.16.0", False),
        ("ray", "2.60.0", True),
        ("ray", "2.61.0", False),
        ("ray", "not-a-version", False),
    ],
)
def test_a_version_is_inside_its_range_or_not(name: str, version: str, inside: bool) -> None:
    assert dependency(name).admits(version) is inside


def test_this_environment_is_inside_every_range() -> None:
    """The suite runs on the lock file's versions, which must be inside the ranges."""
    wrong = [row for row in versions_here() if row.wrong]
    assert wrong == [], stack_problem(wrong)


def test_a_wrong_stack_is_one_line_naming_each_library_and_the_pip_command() -> None:
    rows = found_from({"torch": "2.13.0", "ray": "2.40.0", "deepspeed": None, "mlflow": "3.17.2"})
    problem = stack_problem(rows, where="node 10.0.0.2")
    assert problem is not None and "\n" not in problem
    assert problem.startswith("node 10.0.0.2: ray 2.40.0 (trainstack needs ")
    assert "deepspeed not installed" in problem and "torch" not in problem.split("install")[0]
    assert install_command(rows) == (
        f"pip install '{dependency('ray').requirement}' '{dependency('deepspeed').requirement}'"
    )
    assert stack_problem(found_from({"torch": "2.13.0", "transformers": None})) is None


def test_a_jobs_runtime_env_installs_everything_but_holds_the_clusters_ray() -> None:
    packages = job_requirements(ray_version="2.58.1", extras=["hf"])
    assert "ray[default,train,tune]==2.58.1" in packages
    names = {re.split(r"[\[<>=!~]", p)[0] for p in packages}
    assert {"torch", "deepspeed", "mlflow", "transformers"} <= names
    assert "liger-kernel" not in names  # the gpu extra was not asked for
    assert "transformers" not in {
        re.split(r"[\[<>=]", p)[0] for p in job_requirements(ray_version="2.58.1")
    }


def test_the_floor_lane_installs_every_floor_exactly() -> None:
    """requirements/floor.in (what `make test-compat` runs first) pins each library at
    the floor of its range, so the floor the ranges declare is the one tested."""
    pinned = {}
    for line in (ROOT / "requirements" / "floor.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pinned[re.split(r"\[", name)[0]] = Version(version)
    for dep in DEPENDENCIES:
        if dep.needed_by == "gpu":  # CUDA only: no CPU lane can run it
            continue
        (floor,) = [Version(s.version) for s in SpecifierSet(dep.versions) if s.operator == ">="]
        assert pinned[dep.name] == floor, dep.name


def test_installing_md_gives_each_range_and_its_floors_reason() -> None:
    """docs/installing.md's table is the ranges' own: a range moved in stack.py (and
    pyproject) and not in the docs fails here."""
    rows = {
        line.split("|")[1].strip().split(" ")[0]: line
        for line in (ROOT / "docs/installing.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| library")
    }
    for dep in DEPENDENCIES:
        assert dep.name in rows, f"docs/installing.md has no row for {dep.name}"
        assert f"`{dep.versions}`" in rows[dep.name] and dep.floor in rows[dep.name]
