"""Console progress for the driver: a bar on a terminal, plain lines or JSON lines in logs."""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _mfu(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


class ProgressDisplay:
    """Renders rank 0's log records as they arrive on the driver."""

    def __init__(self, *, mode: str, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self._bar_open = False

    def update(self, record: dict[str, Any]) -> None:
        if self.mode == "quiet":
            return
        if self.mode == "jsonl":
            self.stream.write(json.dumps(record) + "\n")
            self.stream.flush()
            return
        step, total = record["step"], record["steps"]
        eta = record["elapsed_s"] / step * (total - step)
        text = (
            f"step {step}/{total}  loss {record['loss']:.4f}  "
            f"tok/s {_si(record['tokens_per_s'])}  MFU {_mfu(record['mfu'])}  "
            f"ETA {_clock(eta)}"
        )
        if record.get("eval_loss") is not None:  # log.eval_every_steps
            text += f"  held-out {record['eval_loss']:.4f}"
        if record.get("moe_load_cv") is not None:  # MoE layers: how even, how much dropped
            text += f"  experts cv {record['moe_load_cv']:.2f}"
            text += f" dropped {100 * record['moe_drop_rate']:.1f}%"
        if record.get("restarts"):
            text += f"  restarts {record['restarts']}"
        if self.mode == "bar":
            width = 24
            filled = round(width * step / total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
            self._bar_open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        """A one-off line (a restart, a failure) between progress updates."""
        if self.mode in ("quiet", "jsonl"):
            return
        self.close()
        self.stream.write(f"trainstack: {message}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar_open:
            self.stream.write("\n")
            self.stream.flush()
            self._bar_open = False


def preferences_line(summary: dict[str, Any]) -> str:
    """`dpo`: the held-out pairs whose chosen answer the policy prefers, and the rewards."""
    return (
        f"{summary['eval_accuracy']:.1%} of held-out pairs prefer the chosen answer (rewards: "
        f"chosen {summary['eval_reward_chosen']:+.4f}, rejected "
        f"{summary['eval_reward_rejected']:+.4f}, margin {summary['eval_reward_margin']:+.4f})"
    )


def format_summary(summary: dict[str, Any]) -> str:
    """The run's closing summary as aligned `key: value` lines."""
    floor = summary.get("entropy_floor")
    loss = summary["final_loss"]
    rows = [
        ("strategy", f"{summary['strategy']} × {summary['world_size']} {summary['device']}"),
        ("steps", str(summary["steps"])),
        (
            "final loss",
            f"{loss:.4f} (held-out)" if summary.get("eval_loss") is not None else f"{loss:.4f}",
        ),
    ]
    classify = summary.get("task") == "classify"
    if floor is not None:
        rows.append(
            (
                "Bayes floor" if classify else "entropy floor",
                f"{floor:.4f}  (final loss is {100 * (loss / floor - 1):+.1f}% above)",
            )
        )
    if summary.get("eval_accuracy") is not None and classify:
        rows.append(("accuracy", f"{summary['eval_accuracy']:.2%} (held-out)"))
    if summary.get("eval_reward_margin") is not None:  # task.kind dpo
        rows.append(("preferences", preferences_line(summary)))
    if summary.get("eval_bits_per_token") is not None:
        rows.append(("bits/token", f"{summary['eval_bits_per_token']:.4f} (held-out)"))
    if summary.get("eval_bits_per_byte") is not None:
        rows.append(("bits/byte", bits_per_byte_line(summary)))
    if not classify:  # a classify sample is one "token": samples/s says it
        rows.append(("tokens/s", f"{summary['tokens_per_s']:,.0f}  (steady state)"))
    rows += [
        ("samples/s", f"{summary['samples_per_s']:,.1f}"),
        ("MFU", _mfu(summary["mfu"])),
        ("peak memory", f"{summary['peak_mem_bytes'] / 2**20:,.0f} MiB per worker"),
        ("wall time", f"{summary.get('wall_s', 0):.1f} s  (training {summary['train_s']:.1f} s)"),
    ]
    if summary.get("startup"):
        rows.append(("start-up", startup_line(summary["startup"])))
    if summary.get("goodput") is not None:
        rows.append(("goodput", goodput_line(summary)))
    if summary.get("checkpoint_saves"):
        rows.append(("checkpoints", checkpoint_line(summary)))
    if "ps" in summary:
        ps = summary["ps"]
        rows.append(
            (
                "updates/s",
                f"{ps['updates_per_s']:,.1f} per shard ({ps['consistency']}, {ps['num_shards']} "
                f"shards, {ps['rejected']} pushes rejected)",
            )
        )
        rows.append(
            (
                "staleness",
                f"mean {ps['staleness_mean']:.2f}, p50 {ps['staleness_p50']:.0f}, "
                f"p99 {ps['staleness_p99']:.0f}, max {ps['staleness_max']} (updates)"
                + (  # runs from before end-to-end lags were measured lack it
                    f"; a step's parameters at most {ps['clock_lag_max']} clocks behind it"
                    if "clock_lag_max" in ps
                    else ""
                ),
            )
        )
        if ps.get("local_servers") or ps.get("local_servers_lost"):
            lost = ps["local_servers_lost"]
            rows.append(
                (
                    "local servers",
                    f"{len(ps['local_servers']) + len(lost)} ({len(lost)} lost, "
                    f"{ps['pushes_lost']} worker steps lost); the shards moved "
                    f"{ps['global_bytes_per_step']:,.0f} bytes per step",
                )
            )
        for failure in ps["shard_failures"]:
            rows.append(
                (
                    "shard failure",
                    f"shard {failure['shard']} restored version {failure['restored_version']}, "
                    f"{failure['updates_lost']} updates lost",
                )
            )
    if summary.get("restarts"):
        lost = [r["steps_lost"] for r in summary.get("recovery", []) if r["steps_lost"] is not None]
        detail = f" (steps lost per restart: {', '.join(map(str, lost))})" if lost else ""
        rows.append(("restarts", f"{summary['restarts']}{detail}"))
    if summary.get("run_dir"):
        rows.append(("run dir", summary["run_dir"]))
    if summary.get("final_checkpoint"):
        rows.append(("checkpoint", summary["final_checkpoint"]))
    if summary.get("mlflow_run_id"):
        rows.append(("mlflow run", summary["mlflow_run_id"]))
    if summary.get("tracking_error"):
        rows.append(("tracking", f"FAILED: {summary['tracking_error']}"))
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"  {key:<{width}}  {value}" for key, value in rows)


def startup_line(startup: dict[str, float]) -> str:
    """`14.2 s to the first step (checks 0.9, Ray 3.1, worker group 5.0, model 2.1, first
    step 3.1)`."""
    parts = (
        ("checks", "checks_s"),
        ("Ray", "ray_connect_s"),
        ("worker group", "worker_group_start_s"),
        ("model", "model_build_s"),
        ("first step", "first_step_s"),
    )
    said = ", ".join(f"{name} {startup[key]:.1f}" for name, key in parts)
    return f"{startup['to_first_step_s']:.1f} s to the first step ({said})"


GOODPUT_PARTS = (
    ("steps", "goodput_steps_s"),
    ("start-up", "goodput_startup_s"),
    ("checkpoints", "goodput_checkpoint_s"),
    ("eval", "goodput_eval_s"),
    ("restarts", "goodput_restarts_s"),
    ("replayed", "goodput_replayed_s"),
    ("other", "goodput_other_s"),
)
"""The parts of a run's wall time, as the summary names them."""


def goodput_line(summary: dict[str, Any]) -> str:
    """`61.2% of 40.3 s in training steps (start-up 12.1, checkpoints 0.8, eval 1.2,
    other 1.5)`: the parts that took any time."""
    said = ", ".join(
        f"{name} {summary[key]:.1f}"
        for name, key in GOODPUT_PARTS[1:]
        if summary.get(key) and abs(summary[key]) >= 0.05
    )
    return f"{summary['goodput']:.1%} of {summary['goodput_wall_s']:.1f} s in training steps" + (
        f" ({said})" if said else ""
    )


def checkpoint_line(summary: dict[str, Any]) -> str:
    """`3 saves in training: 0.21 s each on the training thread, 2.9 s each written`."""
    saves = summary["checkpoint_saves"]
    return (
        f"{saves} saves in training: {summary['checkpoint_stall_s'] / saves:.2f} s each on "
        f"the training thread, {summary['checkpoint_write_s'] / saves:.2f} s each written"
    )


def bits_per_byte_line(summary: dict[str, Any]) -> str:
    """`2.104 (held-out)  gzip -9 2.362  xz -9 2.254`: a text job's held-out bits per byte
    and the compressors' on the same bytes, where the summary has them."""
    text = f"{summary['eval_bits_per_byte']:.3f} (held-out)"
    for name, key in (("gzip -9", "gzip_bits_per_byte"), ("xz -9", "xz_bits_per_byte")):
        if summary.get(key) is not None:
            text += f"  {name} {summary[key]:.3f}"
    return text
