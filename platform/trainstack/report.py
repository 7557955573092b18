"""`trainstack report RUN`: PNG plots and a `report.md` for one tracked run.

    trainstack report runs/demo            # a run directory: its tracking.json names the run
    trainstack report 7497a136d4fc4376b3e23e66a4a57030 --tracking-uri sqlite:///mlflow.db

Everything comes from the run's MLflow record as `trainstack.tracking` writes it: the
per-step metric histories, the `summary.json` and `spec.yaml` artifacts and the run's
tags. A plot is drawn only from what the run logged (a parameter-server run has no
per-step memory or wire bytes, a CPU run no MFU); report.md says what was left out.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainstack.config import ConfigError

if TYPE_CHECKING:
    from trainstack.report_plots import Plot

PLOT_FILES = ("loss.png", "throughput.png", "memory.png", "comm.png", "staleness.png")
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Series:
    """One metric's history in logging order; a replayed or resumed step appears again."""

    steps: list[int]
    values: list[float]
    times_s: list[float]
    """When each value was logged, in seconds since the run started (monotonic across
    restarts, unlike the workers' `elapsed_s`)."""

    def pieces(self) -> list[range]:
        """Index ranges of the stretches whose steps only go forward (one per attempt)."""
        starts = [0] + [i for i in range(1, len(self.steps)) if self.steps[i] <= self.steps[i - 1]]
        ends = [*starts[1:], len(self.steps)]
        return [range(a, b) for a, b in zip(starts, ends, strict=True) if b > a]


@dataclass(frozen=True, kw_only=True)
class Restart:
    count: int
    """The `restarts` metric after it (1 for the first restart)."""
    step: int
    """The first step logged after the restart."""
    time_s: float
    """When that step was logged, seconds since the run started."""
    before_s: float
    """When the last step before the restart was logged."""


@dataclass(frozen=True, kw_only=True)
class TrackedRun:
    """What MLflow holds about one trainstack run."""

    run_id: str
    name: str
    status: str
    tracking_uri: str
    tags: dict[str, str]
    start_ms: int
    end_ms: int | None
    summary: dict[str, Any]
    """`summary.json`; empty when the run never finished (killed driver)."""
    spec_text: str | None
    """`spec.yaml` as logged; None for runs not started by `trainstack run`."""
    series: dict[str, Series]

    def number(self, key: str, *, within: str | None = None) -> float | None:
        """A finite number from the summary (or its `within` dict), else None."""
        source = self.summary.get(within, {}) if within else self.summary
        value = source.get(key) if isinstance(source, dict) else None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value) if math.isfinite(float(value)) else None
        return None

    def restarts(self) -> list[Restart]:
        """Where the driver's `restarts` count goes up (none without that metric)."""
        found = self.series.get("restarts")
        steps, values, times = (found.steps, found.values, found.times_s) if found else ([], [], [])
        rises = [i for i in range(1, len(values)) if values[i] > values[i - 1]]
        return [
            Restart(count=int(values[i]), step=steps[i], time_s=times[i], before_s=times[i - 1])
            for i in rises
        ]


# ---- reading the run -------------------------------------------------------------


def write_report(run: str, *, out_dir: Path, tracking_uri: str | None) -> Path:
    """Write the plots and report.md of `run` (an MLflow run id or a run directory with
    tracking.json) into `out_dir`; return report.md's path. Raises ConfigError for a run
    or store that cannot be found."""
    return render_report(load_run(run, tracking_uri=tracking_uri), out_dir=out_dir)


def load_run(run: str, *, tracking_uri: str | None) -> TrackedRun:
    """Read everything the report needs from MLflow. `tracking_uri` None: the run
    directory's recorded store, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db."""
    import mlflow

    from trainstack.tracking import HTTP_BOUNDS  # imports torch (via checkpoint): kept lazy

    for name, value in HTTP_BOUNDS.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    run_id, uri = _locate(run, tracking_uri)
    _check_store_exists(uri)
    try:
        client = mlflow.MlflowClient(tracking_uri=uri)
        found = client.get_run(run_id)
    except Exception as e:  # MlflowException; a bad URI, a server that does not answer
        if getattr(e, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
            raise ConfigError(
                f"no MLflow run {run_id!r} in {uri}: RUN must be a run id in that store "
                "(the 'mlflow run' line of `trainstack run`) or a run directory with "
                "tracking.json; pass --tracking-uri for another store"
            ) from None
        raise ConfigError(f"cannot read tracking store {uri}: {_first_line(e)}") from None
    summary_text = _artifact_text(client, run_id, "summary.json")
    keys = sorted(k for k in found.data.metrics if not k.startswith("final/"))
    start_ms = int(found.info.start_time)
    return TrackedRun(
        run_id=run_id,
        name=found.info.run_name or run_id,
        status=found.info.status,
        tracking_uri=uri,
        tags=dict(found.data.tags),
        start_ms=start_ms,
        end_ms=found.info.end_time,
        summary=json.loads(summary_text) if summary_text else {},
        spec_text=_artifact_text(client, run_id, "spec.yaml"),
        series={k: _series(client.get_metric_history(run_id, k), start_ms) for k in keys},
    )


def _locate(run: str, tracking_uri: str | None) -> tuple[str, str]:
    """(run id, resolved tracking URI) for a run id or a run directory."""
    from trainstack.tracking import RECORD_FILE, TrackingRecord, resolve_tracking_uri

    path = Path(run).expanduser()
    if path.is_dir():
        record_path = path / RECORD_FILE
        if not record_path.is_file():
            raise ConfigError(
                f"run directory {str(path)!r} has no {RECORD_FILE}: RUN must be an MLflow run "
                "id or the directory of a run trained with tracking.backend: mlflow"
            )
        try:
            record = TrackingRecord(**json.loads(record_path.read_text()))
        except (OSError, ValueError, TypeError):
            raise ConfigError(
                f"{str(record_path)!r} is not a tracking record: expected JSON with "
                "tracking_uri, experiment_id and run_id"
            ) from None
        return record.run_id, resolve_tracking_uri(tracking_uri or record.tracking_uri)
    if os.sep in run or run.startswith("."):
        raise ConfigError(
            f"run directory {run!r} does not exist: RUN must be an MLflow run id or a run "
            "directory with tracking.json"
        )
    return run, resolve_tracking_uri(tracking_uri or "")


def _check_store_exists(uri: str) -> None:
    """A missing SQLite file is an error here: MLflow would create an empty store."""
    path = uri.removeprefix("sqlite:///").split("?")[0]
    if uri.startswith("sqlite:///") and path != ":memory:" and not Path(path).is_file():
        raise ConfigError(
            f"tracking store {uri} does not exist: pass --tracking-uri, set "
            "$MLFLOW_TRACKING_URI, or run where the job's mlflow.db is"
        )


def _artifact_text(client: Any, run_id: str, name: str) -> str | None:
    if name not in {a.path for a in client.list_artifacts(run_id)}:
        return None
    with tempfile.TemporaryDirectory(prefix="trainstack-report-") as tmp:
        return Path(client.download_artifacts(run_id, name, tmp)).read_text()


def _series(history: list[Any], start_ms: int) -> Series:
    ordered = sorted(history, key=lambda m: m.timestamp)  # stable: the store's order on ties
    return Series(
        steps=[int(m.step) for m in ordered],
        values=[float(m.value) for m in ordered],
        times_s=[(m.timestamp - start_ms) / 1000 for m in ordered],
    )


def _first_line(error: BaseException) -> str:
    text = (str(error).strip().splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# ---- report.md --------------------------------------------------------------------


def render_report(run: TrackedRun, *, out_dir: Path) -> Path:
    """Draw the plots of `run` into `out_dir` and write report.md there; return its path."""
    import matplotlib

    from trainstack.report_plots import (  # imports this module: kept lazy
        STYLE,
        draw_comm,
        draw_loss,
        draw_memory,
        draw_staleness,
        draw_throughput,
    )

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write the report to {str(out_dir)!r}: {e.strerror}") from None
    for name in PLOT_FILES:  # a plot this run cannot have must not linger from an earlier one
        (out_dir / name).unlink(missing_ok=True)
    drawers = [draw_loss, draw_throughput, draw_memory, draw_comm]
    if isinstance(run.summary.get("ps"), dict):
        drawers.append(draw_staleness)
    with matplotlib.rc_context(STYLE):
        plots = [draw(run, out_dir) for draw in drawers]
    path = out_dir / "report.md"
    path.write_text(_markdown(run, plots))
    return path


def _markdown(run: TrackedRun, plots: list[Plot]) -> str:
    overview = _overview(run)
    lines = [f"# Run report: {run.name}", "", *_table(overview[0], overview[1:]), ""]
    lines += ["## Final figures", "", *_table(("figure", "value"), _final_figures(run)), ""]
    restarts = _restart_lines(run)
    if restarts:
        lines += ["## Restarts", "", *restarts, ""]
    lines += ["## Plots", ""]
    for plot in plots:
        lines += [f"### {plot.title}", ""]
        if plot.file:
            lines += [f"![{plot.title}]({plot.file})", ""]
        lines += [plot.note, ""]
    if run.spec_text:
        lines += ["## Spec", "", "```yaml", run.spec_text.rstrip(), "```", ""]
    return "\n".join(lines)


def _table(header: tuple[str, str], rows: list[tuple[str, str]]) -> list[str]:
    return [f"| {header[0]} | {header[1]} |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def _overview(run: TrackedRun) -> list[tuple[str, str]]:
    s, tags = run.summary, run.tags
    started = datetime.fromtimestamp(run.start_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = tags.get("trainstack.git_commit", "")
    version = tags.get("trainstack.version", "?") + (f" (commit {commit[:10]})" if commit else "")
    params, size = run.number("params"), s.get("world_size") or tags.get("trainstack.world_size")
    device = f"{size} × {str(s['device']).upper()} worker(s)" if s.get("device") else "—"
    return [
        ("run", f"**{run.name}**"),
        ("MLflow run id", f"`{run.run_id}`"),
        ("status", run.status),
        ("strategy", str(s.get("strategy") or tags.get("trainstack.strategy", "?"))),
        ("world size", str(size or "?")),
        ("device", device),
        ("parameters", f"{params:,.0f}" if params else "—"),
        ("started", started),
        ("trainstack", version),
        ("tracking store", f"`{run.tracking_uri}`"),
        ("run directory", f"`{s['run_dir']}`" if s.get("run_dir") else "—"),
    ]


def _final_figures(run: TrackedRun) -> list[tuple[str, str]]:
    rows = [
        ("final loss", _final_loss(run)),
        ("eval loss vs entropy floor", _versus_floor(run)),
        ("tokens/s", _fmt(run.number("tokens_per_s"), "{:,.0f}" + _tokens_basis(run))),
        ("MFU", _fmt(run.number("mfu"), "{:.2%}", missing=mfu_missing(run))),
        (
            "peak memory",
            _fmt(run.number("peak_mem_bytes"), "{:,.0f} MiB", scale=1 / MIB) + _memory_basis(run),
        ),
        ("restarts", _restart_count(run)),
        ("wall time", _wall_time(run)),
        ("steps", _fmt(run.number("steps"), "{:,.0f}")),
    ]
    if run.number("eval_bits_per_byte") is not None:
        rows.insert(2, ("bits per byte", _bits_per_byte(run)))
    if isinstance(run.summary.get("ps"), dict):
        rows += _ps_figures(run)
    return rows


def _tokens_basis(run: TrackedRun) -> str:
    if run.summary.get("strategy") == "ps":
        return " (all workers, mean over training)"
    return " (steady state)" if run.summary else ""


def _memory_basis(run: TrackedRun) -> str:
    if run.number("peak_mem_bytes") is None:
        return ""
    if run.summary.get("strategy") == "ps":
        return " (largest worker)"
    return " (rank 0, GPU allocated)" if run.summary.get("device") == "cuda" else " (rank 0, RSS)"


def mfu_missing(run: TrackedRun) -> str:
    device = str(run.summary.get("device", "")).upper()
    return f"n/a (no peak FLOPs known for {device})" if device else "n/a (not logged)"


def _final_loss(run: TrackedRun) -> str:
    final, held_out = run.number("final_loss"), run.number("eval_loss")
    if final is not None:
        return f"{final:.4f} ({'held-out' if final == held_out else 'training'})"
    loss = run.series.get("loss")
    return f"{loss.values[-1]:.4f} (last logged training loss)" if loss else "—"


def _versus_floor(run: TrackedRun) -> str:
    held_out, floor = run.number("eval_loss"), run.number("entropy_floor")
    if held_out is None or floor is None or floor <= 0:
        return "—"
    above = (held_out - floor) / floor
    return f"{held_out:.4f} vs {floor:.4f}: {above:+.1%} above the floor"


def _bits_per_byte(run: TrackedRun) -> str:
    """A text job's held-out bits per byte, and gzip -9's and xz -9's on the same bytes."""
    from trainstack.runtime.progress import bits_per_byte_line

    return bits_per_byte_line(run.summary)


def _restart_count(run: TrackedRun) -> str:
    count = run.number("restarts")
    count = len(run.restarts()) if count is None else count
    lost = [r.get("steps_lost") for r in run.summary.get("recovery", []) if isinstance(r, dict)]
    known = ", ".join(str(n) for n in lost if isinstance(n, int))
    return f"{count:.0f}" + (f" (steps lost: {known})" if known else "")


def _wall_time(run: TrackedRun) -> str:
    wall, train = run.number("wall_s"), run.number("train_s")
    if wall is None and run.end_ms is not None:
        wall = (run.end_ms - run.start_ms) / 1000
    if wall is None:
        return "—"
    return f"{wall:,.1f} s" + (f" (training {train:,.1f} s)" if train is not None else "")


def _ps_figures(run: TrackedRun) -> list[tuple[str, str]]:
    def ps(key: str) -> float | None:
        return run.number(key, within="ps")

    staleness = "mean {:.2f}, p50 {:g}, p99 {:g}, max {:g} updates".format(
        *(ps(f"staleness_{n}") or 0.0 for n in ("mean", "p50", "p99", "max"))
    )
    return [
        ("ps consistency", str(run.summary["ps"].get("consistency", "—"))),
        ("ps updates/s (per shard)", _fmt(ps("updates_per_s"), "{:,.1f}")),
        ("ps pushes (rejected)", f"{ps('pushes') or 0:,.0f} ({ps('rejected') or 0:,.0f})"),
        ("ps staleness", staleness),
        ("ps largest clock gap", _fmt(ps("clock_gap_max"), "{:g} steps")),
        ("ps waits", f"{ps('waits') or 0:,.0f} ({ps('wait_s') or 0:,.1f} s)"),
        ("ps bytes pushed", _fmt(ps("bytes_pushed"), "{:,.1f} MiB", scale=1 / MIB)),
        ("ps compression ratio", _fmt(ps("compression_ratio"), "{:.2f}×")),
    ]


def _restart_lines(run: TrackedRun) -> list[str]:
    recovery = [r for r in run.summary.get("recovery", []) if isinstance(r, dict)]
    lines = []
    for i, restart in enumerate(run.restarts()):
        line = (
            f"- restart {restart.count}: logging resumed at step {restart.step}, "
            f"{restart.time_s:,.1f} s into the run"
        )
        if i < len(recovery) and recovery[i].get("failed_after_step") is not None:
            r = recovery[i]
            line += (
                f"; the group failed after step {r['failed_after_step']} and resumed from "
                f"the checkpoint at step {r['resumed_from_step']} ({r['steps_lost']} steps lost)"
            )
        lines.append(line)
    return lines


def _fmt(value: float | None, spec: str, *, scale: float = 1.0, missing: str = "—") -> str:
    return missing if value is None else spec.format(value * scale)


# ---- command line -----------------------------------------------------------------


def add_report_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add `trainstack report` to the CLI's subcommands."""
    parser = commands.add_parser("report", help="write plots and report.md for one tracked run")
    parser.add_argument(
        "run", metavar="RUN", help="an MLflow run id, or a run directory holding tracking.json"
    )
    parser.add_argument(
        "--out", default=None, metavar="DIR", help="output folder (default: reports/<run name>)"
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow store (default: the run directory's tracking.json, else "
        "$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )
    parser.set_defaults(handler=report_command)
    return parser


def report_command(args: argparse.Namespace) -> int:
    """Write the report; 0 on success, 2 (one error line) for a run that cannot be found."""
    try:
        run = load_run(args.run, tracking_uri=args.tracking_uri)
        out_dir = Path(args.out) if args.out else Path("reports") / _folder_name(run.name)
        path = render_report(run, out_dir=out_dir)
    except ConfigError as err:
        print(f"trainstack: error: {err}", file=sys.stderr)
        return 2
    pngs = sorted(p.name for p in out_dir.glob("*.png") if p.name in PLOT_FILES)
    print(f"trainstack: wrote {path} with {', '.join(pngs) or 'no plots'}")
    return 0


def _folder_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "run"
