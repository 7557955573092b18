"""`trainstack run SPEC` (and `jobs/train.py`): validate the spec, train it on Ray, print and
save the summary."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trainstack.cli.args import add_set_and_address, error
from trainstack.config import PROGRESS_MODES, ConfigError, JobConfig, load_config
from trainstack.runtime.progress import ProgressDisplay, format_summary
from trainstack.runtime.stack_check import check_versions_here
from trainstack.storage import Location, open_location


def add_run_arguments(parser: argparse.ArgumentParser, *, config_flag: bool) -> None:
    """Arguments shared by `trainstack run` and `jobs/train.py`."""
    if config_flag:
        parser.add_argument("--config", required=True, help="job spec (YAML)")
    else:
        parser.add_argument("config", help="job spec (YAML)")
    add_set_and_address(parser, what="a spec key, e.g. --set scaling.num_workers=4")
    parser.add_argument("--summary-json", default=None, help="write the final summary here")
    parser.add_argument(
        "--resume-from",
        default=None,
        help="start from this checkpoint (or a run directory's newest valid one) when the "
        "run has no checkpoint of its own yet (not with strategy.kind ps); a path or a URI "
        "(s3://bucket/prefix/run, opened with the spec's checkpoint.storage_options)",
    )
    parser.add_argument(
        "--progress", choices=PROGRESS_MODES, default=None, help="override log.progress"
    )


def run_command(args: argparse.Namespace) -> int:
    """Validate the spec, train on Ray, print and save the summary. Returns the exit code."""
    try:
        overrides = list(args.overrides)
        if args.progress:
            overrides.append(f"log.progress={args.progress}")
        cfg = load_config(args.config, overrides)
        check_versions_here(cfg)  # before torch is imported: a missing one is one line
        options = cfg.checkpoint.storage_options  # a URI's store: the job's store options
        resume_from = open_location(args.resume_from, options) if args.resume_from else None
    except ConfigError as err:
        return error(str(err), code=2)
    return _train(
        cfg, address=args.address, summary_json=args.summary_json, resume_from=resume_from
    )


def _train(
    cfg: JobConfig, *, address: str | None, summary_json: str | None, resume_from: Location | None
) -> int:
    from trainstack.checkpoint import CheckpointError
    from trainstack.runtime.launcher import RunFailedError, run_job  # imports Ray: keep it lazy

    display = ProgressDisplay(mode=cfg.log.progress)
    print(
        f"trainstack: {cfg.name}: {cfg.model.target or cfg.model.kind} ({cfg.task.kind}) on "
        f"{cfg.scaling.num_workers} "
        f"{'GPU' if cfg.scaling.use_gpu else 'CPU'} worker(s), strategy {cfg.strategy.kind}, "
        f"{cfg.train.steps} steps",
        flush=True,
    )
    try:
        summary = run_job(cfg, address=address, display=display, resume_from=resume_from)
    except (ConfigError, CheckpointError) as err:
        return error(str(err), code=2)
    except RunFailedError as err:
        return error(str(err), code=1)
    if summary.get("already_complete"):
        print(
            f"trainstack: run '{cfg.name}' already finished ({summary['run_dir']}); "
            "pass another --set name=... to train again",
            flush=True,
        )
    if cfg.log.progress != "quiet":
        print("trainstack: summary\n" + format_summary(summary), flush=True)
    if summary_json:
        write_json(Path(summary_json), summary)
    return 0


def write_json(path: Path, data: dict[str, Any]) -> None:
    from trainstack.files import write_text_atomically

    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
