"""`trainstack` command line.

trainstack run jobs/configs/demo.yaml --set train.steps=50 --summary-json out.json
trainstack prepare jobs/configs/stdlib_gpt.yaml
trainstack sweep tune/demo_sweep.yaml [--resume]
trainstack plan jobs/configs/demo.yaml --devices 8 --device-memory 80GB
trainstack submit jobs/configs/demo.yaml --address http://127.0.0.1:8265
trainstack report runs/demo
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainstack.config import PROGRESS_MODES, ConfigError, JobConfig, load_config
from trainstack.runtime.progress import ProgressDisplay, format_summary
from trainstack.storage import Location, open_location


def _error(message: str, *, code: int) -> int:
    print(f"trainstack: error: {message}", file=sys.stderr)
    return code


def add_run_arguments(parser: argparse.ArgumentParser, *, config_flag: bool) -> None:
    """Arguments shared by `trainstack run` and `jobs/train.py`."""
    if config_flag:
        parser.add_argument("--config", required=True, help="job spec (YAML)")
    else:
        parser.add_argument("config", help="job spec (YAML)")
    _add_set_and_address(parser, what="a spec key, e.g. --set scaling.num_workers=4")
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


def add_overrides(parser: argparse.ArgumentParser, *, what: str) -> None:
    """`--set KEY=VALUE` (repeatable), collected in `args.overrides`."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override {what} (repeatable)",
    )


def _add_set_and_address(parser: argparse.ArgumentParser, *, what: str) -> None:
    add_overrides(parser, what=what)
    parser.add_argument(
        "--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS, else local)"
    )


def run_command(args: argparse.Namespace) -> int:
    """Validate the spec, train on Ray, print and save the summary. Returns the exit code."""
    try:
        overrides = list(args.overrides)
        if args.progress:
            overrides.append(f"log.progress={args.progress}")
        cfg = load_config(args.config, overrides)
        options = cfg.checkpoint.storage_options  # a URI's store: the job's store options
        resume_from = open_location(args.resume_from, options) if args.resume_from else None
    except ConfigError as err:
        return _error(str(err), code=2)
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
        return _error(str(err), code=2)
    except RunFailedError as err:
        return _error(str(err), code=1)
    if summary.get("already_complete"):
        print(
            f"trainstack: run '{cfg.name}' already finished ({summary['run_dir']}); "
            "pass another --set name=... to train again",
            flush=True,
        )
    if cfg.log.progress != "quiet":
        print("trainstack: summary\n" + format_summary(summary), flush=True)
    if summary_json:
        _write_json(Path(summary_json), summary)
    return 0


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by `trainstack sweep` and `tune/sweep.py`."""
    parser.add_argument("sweep", help="sweep file (YAML), e.g. tune/demo_sweep.yaml")
    _add_set_and_address(parser, what="a job-spec key in every trial, e.g. --set train.steps=100")
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
        return _error(str(err), code=2)
    if outcome.interrupted:
        return 130
    return 0 if outcome.best is not None else 1


def export_command(args: argparse.Namespace) -> int:
    """Verify a checkpoint and write its consolidated weights (`model.pt`) to --out; a
    Hugging Face model (`model.kind: hf`) also as a `save_pretrained` directory."""
    from trainstack.checkpoint import CheckpointError, resolve, save_atomically
    from trainstack.config import config_from_dict

    try:
        options = dict(_store_option(text) for text in args.storage_options)
        found = resolve(open_location(args.checkpoint, options))
        state = found.full_weights()
        cfg = config_from_dict(found.manifest["spec"])
    except (CheckpointError, ConfigError) as err:
        return _error(str(err), code=2)
    out = Path(args.out)
    save_atomically(state, out)
    numel = sum(t.numel() for t in state.values())
    print(f"trainstack: wrote {out} ({len(state)} tensors, {numel:,} values) from {found.path}")
    if cfg.model.kind != "hf":
        return 0
    from trainstack.models.hf import export_pretrained

    hf_dir = Path(args.hf_dir) if args.hf_dir else out.with_name(out.stem + "_hf")
    try:
        export_pretrained(
            cfg.model, vocab_size=cfg.data.vocab_size, weights=state, directory=hf_dir
        )
    except ConfigError as err:
        return _error(str(err), code=2)
    print(
        f"trainstack: wrote {hf_dir} (Hugging Face save_pretrained; load it with "
        "AutoModelForCausalLM.from_pretrained)"
    )
    return 0


def _store_option(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of `--storage-option`; the value read as YAML (`true`, `5`, text)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"--storage-option {text!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)


def prepare_command(args: argparse.Namespace) -> int:
    """Tokenize a `data.kind: text` spec's files into its prepared directory (or reuse it)."""
    from trainstack.data.paths import resolve_data
    from trainstack.data.prepare import ensure_prepared

    try:
        cfg = resolve_data(load_config(args.config, args.overrides))
        if cfg.data.kind != "text":
            raise ConfigError(
                f"data.kind={cfg.data.kind} has nothing to prepare; `trainstack prepare` "
                "tokenizes data.kind=text"
            )
        ensure_prepared(cfg, out=sys.stdout)
    except ConfigError as err:
        return _error(str(err), code=2)
    return 0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    from trainstack.checkpoint import write_text_atomically

    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainstack", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train a job spec on Ray")
    add_run_arguments(run, config_flag=False)
    run.set_defaults(handler=run_command)
    sweep = commands.add_parser(
        "sweep", help="search job-spec settings with Ray Tune (ASHA, MLflow, Pareto plot)"
    )
    add_sweep_arguments(sweep)
    sweep.set_defaults(handler=sweep_command)
    export = commands.add_parser(
        "export", help="write a checkpoint's full fp32 weights as one state dict"
    )
    export.add_argument(
        "checkpoint",
        help="a checkpoint directory, or a run directory: a path, or a URI "
        "(s3://bucket/prefix/run; credentials from the environment)",
    )
    export.add_argument(
        "--storage-option",
        dest="storage_options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the URI's pyarrow filesystem, as checkpoint.storage_options, e.g. "
        "endpoint_override=http://127.0.0.1:9000 (repeatable)",
    )
    export.add_argument("--out", required=True, help="where to write the state dict (.pt)")
    export.add_argument(
        "--hf-dir",
        default=None,
        help="model.kind hf: where to write the save_pretrained directory (default: next "
        "to --out, named <out>_hf)",
    )
    export.set_defaults(handler=export_command)
    prepare = commands.add_parser(
        "prepare", help="tokenize a text job's files once into token files (data.kind text)"
    )
    prepare.add_argument("config", help="job spec (YAML)")
    add_overrides(prepare, what="a spec key, e.g. --set data.tokenizer=tokenizer.json")
    prepare.set_defaults(handler=prepare_command)
    from trainstack.planner.command import add_plan_parser
    from trainstack.report import add_report_parser
    from trainstack.runtime.submit import add_submit_parser

    add_plan_parser(commands)
    add_submit_parser(commands)
    add_report_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
