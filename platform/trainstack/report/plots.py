"""The PNG plots of `trainstack report`: one figure per aspect of a tracked run (loss,
throughput, memory, communication, parameter-server staleness), drawn on Agg figures
without pyplot. A drawer returns a `Plot` saying what it drew, or why it drew nothing."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainstack.report.runs import MIB, Series, TrackedRun, mfu_missing
from trainstack.runtime.progress import GOODPUT_PARTS, goodput_line

FIGSIZE_IN = (12.0, 7.0)
DPI = 100
"""12 x 7 inches at 100 dpi: 1200 x 700 px, readable when a README shows it full width."""
STYLE: dict[Any, Any] = {
    "font.size": 13,
    "axes.titlesize": 15,
    "axes.labelsize": 13,
    "legend.fontsize": 12,
    "axes.grid": True,
    "grid.alpha": 0.3,
}
LINE = {"linewidth": 2, "marker": "o", "markersize": 3}
EVAL_MARKERS = {"linestyle": "none", "marker": "D", "markersize": 8, "color": "tab:orange"}
FLOOR_LINE = {"color": "black", "linestyle": "--", "linewidth": 1.5}
REFERENCE_LINE = {"linestyle": ":", "linewidth": 2}
COMPRESSORS = (
    ("gzip -9", "gzip_bits_per_byte", "tab:gray"),
    ("xz -9", "xz_bits_per_byte", "tab:brown"),
)
RESTART_COLOR = "tab:red"
WHITE_BOX = {"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none"}
RESTART_TAG = {"ha": "right", "va": "top", "color": RESTART_COLOR, "bbox": WHITE_BOX}
PANEL_NOTE = {"ha": "center", "va": "center", "fontsize": 16, "color": "dimgray", "bbox": WHITE_BOX}


@dataclass(frozen=True, kw_only=True)
class Plot:
    title: str
    file: str | None
    """The PNG's name in the report folder; None when there was nothing to draw."""
    note: str
    """What the plot shows, or why it was not drawn."""


def _new_figure(rows: int = 1, cols: int = 1, **grid: Any) -> tuple[Any, Any]:
    """An Agg-backed figure (no pyplot, no global backend switch) and its axes grid."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False, **grid)


def _save(fig: Any, out_dir: Path, name: str, *, title: str, note: str) -> Plot:
    fig.savefig(out_dir / name)
    return Plot(title=title, file=name, note=note)


def _line(ax: Any, series: Series, *, x: str, scale: float = 1.0, **style: Any) -> None:
    """Draw `series` against its steps (`x="step"`) or wall time (`x="time"`), one line
    per attempt so that steps replayed after a restart do not draw back over the curve."""
    xs = series.steps if x == "step" else series.times_s
    label = style.pop("label", None)
    for i, piece in enumerate(series.pieces()):
        ys = [series.values[j] * scale for j in piece]
        ax.plot([xs[j] for j in piece], ys, label=label if i == 0 else None, **LINE, **style)


def _from_zero(ax: Any, series: Series, *, scale: float = 1.0) -> None:
    """Y axis from 0 with headroom above the largest value for the restart labels."""
    ax.set_ylim(0, max(max(series.values) * scale * 1.15, 1e-9))


def _mark_restarts(ax: Any, run: TrackedRun, *, x: str, legend: bool = False) -> None:
    """A dotted line labelled "restart" where the `restarts` metric goes up; on a time axis
    the stretch with no progress before it is shaded."""
    for i, restart in enumerate(run.restarts()):
        if x == "time":
            ax.axvspan(restart.before_s, restart.time_s, color=RESTART_COLOR, alpha=0.08)
        at = restart.step if x == "step" else restart.time_s
        label = "restart" if legend and i == 0 else None
        ax.axvline(at, color=RESTART_COLOR, linestyle=":", linewidth=2, label=label)
        ax.annotate("restart", (at, 0.97), xycoords=ax.get_xaxis_transform(), **RESTART_TAG)


def draw_loss(run: TrackedRun, out_dir: Path) -> Plot:
    loss = run.series.get("loss")
    if loss is None:
        return Plot(title="Loss", file=None, note="Not drawn: the run logged no training loss.")
    fig, axes = _new_figure()
    ax = axes[0][0]
    _line(ax, loss, x="step", color="tab:blue", label="training loss")
    eval_points = _eval_points(run, last_step=loss.steps[-1])
    if eval_points:
        ax.plot(*zip(*eval_points, strict=True), label="held-out eval loss", **EVAL_MARKERS)
    floor = run.number("entropy_floor")
    if floor is not None:
        ax.axhline(floor, label=f"entropy floor ({floor:.4f})", **FLOOR_LINE)
    compressors = _draw_compressors(ax, run)
    _mark_restarts(ax, run, x="step", legend=True)
    ax.set(title=f"{run.name}: loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax.legend(loc="center right")
    ps = run.summary.get("strategy") == "ps"
    what = "the workers' recent losses, averaged" if ps else "mean over ranks"
    note = f"Training loss ({what}) at each logged step; {len(eval_points)} held-out point(s)"
    note += f"; dashed: the data's entropy floor, {floor:.4f} nats." if floor else "."
    if eval_points and floor:
        note += f" The last held-out loss is {eval_points[-1][1] / floor - 1:+.1%} above it."
    note += compressors
    return _save(fig, out_dir, "loss.png", title="Loss", note=note)


def _draw_compressors(ax: Any, run: TrackedRun) -> str:
    """Dotted lines where gzip -9 and xz -9 are on the held-out bytes (a text job's
    `*_bits_per_byte`, as nats per token); the sentence saying so, or ""."""
    tokens, size = run.number("eval_tokens"), run.number("eval_bytes")
    drawn = []
    for name, key, color in COMPRESSORS:
        bits = run.number(key)
        if bits is None or not tokens or not size:
            continue
        label = f"{name} on the held-out bytes ({bits:.3f} bits/byte)"
        ax.axhline(bits * math.log(2) * size / tokens, label=label, color=color, **REFERENCE_LINE)
        drawn.append(f"{name} {bits:.3f}")
    if not drawn:
        return ""
    model = run.number("eval_bits_per_byte")
    ours = f"; the model: {model:.3f}" if model is not None else ""
    return (
        f" Dotted: {' and '.join(drawn)} bits per byte on the same held-out bytes{ours} "
        "(drawn in nats per token)."
    )


def _eval_points(run: TrackedRun, *, last_step: int) -> list[tuple[float, float]]:
    """Held-out losses logged during training, plus the final one at the last step."""
    logged = run.series.get("eval_loss")
    points = list(zip(map(float, logged.steps), logged.values, strict=True)) if logged else []
    final = run.number("eval_loss")
    if final is not None and all(step != last_step for step, _ in points):
        points.append((float(last_step), final))
    return points


def draw_throughput(run: TrackedRun, out_dir: Path) -> Plot:
    tokens = run.series.get("tokens_per_s")
    if tokens is None:
        return Plot(title="Throughput", file=None, note="Not drawn: the run logged no tokens/s.")
    mfu = run.series.get("mfu")
    fig, axes = _new_figure(2, 1, sharex=True, height_ratios=[3, 2 if mfu else 1])
    top, bottom = axes[0][0], axes[1][0]
    _line(top, tokens, x="time", scale=1e-3, color="tab:green")
    _from_zero(top, tokens, scale=1e-3)
    top.set(title=f"{run.name}: throughput", ylabel="tokens/s (thousands)")
    if mfu is not None:
        _line(bottom, mfu, x="time", scale=100, color="tab:purple")
        _from_zero(bottom, mfu, scale=100)
        bottom.set(ylabel="MFU (%)")
    else:
        text = f"MFU {mfu_missing(run)}"
        bottom.text(0.5, 0.5, text, transform=bottom.transAxes, **PANEL_NOTE)
        bottom.set_yticks([])
    bottom.set(xlabel="wall time since the run started (s)")
    _mark_restarts(top, run, x="time")
    _mark_restarts(bottom, run, x="time")
    window = "since training started" if run.summary.get("strategy") == "ps" else "per log window"
    note = f"Tokens/s {window}" + (" and MFU" if mfu else "")
    note += " against wall time since the run started"
    note += "; shaded: time lost to a restart" if run.restarts() else ""
    note += "." if mfu else f"; MFU {mfu_missing(run)}."
    return _save(fig, out_dir, "throughput.png", title="Throughput", note=note)


def draw_memory(run: TrackedRun, out_dir: Path) -> Plot:
    memory = run.series.get("peak_mem_bytes")
    if memory is None:
        final = run.number("peak_mem_bytes")
        also = f" (the summary's peak: {final / MIB:,.0f} MiB)" if final else ""
        note = f"Not drawn: the run logged no per-step peak memory{also}."
        return Plot(title="Memory", file=None, note=note)
    fig, axes = _new_figure()
    ax = axes[0][0]
    _line(ax, memory, x="step", scale=1 / MIB, color="tab:brown")
    _from_zero(ax, memory, scale=1 / MIB)
    _mark_restarts(ax, run, x="step")
    what = "allocated GPU memory" if run.summary.get("device") == "cuda" else "peak RSS"
    ax.set(title=f"{run.name}: peak memory of rank 0 ({what})", xlabel="step", ylabel="MiB")
    note = f"Rank 0's peak memory so far ({what}) at each logged step."
    return _save(fig, out_dir, "memory.png", title="Memory", note=note)


def draw_comm(run: TrackedRun, out_dir: Path) -> Plot:
    wire = run.series.get("bytes_on_wire")
    if wire is None:
        why = "the strategy does not measure per-step wire bytes"
        if run.summary.get("strategy") == "ps":
            pushed = run.number("bytes_pushed", within="ps") or 0.0
            why = f"a parameter server logs only its total ({pushed / MIB:,.1f} MiB pushed)"
        return Plot(title="Communication", file=None, note=f"Not drawn: {why}.")
    ratio = run.series.get("compression_ratio")
    fig, axes = _new_figure(2, 1, sharex=True)
    top, bottom = axes[0][0], axes[1][0]
    _line(top, wire, x="step", scale=1 / MIB, color="tab:cyan")
    _from_zero(top, wire, scale=1 / MIB)
    top.set(title=f"{run.name}: gradient communication per step", ylabel="bytes on wire (MiB)")
    if ratio is not None:
        _line(bottom, ratio, x="step", color="tab:olive")
        _from_zero(bottom, ratio)
    bottom.set(xlabel="step", ylabel="compression ratio (×)")
    _mark_restarts(top, run, x="step")
    _mark_restarts(bottom, run, x="step")
    note = "Bytes one rank sends per step, and the dense gradient's size over that."
    return _save(fig, out_dir, "comm.png", title="Communication", note=note)


def draw_experts(run: TrackedRun, out_dir: Path) -> Plot:
    """Each expert's share of the routed tokens over the run, and the balance and drop
    rate: what a collapsing router or full experts look like."""
    shares = sorted(
        (int(name.removeprefix("moe_load_e")), series)
        for name, series in run.series.items()
        if name.startswith("moe_load_e")
    )
    fig, axes = _new_figure(2, 1, sharex=True)
    top, bottom = axes[0][0], axes[1][0]
    for expert, series in shares:
        _line(top, series, x="step", label=f"expert {expert}")
    top.axhline(1 / len(shares), color="black", linestyle="--", label="even")
    top.set(title=f"{run.name}: each expert's share of the routed tokens", ylabel="share")
    top.legend(loc="upper right", ncols=min(4, len(shares) + 1), fontsize=8)
    for name, color, label in (
        ("moe_load_cv", "tab:purple", "load CV (0: even)"),
        ("moe_drop_rate", "tab:red", "dropped share"),
    ):
        if name in run.series:
            _line(bottom, run.series[name], x="step", color=color, label=label)
    bottom.set(xlabel="step", ylabel="per log period")
    bottom.legend(loc="upper right")
    _mark_restarts(top, run, x="step")
    cv, dropped = run.summary.get("moe_load_cv"), run.summary.get("moe_drop_rate")
    note = "Routed assignments per expert, summed over all ranks and MoE layers per log period."
    if cv is not None and dropped is not None:
        note += f" Over the run: load CV {cv:.3f}, {100 * dropped:.2f}% of assignments dropped."
    return _save(fig, out_dir, "experts.png", title="Experts", note=note)


PREFERENCE_SERIES = (
    ("eval_reward_chosen", "tab:green", "chosen answer's reward"),
    ("eval_reward_rejected", "tab:red", "rejected answer's reward"),
    ("eval_reward_margin", "tab:blue", "margin (chosen − rejected)"),
)


def draw_preferences(run: TrackedRun, out_dir: Path) -> Plot:
    """DPO: the held-out rewards (β × the policy's log-ratio to its reference) of the
    chosen and rejected answers and their margin, and the share of held-out pairs whose
    chosen answer the policy prefers, at each evaluation."""
    fig, axes = _new_figure(2, 1, sharex=True)
    top, bottom = axes[0][0], axes[1][0]
    for name, color, label in PREFERENCE_SERIES:
        if name in run.series:
            _line(top, _with_final(run, name), x="step", color=color, label=label)
    top.axhline(0, color="black", linewidth=1)
    top.set(title=f"{run.name}: held-out preference pairs", ylabel="reward (β × log-ratio)")
    top.legend(loc="upper left")
    if "eval_accuracy" in run.series:
        accuracy = _with_final(run, "eval_accuracy")
        _line(bottom, accuracy, x="step", scale=100, color="tab:purple", label="prefer chosen")
    bottom.axhline(50, label="a coin (50%)", **FLOOR_LINE)
    bottom.set(xlabel="step", ylabel="% of pairs", ylim=(0, 105))
    bottom.legend(loc="lower right")
    _mark_restarts(top, run, x="step")
    note = (
        "At each held-out evaluation: the mean reward of the chosen and the rejected answers "
        "(β × the policy's log-probability ratio to its reference) and their margin; below, "
        "the pairs whose chosen answer gets the larger reward."
    )
    final = run.number("eval_accuracy")
    if final is not None:
        note += f" At the end: {final:.1%} of pairs."
    return _save(fig, out_dir, "preferences.png", title="Preferences", note=note)


def _with_final(run: TrackedRun, name: str) -> Series:
    """`name`'s history with the run's final figure at its last step (the closing
    evaluation is in the summary, not in the per-step history)."""
    series, final, last = run.series[name], run.number(name), run.number("steps")
    if final is None or last is None or series.steps[-1] >= last:
        return series
    return Series(
        steps=[*series.steps, int(last)],
        values=[*series.values, final],
        times_s=[*series.times_s, series.times_s[-1]],
    )


def draw_staleness(run: TrackedRun, out_dir: Path) -> Plot:
    ps = run.summary["ps"]
    fig, axes = _new_figure(1, 3)
    left, middle, right = axes[0]
    names = ["mean", "p50", "p99", "max"]
    values = [float(ps.get(f"staleness_{n}", 0.0)) for n in names]
    left.bar_label(left.bar(names, values, color="tab:blue"), fmt="%.2f")
    left.set_ylim(0, max(*values, 1.0) * 1.2)
    bound = _staleness_bound(run)
    if bound is not None:
        left.axhline(bound, color="black", linestyle="--", label=f"staleness bound ({bound})")
        left.legend(loc="upper left")
    pushes = int(ps.get("pushes", 0))
    left.set(title=f"staleness over {pushes:,} pushes", ylabel="updates behind")
    speeds = [float(v) for v in ps.get("worker_steps_per_s", [])]
    workers = [f"worker {w}" for w in range(len(speeds))]
    middle.bar_label(middle.bar(workers, speeds, color="tab:green"), fmt="%.1f")
    middle.set_ylim(0, max(*speeds, 1.0) * 1.15)
    middle.set(title="worker speed", ylabel="steps/s")
    stacked = [0.0] * len(speeds)
    for part in ("compute", "push", "pull", "wait", "slow"):
        seconds = [float(w.get(part, 0.0)) for w in ps.get("worker_seconds", [])]
        if len(seconds) == len(workers) and any(seconds):
            right.bar(workers, seconds, bottom=stacked, label=part)
            stacked = [b + s for b, s in zip(stacked, seconds, strict=True)]
    right.set(title="where worker time went", ylabel="seconds")
    if any(stacked):
        right.set_ylim(0, max(stacked) * 1.3)
        right.legend(loc="upper center", ncols=2)
    fig.suptitle(f"{run.name}: parameter server ({ps.get('consistency', '?')})", fontsize=15)
    note = (
        "MLflow holds no per-push staleness history, so these are the run's summary figures: "
        f"staleness mean {values[0]:.2f}, p50 {values[1]:g}, p99 {values[2]:g}, max "
        f"{values[3]:g} updates over {pushes:,} pushes; each worker's steps/s and time split."
    )
    return _save(fig, out_dir, "staleness.png", title="Parameter server", note=note)


def _staleness_bound(run: TrackedRun) -> int | None:
    spec = yaml.safe_load(run.spec_text) if run.spec_text else None
    strategy = spec.get("strategy", {}) if isinstance(spec, dict) else {}
    bound = strategy.get("staleness_bound")
    return bound if strategy.get("consistency") == "ssp" and isinstance(bound, int) else None


GOODPUT_COLORS = (
    "tab:green",
    "tab:gray",
    "tab:blue",
    "tab:purple",
    "tab:red",
    "tab:orange",
    "silver",
)
"""One per part of `GOODPUT_PARTS`: the steps green, a restart's cost red."""


def draw_goodput(run: TrackedRun, out_dir: Path) -> Plot:
    """The run's wall time as one bar, split into its parts (`goodput_*_s`)."""
    title = "Goodput"
    if run.number("goodput") is None:
        return Plot(title=title, file=None, note="Not drawn: the run's summary has no goodput.")
    fig, axes = _new_figure()
    ax = axes[0][0]
    left = 0.0
    for (name, key), color in zip(GOODPUT_PARTS, GOODPUT_COLORS, strict=True):
        seconds = max(0.0, run.number(key) or 0.0)
        if seconds == 0.0:
            continue
        ax.barh([0], [seconds], left=left, color=color, label=f"{name} {seconds:.1f} s")
        left += seconds
    ax.set(
        title=f"{run.name}: where the wall time went (goodput {run.number('goodput'):.1%})",
        xlabel="seconds",
        yticks=[],
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4)
    note = (
        f"{goodput_line(run.summary)}. Steps: training steps after each worker group's "
        "first; start-up: to the first group's first step; checkpoints: the training "
        "thread's time on saves; restarts: from a failure to the new group's first step; "
        "replayed: steps done again after a restart."
    )
    return _save(fig, out_dir, "goodput.png", title=title, note=note)
