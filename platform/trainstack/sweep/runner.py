"""Runs a sweep on Ray Tune and writes its results.

The driver connects to Ray, opens the sweep's MLflow run (each trial's run is nested
under it), and hands Tune one function trainable per trial (`trial.run_trial`) that
reserves no CPU of its own (see `tuning.NODE_SHARE`); a trial's workers reserve theirs
when its run starts them, and the sweep runs as many trials at once as the cluster
holds. Tune keeps the experiment state under `<storage_path>/<name>`, beside each
trial's checkpoints (`runs/`), so `--resume` restores it without rerunning finished
trials. At the end: the results table (console, `results.csv`), `pareto.png` (loss
against tokens/s), `pareto_bytes.png` (loss against bytes per step, when trials differ
in them: a compression sweep) and `best.yaml`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import tune

from trainstack.config import ConfigError, config_to_dict, set_key
from trainstack.files import write_text_atomically
from trainstack.observe.tracking import (
    MlflowTracker,
    NullTracker,
    mlflow_tracker,
    resolve_tracking_uri,
)
from trainstack.runtime.cluster import connect, this_node_resource
from trainstack.sweep import tuning
from trainstack.sweep.results import (
    COMPLETED,
    FAILED,
    STOPPED,
    UNFINISHED,
    TrialRow,
    best_trial,
    fmt_number,
    format_table,
    label_for,
    pareto_front,
    plot_pareto,
    write_csv,
)
from trainstack.sweep.spec import SweepConfig
from trainstack.sweep.trial import COMPLETED as COMPLETED_FLAG
from trainstack.sweep.trial import TrialPlan, chosen_values, run_trial, trial_job

STATE_FILE = "sweep.json"
"""What the sweep was started with; `--resume` must find the same."""


@dataclass(kw_only=True)
class SweepOutcome:
    rows: list[TrialRow]
    best: TrialRow | None
    sweep_dir: Path
    interrupted: bool
    best_spec: Path | None
    parent_run_id: str | None


def run_sweep(
    sweep: SweepConfig, *, address: str | None = None, resume: bool = False, progress: str = "lines"
) -> SweepOutcome:
    """Run (or with `resume`, continue) `sweep`; return its trials and the best one.

    Raises ConfigError before any trial starts when the sweep cannot run as asked
    (already ran without `resume`, nothing to resume, changed file, cluster too small).
    """
    sweep_dir = sweep.sweep_dir
    _check_state(sweep, resume=resume)
    # Tune's own console output (a settings box, a TensorBoard hint) gives way to ours.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    started_local = connect(address, log_to_driver=False)
    try:
        cluster = ray.cluster_resources()
        concurrent = tuning.max_concurrent(sweep, cluster)
        parent = _open_parent(sweep, concurrent=concurrent)
        plan = TrialPlan(sweep=_trial_sweep(sweep), parent_run_id=parent.run_id)
        trainable = tune.with_resources(
            tune.with_parameters(run_trial, plan=plan), tuning.trial_resources(this_node_resource())
        )
        total = _trial_count(sweep)
        show = SweepProgress(sweep=sweep, total=total, mode=progress)
        show.note(
            f"sweep {sweep.name}: {total} trial(s), {tuning.algorithm(sweep)} search, up to "
            f"{concurrent} at once, {sweep.scheduler.kind} on {sweep.objective.metric}; "
            f"storage {sweep_dir}"
        )
        if resume:
            tuner = tune.Tuner.restore(
                str(sweep_dir), trainable, resume_unfinished=True, resume_errored=True
            )
        else:
            _write_state(sweep)
            tuner = _new_tuner(sweep, trainable, concurrent=concurrent, callback=show)
        tuner.fit()
        trials = _trials(sweep_dir)
        rows = sorted((_row(trial, plan) for trial in trials), key=lambda r: r.trial_id)
        return _finish(sweep, plan, rows, parent=parent, show=show)
    finally:
        if started_local:
            ray.shutdown()


class SweepProgress(tune.Callback):
    """One line per trial event on the driver's console (Tune's own table is off)."""

    def __init__(self, *, sweep: SweepConfig, total: int, mode: str) -> None:
        self.sweep = sweep
        self.total = total
        self.mode = mode
        self.numbers: dict[str, int] = {}

    def note(self, text: str) -> None:
        if self.mode != "quiet":
            print(f"trainstack: {text}", flush=True)

    def _name(self, trial: Any) -> str:
        number = self.numbers.setdefault(
            trial.trial_id, _trial_number(trial.trial_id) or len(self.numbers) + 1
        )
        overrides = self.sweep.trial_overrides(chosen_values(trial.config))
        label = label_for(overrides, skip=self.sweep.single_valued())
        return f"[{number}/{self.total} {trial.trial_id}: {label}]"

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.note(f"{self._name(trial)} started")

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        if self.mode == "jsonl":
            record = {k: result.get(k) for k in ("step", "tokens", "eval_loss", "tokens_per_s")}
            print(json.dumps({"trial": trial.trial_id, **record}), flush=True)
        elif self.mode != "quiet" and not result.get(COMPLETED_FLAG):
            loss, speed = _loss_and_speed(result)
            self.note(
                f"{self._name(trial)} step {result['step']:.0f}  eval_loss {loss}  tok/s {speed}"
            )

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        last = trial.last_result or {}
        if last.get(COMPLETED_FLAG):
            loss, speed = _loss_and_speed(last)
            what = f"done: eval_loss {loss}, {speed} tokens/s"
        else:
            what = f"stopped early by ASHA at step {last.get('step', 0):.0f}"
        self.note(f"{self._name(trial)} {what}")

    def on_trial_recover(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.note(f"{self._name(trial)} failed; retrying (resumes from its checkpoints)")

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.note(f"{self._name(trial)} failed for good: {_error_line(trial)}")


def _new_tuner(sweep: SweepConfig, trainable: Any, *, concurrent: int, callback: Any) -> Any:
    return tune.Tuner(
        trainable,
        param_space=tuning.param_space(sweep),
        tune_config=tune.TuneConfig(
            search_alg=tuning.searcher(sweep, concurrent=concurrent),
            scheduler=tuning.scheduler(sweep),
            num_samples=sweep.search.num_samples,
            # the variant generator limits itself; Optuna is wrapped in a limiter here
            max_concurrent_trials=None if tuning.algorithm(sweep) != "optuna" else concurrent,
            reuse_actors=False,
        ),
        run_config=tune.RunConfig(
            name=sweep.name,
            storage_path=str(sweep.sweep_dir.parent),
            failure_config=tune.FailureConfig(max_failures=sweep.failure.max_failures),
            verbose=0,
            callbacks=[callback],
        ),
    )


def _trials(sweep_dir: Path) -> list[Any]:
    """Tune's trials of the sweep, from its saved state (a trial Ctrl-C stopped before
    its first report has no results yet: not worth Tune's warning)."""
    analysis_log = logging.getLogger("ray.tune.analysis.experiment_analysis")
    level = analysis_log.level
    analysis_log.setLevel(logging.ERROR)
    try:
        return list(tune.ExperimentAnalysis(str(sweep_dir)).trials)
    finally:
        analysis_log.setLevel(level)


def _trial_sweep(sweep: SweepConfig) -> SweepConfig:
    """The sweep as trials see it: their runs under the sweep's local storage (whatever
    the base spec's checkpoint.storage_path) and the tracking store as an absolute URI
    (a trial's working directory is its own)."""
    runs = str(sweep.sweep_dir / "runs")
    base = set_key(sweep.base, "checkpoint.storage_path", runs, what="sweep")
    # Local runs: an object store's options (refused with a path) do not come along.
    base = set_key(base, "checkpoint.storage_options", {}, what="sweep")
    if base["tracking"]["backend"] != "none":
        uri = resolve_tracking_uri(base["tracking"]["uri"])
        base = set_key(base, "tracking.uri", uri, what="sweep")
    return dataclasses.replace(sweep, base=base)


def _trial_count(sweep: SweepConfig) -> int:
    if tuning.algorithm(sweep) == "grid":
        return len(sweep.grid()) * sweep.search.num_samples
    return sweep.search.num_samples


def _fingerprint(sweep: SweepConfig) -> dict[str, Any]:
    return {
        "base": sweep.base,
        "space": {dim.key: dim.describe() for dim in sweep.space},
        "search": dataclasses.asdict(sweep.search),
        "objective": dataclasses.asdict(sweep.objective),
        "scheduler": dataclasses.asdict(sweep.scheduler),
    }


def _write_state(sweep: SweepConfig) -> None:
    text = json.dumps(_fingerprint(sweep), indent=2, sort_keys=True, default=str) + "\n"
    write_text_atomically(sweep.sweep_dir / STATE_FILE, text)


def _check_state(sweep: SweepConfig, *, resume: bool) -> None:
    sweep_dir = sweep.sweep_dir
    exists = tune.Tuner.can_restore(str(sweep_dir))
    if resume and not exists:
        raise ConfigError(
            f"sweep {sweep.name}: nothing to resume at {sweep_dir}; run it without --resume"
        )
    if not resume and exists:
        raise ConfigError(
            f"sweep {sweep.name} already ran at {sweep_dir}; pass --resume to continue or "
            "report it, or give the sweep another name"
        )
    if resume:
        try:
            started = json.loads((sweep_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            started = None
        now = json.loads(json.dumps(_fingerprint(sweep), default=str))
        if started != now:
            changed = sorted(k for k in now if started is None or started.get(k) != now[k])
            raise ConfigError(
                f"sweep {sweep.name}: the sweep file changed since it started "
                f"({', '.join(changed)} differ); --resume needs the same base, space and "
                "settings (start a new sweep under another name instead)"
            )


def _open_parent(sweep: SweepConfig, *, concurrent: int) -> Any:
    """The sweep's MLflow run (continued on --resume), or a no-op without tracking."""
    tracking = sweep.base["tracking"]
    if tracking["backend"] == "none":
        return NullTracker()
    tracker = mlflow_tracker(tracking["uri"])
    params = {
        "base": str(sweep.base_path),
        **{f"set.{k}": str(v) for k, v in sweep.fixed.items()},
        **{f"space.{dim.key}": dim.describe() for dim in sweep.space},
        "search.algorithm": tuning.algorithm(sweep),
        "search.num_samples": str(sweep.search.num_samples),
        "search.max_concurrent_trials": str(concurrent),
        "search.seed": str(sweep.search.seed),
        "objective.metric": sweep.objective.metric,
        "objective.loss_bound": str(sweep.objective.loss_bound),
        **{f"scheduler.{k}": str(v) for k, v in dataclasses.asdict(sweep.scheduler).items()},
        "failure.max_failures": str(sweep.failure.max_failures),
    }
    sweep.sweep_dir.mkdir(parents=True, exist_ok=True)
    tracker.guarded(
        "start",
        lambda: tracker.open(
            run_dir=sweep.sweep_dir,
            experiment=tracking["experiment"],
            run_name=sweep.name,
            tags={"trainstack.sweep": sweep.name, "trainstack.kind": "sweep"},
            params=params,
        ),
    )
    return tracker


def _row(trial: Any, plan: TrialPlan) -> TrialRow:
    overrides = plan.sweep.trial_overrides(chosen_values(trial.config))
    last = trial.last_result or {}
    if trial.status == "ERROR":
        status = FAILED
    elif trial.status != "TERMINATED":
        status = UNFINISHED
    else:
        status = COMPLETED if last.get(COMPLETED_FLAG) else STOPPED
    return TrialRow(
        trial_id=trial.trial_id,
        label=label_for(overrides, skip=plan.sweep.single_valued()),
        overrides=overrides,
        status=status,
        step=_int(last.get("step")),
        tokens=_int(last.get("tokens")),
        eval_loss=float(last.get("eval_loss", math.nan)),
        tokens_per_s=float(last.get("tokens_per_s", math.nan)),
        elapsed_s=float(last.get("elapsed_s", math.nan)),
        bytes_per_step=float(last.get("bytes_on_wire", math.nan)),
        error=_error_line(trial) if status == FAILED else "",
    )


def _finish(
    sweep: SweepConfig, plan: TrialPlan, rows: list[TrialRow], *, parent: Any, show: SweepProgress
) -> SweepOutcome:
    sweep_dir = sweep.sweep_dir
    # Ctrl-C can also land between trials, before Tune created the next ones.
    interrupted = len(rows) < show.total or any(r.status == UNFINISHED for r in rows)
    best = best_trial(rows, sweep.objective)
    if isinstance(parent, MlflowTracker):
        _close_trial_runs(parent, plan, rows)
    outcome = SweepOutcome(
        rows=rows,
        best=best,
        sweep_dir=sweep_dir,
        interrupted=interrupted,
        best_spec=None,
        parent_run_id=parent.run_id,
    )
    if interrupted:
        done = sum(r.status != UNFINISHED for r in rows)
        show.note(
            f"sweep {sweep.name} interrupted: {done} of {show.total} trial(s) ended; "
            f"continue it with: trainstack sweep {sweep.path} --resume"
        )
        parent.finish({"interrupted": True}, failed=True)
        return outcome
    table = format_table(rows, best=best)
    write_text_atomically(sweep_dir / "results.txt", table + "\n")
    write_csv(rows, sweep_dir / "results.csv")
    title = f"sweep {sweep.name}: final loss vs throughput"
    plot_pareto(rows, sweep_dir / "pareto.png", title=title)
    measured = {r.bytes_per_step for r in rows if r.status == COMPLETED}
    if len({b for b in measured if math.isfinite(b)}) >= 2:  # e.g. a compression sweep
        title = f"sweep {sweep.name}: final loss vs bytes on the wire"
        plot_pareto(rows, sweep_dir / "pareto_bytes.png", title=title, against="bytes_per_step")
        front = pareto_front(rows, "bytes_per_step")
        lines = [f"  {r.eval_loss:.4f}  {r.bytes_per_step:12,.0f}  {r.label}" for r in front]
        show.note("loss / bytes-per-step Pareto front (fewest bytes first):\n" + "\n".join(lines))
    outcome.best_spec = best_spec = _write_best(sweep, best) if best is not None else None
    print(f"trainstack: sweep {sweep.name} results (* best)\n{table}", flush=True)
    if best is not None:
        show.note(
            f"best trial {best.trial_id} ({best.label}); reproduce it: trainstack run {best_spec}"
        )
    else:
        show.note("no trial completed within the objective's bounds: no best.yaml")
    counts = {s: sum(r.status == s for r in rows) for s in (COMPLETED, STOPPED, FAILED)}
    summary = {
        "trials": len(rows),
        **{f"trials_{k.replace(' ', '_')}": v for k, v in counts.items()},
        "best_trial": best.trial_id if best else None,
        "best_eval_loss": best.eval_loss if best else None,
        "best_tokens_per_s": best.tokens_per_s if best else None,
    }
    if isinstance(parent, MlflowTracker):
        files = ("results.txt", "results.csv", "pareto.png", "pareto_bytes.png", "best.yaml")
        for name in (*files, STATE_FILE):
            if (sweep_dir / name).exists():
                parent.log_file(sweep_dir / name)
    parent.finish(summary, failed=best is None)
    return outcome


def _write_best(sweep: SweepConfig, best: TrialRow) -> Path:
    """The best trial's complete job spec, with the base's own storage and tracking, under
    a name of its own (so it trains afresh rather than finding the trial's run)."""
    cfg = trial_job(sweep, best.overrides, name=f"{sweep.name}-best")
    header = (
        f"# Best trial {best.trial_id} of sweep {sweep.name} ({best.label}): held-out loss "
        f"{best.eval_loss:.4f}, {best.tokens_per_s:.0f} tokens/s.\n"
        f"#   trainstack run {sweep.sweep_dir / 'best.yaml'}\n"
    )
    path = sweep.sweep_dir / "best.yaml"
    write_text_atomically(path, header + yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return path


def _close_trial_runs(parent: MlflowTracker, plan: TrialPlan, rows: list[TrialRow]) -> None:
    """A trial ASHA stopped (or that failed for good) leaves its MLflow run RUNNING:
    end it as KILLED (FAILED) and tag every trial's run with how its trial ended."""
    from trainstack.observe.tracking import RECORD_FILE

    for row in rows:
        try:
            record = json.loads((plan.run_dir(row.trial_id) / RECORD_FILE).read_text())
        except (OSError, ValueError):
            continue
        run_id = record["run_id"]

        def close(run_id: str = run_id, row: TrialRow = row) -> None:
            parent.client.set_tag(run_id, "trainstack.sweep_status", row.status)
            if parent.client.get_run(run_id).info.status == "RUNNING" and row.status != UNFINISHED:
                status = "FAILED" if row.status == FAILED else "KILLED"
                parent.client.set_terminated(run_id, status=status)

        parent.guarded("close trial run", close)


def _trial_number(trial_id: str) -> int:
    """Tune's variant generator numbers trials in their ids (`3f2a1_00004` is the fifth);
    0 for other searchers' ids."""
    counter = trial_id.rsplit("_", 1)[-1]
    return int(counter) + 1 if counter.isdigit() else 0


def _error_line(trial: Any) -> str:
    try:
        text = Path(trial.error_file).read_text() if trial.error_file else ""
    except OSError:
        text = ""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "unknown error"


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _loss_and_speed(result: dict[str, Any]) -> tuple[str, str]:
    return (
        fmt_number(result.get("eval_loss"), ".4f", missing="-"),
        fmt_number(result.get("tokens_per_s"), ".0f", missing="-"),
    )
