"""Pre-flight's check of the libraries a run uses, against trainstack's tested ranges
(`trainstack.stack`, the table `trainstack doctor` prints): on the driver before Ray
starts, and on every node of a cluster once connected, so that a library too old or
missing is one line before the run, not a traceback in a worker."""

from __future__ import annotations

from typing import Any

from trainstack.config import ConfigError, JobConfig
from trainstack.stack import (
    DEPENDENCIES,
    Found,
    extras_for,
    found_from,
    stack_problem,
    untested_note,
    versions_here,
)


def needed_names(cfg: JobConfig) -> list[str]:
    """The libraries `cfg` needs: every core one, and its extras' (`hf` for a Hugging
    Face model or tokenized text)."""
    extras = set(
        extras_for(
            model_kind=cfg.model.kind, data_kind=cfg.data.kind, lora=bool(cfg.model.lora.rank)
        )
    )
    return [d.name for d in DEPENDENCIES if d.needed_by is None or d.needed_by in extras]


def check_versions_here(cfg: JobConfig) -> str | None:
    """ConfigError when a library `cfg` needs is missing or older than trainstack's
    floor in this Python; the one-line note to show when one is newer than the tested
    top (None when there is none)."""
    return _checked(versions_here(needed_names(cfg)), where="this Python")


def check_cluster_versions(cfg: JobConfig) -> str | None:
    """`check_versions_here` on every alive node of the connected cluster, asked by a
    task placed on each (they see the job's runtime environment, as its workers will)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from trainstack.stack import versions_report

    probe = ray.remote(num_cpus=0)(versions_report)
    nodes = [node for node in ray.nodes() if node["Alive"]]
    asked = [
        probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote()
        for node in nodes
    ]
    notes = []
    wanted = set(needed_names(cfg))
    for node, answer in zip(nodes, asked, strict=True):
        where = f"node {node['NodeManagerAddress']}"
        try:
            versions: dict[str, Any] = ray.get(answer)
        except Exception as err:  # trainstack itself does not import there
            raise ConfigError(
                f"{where}: trainstack does not import in the job's environment there "
                f"({_cause(err)}); install it into the cluster's image, or submit with "
                "`trainstack submit --deps pip` (or uv)"
            ) from None
        rows = found_from({k: v for k, v in versions.items() if k in wanted})
        note = _checked(rows, where=where)
        if note is not None:
            notes.append(note)
    return "; ".join(notes) or None


def _checked(rows: list[Found], *, where: str) -> str | None:
    problem = stack_problem(rows, where=where, refused_only=True)
    if problem is not None:
        raise ConfigError(problem)
    return untested_note(rows, where=where)


def _cause(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__
