"""`trainstack sweep SWEEP` (and `tune/sweep.py`): a sweep file on Ray Tune."""

from __future__ import annotations

import argparse

from trainstack.cli.args import add_set_and_address, error
from trainstack.config import ConfigError


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by `trainstack sweep` and `tune/sweep.py`."""
    parser.add_argument("sweep", help="sweep file (YAML), e.g. tune/demo_sweep.yaml")
    add_set_and_address(parser, what="a job-spec key in every trial, e.g. --set train.steps=100")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted sweep (finished trials are not rerun), or report a "
        "finished one again",
    )
    parser.add_argument(
        "--storage-path", default=None, help="where the sweep's state, runs and results go"
    )
    parser.add_argument(
        "--progress",
        choices=("lines", "jsonl", "quiet"),
        default="lines",
        help="a line per trial event (default), JSON lines of trial reports, or quiet",
    )


def sweep_command(args: argparse.Namespace) -> int:
    """Run a sweep file on Ray Tune; 0 when it ends with a best trial, 130 when interrupted."""
    import dataclasses

    from trainstack.sweep.spec import load_sweep

    try:
        sweep = load_sweep(args.sweep, args.overrides)
        if args.storage_path:
            sweep = dataclasses.replace(sweep, storage_path=args.storage_path)
        from trainstack.sweep.runner import run_sweep  # imports Ray Tune: keep it lazy

        outcome = run_sweep(sweep, address=args.address, resume=args.resume, progress=args.progress)
    except ConfigError as err:
        return error(str(err), code=2)
    if outcome.interrupted:
        return 130
    return 0 if outcome.best is not None else 1
