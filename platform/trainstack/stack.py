"""The stack a user brings: the versions of each library trainstack is tested with, what
is installed here, and what to install when something is outside.

`DEPENDENCIES` is the table `pyproject.toml`'s ranges are checked against
(`tests/unit/test_stack.py`); `make test-compat` runs every floor, and `make test` the
lock file's versions. `trainstack doctor` prints `versions_here()`; pre-flight refuses
a run in one line (`stack_problem`) when a library it needs is outside its range, on
the driver or on a cluster's node. No torch or Ray is imported here: the check must
answer where they are missing or broken.
"""

from __future__ import annotations

import importlib.metadata
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


@dataclass(frozen=True, kw_only=True)
class Dependency:
    """One library trainstack needs, as `pyproject.toml` declares it."""

    name: str
    """The distribution's name on PyPI."""
    versions: str
    """The tested range: its floor and its top are run by `make test-compat`."""
    extras: str = ""
    """The distribution's own extras trainstack asks for (`ray[default,train,tune]`)."""
    needed_by: str | None = None
    """None: every run needs it; else trainstack's extra that brings it (`hf`, `gpu`)."""
    used_for: str
    """What trainstack uses it for, as `trainstack doctor` says it."""
    floor: str
    """Why the floor is where it is (docs/installing.md says more)."""

    @property
    def requirement(self) -> str:
        """The requirement as pip takes it: `ray[default,train,tune]>=2.51,<2.61`."""
        extras = f"[{self.extras}]" if self.extras else ""
        return f"{self.name}{extras}{self.versions}"

    def admits(self, version: str) -> bool:
        """Whether `version` is inside the range (a local label such as `+cpu` or
        `+cu130` is part of the same release)."""
        try:
            return SpecifierSet(self.versions).contains(Version(version), prereleases=True)
        except InvalidVersion:
            return False

    def above(self, version: str) -> bool:
        """Whether `version` is newer than the range's top: untested, not known broken."""
        try:
            release = Version(Version(version).base_version)
        except InvalidVersion:
            return False
        tops = [Version(s.version) for s in SpecifierSet(self.versions) if s.operator == "<"]
        return any(release >= top for top in tops)


DEPENDENCIES: tuple[Dependency, ...] = (
    Dependency(
        name="torch",
        versions=">=2.11,<2.16",
        used_for="the model, DDP, FSDP2, DTensor (tensor parallel), pipelining, DCP",
        floor="the oldest torch the compatibility lane and the GPU image run end to end; "
        "2.8-2.10 passed the gloo tests once by hand (dualpipev needs 2.9, zbv on gloo 2.10, "
        "both refused before) but no lane runs them",
    ),
    Dependency(
        name="ray",
        versions=">=2.51,<2.61",
        extras="default,train,tune",
        used_for="Ray Train V2 worker groups, Ray Tune sweeps, actors, the Job API",
        floor="Ray Train V2 on by default (its UserCallback, controller_failure_limit); "
        "elastic groups need 2.55 and are refused before it",
    ),
    Dependency(
        name="deepspeed",
        versions=">=0.19.3,<0.20",
        used_for="strategy.kind zero (ZeRO 1/2/3, offload) and its pipeline engine",
        floor="its pipeline engine averages the micro-batches' gradients once (before "
        "0.19.3 earlier stages divide twice; before 0.18.3 they are summed)",
    ),
    Dependency(
        name="mlflow",
        versions=">=3.9,<3.18",
        used_for="tracking (a SQLite store or a tracking server), trainstack report",
        floor="its SQLite store imports under SQLAlchemy 2.1, which MLflow admits and pip "
        "picks (3.8 and older import a class 2.1 removed); 3.18 does not install",
    ),
    Dependency(
        name="numpy",
        versions=">=1.26.4",
        used_for="data sources and token files",
        floor="numpy 1 as well as 2: the floor lane runs 1.26.4",
    ),
    Dependency(
        name="pyyaml",
        versions=">=6.0.1",
        used_for="job specs (safe_load)",
        floor="the oldest PyYAML 6 with wheels for Python 3.11",
    ),
    Dependency(
        name="matplotlib",
        versions=">=3.8",
        used_for="trainstack report's plots",
        floor="the floor lane's trainstack report runs 3.8.0",
    ),
    Dependency(
        name="packaging",
        versions=">=23.2",
        used_for="this check of versions",
        floor="the floor lane runs 23.2 (the oldest MLflow 3.9 and Ray 2.51 agree on)",
    ),
    Dependency(
        name="transformers",
        versions=">=5.21,<5.25",
        needed_by="hf",
        used_for="model.kind hf (any Hugging Face causal LM), tokenizers for text data",
        floor="configs as dataclasses (5.4), pipeline plans that keep lm_head (5.14), "
        "gemma2 not claiming an sdpa that drops its soft-capping (5.21)",
    ),
    Dependency(
        name="peft",
        versions=">=0.21,<0.22",
        needed_by="hf",
        used_for="model.lora (LoRA adapters over frozen weights, exported as peft folders)",
        floor="the floor lane trains, merges and exports adapters with 0.21.0",
    ),
    Dependency(
        name="liger-kernel",
        versions=">=0.8",
        needed_by="gpu",
        used_for="model.fused_loss on a GPU (fused linear + cross-entropy)",
        floor="LigerFusedLinearCrossEntropyLoss as trainstack calls it",
    ),
)


def dependency(name: str) -> Dependency:
    """The table's entry for distribution `name`."""
    for dep in DEPENDENCIES:
        if dep.name == name:
            return dep
    raise KeyError(name)


@dataclass(frozen=True, kw_only=True)
class Found:
    """One dependency as installed in an environment."""

    dependency: Dependency
    version: str | None
    """None: not installed."""

    @property
    def status(self) -> str:
        """`ok`; `below` (older than the floor: trainstack needs what it lacks), `above`
        (newer than the top: untested), `missing` (needed, not installed) or `absent`
        (an extra's, not installed: only the runs that need it are refused)."""
        if self.version is None:
            return "absent" if self.dependency.needed_by else "missing"
        if self.dependency.admits(self.version):
            return "ok"
        return "above" if self.dependency.above(self.version) else "below"

    @property
    def wrong(self) -> bool:
        """Outside the tested range, or needed and not installed."""
        return self.status in ("below", "above", "missing")

    @property
    def refused(self) -> bool:
        """What pre-flight refuses a run for (it only warns of `above`)."""
        return self.status in ("below", "missing")


def installed_version(name: str) -> str | None:
    """The installed version of distribution `name` in this Python, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions_here(names: Iterable[str] | None = None) -> list[Found]:
    """Each dependency (or those named) as installed in this Python."""
    wanted = set(names) if names is not None else None
    return [
        Found(dependency=dep, version=installed_version(dep.name))
        for dep in DEPENDENCIES
        if wanted is None or dep.name in wanted
    ]


def found_from(versions: dict[str, str | None]) -> list[Found]:
    """`Found` rows for versions reported from elsewhere (a cluster's node)."""
    return [
        Found(dependency=dep, version=versions.get(dep.name))
        for dep in DEPENDENCIES
        if dep.name in versions
    ]


def install_command(found: Iterable[Found]) -> str:
    """The pip command that brings each wrong row inside its range."""
    wrong = [row.dependency.requirement for row in found if row.wrong]
    return "pip install " + " ".join(shlex.quote(req) for req in wrong) if wrong else ""


def describe(row: Found) -> str:
    """`ray 2.40.0 (trainstack needs >=2.51,<2.61)`, `deepspeed not installed (...)`."""
    have = row.version or "not installed"
    return f"{row.dependency.name} {have} (trainstack needs {row.dependency.versions})"


def stack_problem(
    found: Iterable[Found], *, where: str = "here", refused_only: bool = False
) -> str | None:
    """One line naming every wrong row (or only those pre-flight refuses) and what to
    install, or None when there are none."""
    rows = [row for row in found if (row.refused if refused_only else row.wrong)]
    if not rows:
        return None
    listed = "; ".join(describe(row) for row in rows)
    fix = install_command(rows)
    return f"{where}: {listed}; install with `{fix}` (trainstack doctor says more)"


def untested_note(found: Iterable[Found], *, where: str = "here") -> str | None:
    """One line naming the libraries newer than trainstack's tested tops, or None."""
    rows = [row for row in found if row.status == "above"]
    if not rows:
        return None
    listed = ", ".join(describe(row) for row in rows)
    return f"{where}: {listed}: newer than trainstack is tested with; a failure may be theirs"


DEPS_CHOICES = ("image", "pip", "uv")
"""Where a job's libraries come from on a cluster: its image has them, or the job's
runtime environment installs them with pip or uv."""


def extras_for(*, model_kind: str, data_kind: str, lora: bool = False) -> list[str]:
    """trainstack's extras a job needs: `hf` for a Hugging Face model, for the
    tokenizers of text, chat and preference data, and for LoRA's peft."""
    needs_hf = model_kind == "hf" or data_kind in ("text", "chat", "preference") or lora
    return ["hf"] if needs_hf else []


def job_requirements(*, ray_version: str, extras: Iterable[str] = ()) -> list[str]:
    """What a job's runtime environment installs on a cluster whose image has Ray
    `ray_version` (and perhaps nothing else): every dependency of trainstack and of
    its `extras`, with Ray pinned to the cluster's own, so the resolver keeps it and
    resolves the rest against it. The caller checks `ray_version` against the range
    first (`dependency("ray").admits`)."""
    wanted = set(extras)
    requirements = []
    for dep in DEPENDENCIES:
        if dep.needed_by is not None and dep.needed_by not in wanted:
            continue
        if dep.name == "ray":
            requirements.append(f"ray[{dep.extras}]=={ray_version}")
        else:
            requirements.append(dep.requirement)
    return requirements


def versions_report() -> dict[str, str | None]:
    """Every dependency's installed version here, by name (what a cluster's node sends
    back to `trainstack doctor` and to pre-flight)."""
    return {dep.name: installed_version(dep.name) for dep in DEPENDENCIES}
