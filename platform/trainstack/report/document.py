"""`report.md` and its plots for one tracked run (`write_report`).

A plot is drawn only from what the run logged (a parameter-server run has no per-step
memory or wire bytes, a CPU run no MFU); report.md says what was left out.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from trainstack.config import ConfigError
from trainstack.report.plots import (
    STYLE,
    Plot,
    draw_comm,
    draw_experts,
    draw_goodput,
    draw_loss,
    draw_memory,
    draw_preferences,
    draw_staleness,
    draw_throughput,
)
from trainstack.report.runs import MIB, TrackedRun, load_run, mfu_missing
from trainstack.runtime.progress import bits_per_byte_line, goodput_line, preferences_line

PLOT_FILES = (
    "goodput.png",
    "loss.png",
    "throughput.png",
    "memory.png",
    "comm.png",
    "staleness.png",
    "experts.png",
    "preferences.png",
)


# ---- reading the run -------------------------------------------------------------


def write_report(run: str, *, out_dir: Path, tracking_uri: str | None) -> Path:
    """Write the plots and report.md of `run` (an MLflow run id or a run directory with
    tracking.json) into `out_dir`; return report.md's path. Raises ConfigError for a run
    or store that cannot be found."""
    return render_report(load_run(run, tracking_uri=tracking_uri), out_dir=out_dir)


# ---- report.md --------------------------------------------------------------------


def render_report(run: TrackedRun, *, out_dir: Path) -> Path:
    """Draw the plots of `run` into `out_dir` and write report.md there; return its path."""
    import matplotlib

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write the report to {str(out_dir)!r}: {e.strerror}") from None
    for name in PLOT_FILES:  # a plot this run cannot have must not linger from an earlier one
        (out_dir / name).unlink(missing_ok=True)
    drawers = [draw_loss, draw_throughput, draw_memory, draw_comm]
    if isinstance(run.summary.get("ps"), dict):
        drawers.append(draw_staleness)
    if "moe_load_e0" in run.series:
        drawers.append(draw_experts)
    if "eval_reward_margin" in run.series:
        drawers.append(draw_preferences)
    if run.number("goodput") is not None:
        drawers.append(draw_goodput)
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
        ("goodput", goodput_line(run.summary) if run.number("goodput") is not None else "—"),
        ("steps", _fmt(run.number("steps"), "{:,.0f}")),
    ]
    if run.number("eval_bits_per_byte") is not None:
        rows.insert(2, ("bits per byte", _bits_per_byte(run)))
    if run.number("eval_reward_margin") is not None:
        rows.insert(2, ("preferences", preferences_line(run.summary)))
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
