"""`trainstack report RUN`: the command around `trainstack.report`."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from trainstack.config import ConfigError
from trainstack.report.document import PLOT_FILES, render_report
from trainstack.report.runs import load_run


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
