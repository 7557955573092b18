"""A finished sweep's results: one row per trial, the table (console and CSV), the
Pareto fronts of final loss against tokens/s and against bytes on the wire per step,
their plots, and the best trial."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainstack.sweep.spec import ObjectiveConfig

COMPLETED, STOPPED, FAILED, UNFINISHED = "completed", "stopped early", "failed", "unfinished"


@dataclass(kw_only=True)
class TrialRow:
    trial_id: str
    label: str
    """The trial's space values, short: `ddp, topk` or `zero, stage=2, lr=0.003`."""
    overrides: dict[str, Any]
    status: str
    """completed, stopped early (by ASHA), failed (after its retries) or unfinished."""
    step: int | None = None
    tokens: int | None = None
    eval_loss: float = math.nan
    """Held-out loss at the trial's last report (final for completed trials)."""
    tokens_per_s: float = math.nan
    """Completed: steady-state tokens/s of the run; else the last logged window."""
    elapsed_s: float = math.nan
    """Seconds of training to the last report (start-up excluded)."""
    bytes_per_step: float = math.nan
    """Bytes one rank handed to collectives per step: over the whole run (warm-up
    included) for completed trials, else the last logged step's; NaN where the strategy
    does not measure them."""
    error: str = ""


def label_for(overrides: Mapping[str, Any], *, skip: Collection[str] = ()) -> str:
    """`{"strategy.kind": "zero", "strategy.stage": 2}` -> `zero, stage=2`; keys in `skip`
    (those the space gives one value only, e.g. implied by a condition) are left out."""
    parts = []
    for key, value in overrides.items():
        if key in skip:
            continue
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        parts.append(shown if key.endswith(".kind") else f"{key.rsplit('.', 1)[-1]}={shown}")
    return ", ".join(parts) or "base"


Against = Literal["tokens_per_s", "bytes_per_step"]
"""The second axis of a front: tokens/s (more is better) or bytes per step (fewer)."""


def pareto_front(rows: Sequence[TrialRow], against: Against = "tokens_per_s") -> list[TrialRow]:
    """Completed trials no other completed trial beats on both loss and `against`,
    best on `against` first."""
    sign = 1.0 if against == "tokens_per_s" else -1.0

    def score(r: TrialRow) -> float:  # higher is better
        return sign * float(getattr(r, against))

    done = [r for r in rows if r.status == COMPLETED and _finite(r.eval_loss, score(r))]
    front = [
        r
        for r in done
        if not any(
            o.eval_loss <= r.eval_loss
            and score(o) >= score(r)
            and (o.eval_loss < r.eval_loss or score(o) > score(r))
            for o in done
        )
    ]
    return sorted(front, key=lambda r: -score(r))


def best_trial(rows: Sequence[TrialRow], objective: ObjectiveConfig) -> TrialRow | None:
    """The completed trial with the lowest final held-out loss, or (metric tokens_per_s)
    the fastest one whose loss is within `loss_bound`."""
    done = [r for r in rows if r.status == COMPLETED]
    if objective.metric == "eval_loss":
        done = [r for r in done if _finite(r.eval_loss)]
        return min(done, key=lambda r: r.eval_loss, default=None)
    bound = objective.loss_bound or math.inf
    done = [r for r in done if _finite(r.tokens_per_s) and r.eval_loss <= bound]
    return max(done, key=lambda r: r.tokens_per_s, default=None)


COLUMNS = (
    "trial",
    "setting",
    "status",
    "step",
    "tokens",
    "eval_loss",
    "tokens_per_s",
    "train_s",
    "bytes/step",
)


def table_rows(rows: Sequence[TrialRow]) -> list[list[str]]:
    return [
        [
            r.trial_id,
            r.label,
            r.status,
            "" if r.step is None else str(r.step),
            "" if r.tokens is None else str(r.tokens),
            fmt_number(r.eval_loss, ".4f"),
            fmt_number(r.tokens_per_s, ".0f"),
            fmt_number(r.elapsed_s, ".1f"),
            fmt_number(r.bytes_per_step, ",.0f"),
        ]
        for r in rows
    ]


def format_table(rows: Sequence[TrialRow], *, best: TrialRow | None) -> str:
    """An aligned text table; the best trial marked with `*`."""
    body = table_rows(rows)
    for line, row in zip(body, rows, strict=True):
        line[0] = ("* " if row is best else "  ") + line[0]
    header = ["  trial", *COLUMNS[1:]]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = [
        "  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
        for line in [header, *body]
    ]
    return "\n".join(lines)


def write_csv(rows: Sequence[TrialRow], path: Path) -> None:
    from trainstack.files import write_text_atomically

    keys = sorted({k for r in rows for k in r.overrides})
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([*COLUMNS, *keys, "error"])
    for r, line in zip(rows, table_rows(rows), strict=True):
        writer.writerow([*line, *(r.overrides.get(k, "") for k in keys), r.error])
    write_text_atomically(path, out.getvalue())


def plot_pareto(
    rows: Sequence[TrialRow], path: Path, *, title: str, against: Against = "tokens_per_s"
) -> None:
    """Final held-out loss against `against` for every completed trial, numbered on the
    plot and named in a key beside it, with the Pareto front drawn through the ones
    nothing beats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def x(r: TrialRow) -> float:
        return r.tokens_per_s / 1e3 if against == "tokens_per_s" else r.bytes_per_step

    done = [r for r in rows if r.status == COMPLETED and _finite(r.eval_loss, x(r))]
    front = pareto_front(rows, against)
    fig, (ax, key) = plt.subplots(
        1, 2, figsize=(12, 5.5), dpi=110, gridspec_kw={"width_ratios": [1.5, 1]}
    )
    ax.plot(
        [x(r) for r in front],
        [r.eval_loss for r in front],
        color="tab:orange",
        marker="o",
        markerfacecolor="none",
        markersize=13,
        zorder=2,
        label="Pareto front",
    )
    ax.scatter(
        [x(r) for r in done],
        [r.eval_loss for r in done],
        s=30,
        color="tab:blue",
        zorder=3,
        label="completed trial",
    )
    lines = []
    for number, r in enumerate(done, start=1):
        ax.annotate(
            str(number),
            (x(r), r.eval_loss),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
        mark = "*" if r in front else " "
        shown = f"{x(r):6.1f}k" if against == "tokens_per_s" else f"{x(r):9,.0f}"
        lines.append(f"{mark}{number:>3}  {r.eval_loss:.4f}  {shown}  {r.label}")
    stopped = sum(r.status == STOPPED for r in rows)
    failed = sum(r.status == FAILED for r in rows)
    note = f"{len(done)} completed ({stopped} stopped early by ASHA, {failed} failed: not plotted)"
    ax.set_title(f"{title}\n{note}", fontsize=10)
    if against == "tokens_per_s":
        ax.set_xlabel("throughput (thousand tokens/s, steady state)")
    else:
        ax.set_xscale("log")
        ax.set_xlabel("bytes on the wire per rank per step (log scale)")
    ax.set_ylabel("final held-out loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    key.axis("off")
    unit = "tokens/s" if against == "tokens_per_s" else "bytes/step"
    header = f"      loss   {unit}  setting   (* Pareto front)"
    key.text(0, 1, "\n".join([header, *lines]), family="monospace", fontsize=7.5, va="top")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def fmt_number(value: Any, spec: str, *, missing: str = "") -> str:
    """`value` formatted with `spec`, or `missing` when it is not a finite number."""
    return format(value, spec) if _finite(value) else missing


def _finite(*values: Any) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)
