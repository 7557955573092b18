"""`trainstack` command line.

The list of commands (`build_parser`) and `main`, the console script; each command's
handler lives in its own module beside this one.
"""

from __future__ import annotations

import argparse
import sys

from trainstack.cli.args import add_overrides
from trainstack.cli.export import export_command
from trainstack.cli.prepare import prepare_command
from trainstack.cli.run import add_run_arguments, run_command
from trainstack.cli.sweep import add_sweep_arguments, sweep_command


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
    export.add_argument("--out", default=None, help="where to write the state dict (.pt)")
    export.add_argument(
        "--hf-dir",
        default=None,
        help="model.kind hf: where to write the save_pretrained directory (default: next "
        "to --out, named <out>_hf; a LoRA run's with --merge only)",
    )
    export.add_argument(
        "--adapter-dir",
        default=None,
        help="model.lora: where to write the adapters as a peft adapter folder "
        "(peft.PeftModel.from_pretrained(base_model, folder) loads it)",
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="model.lora: --out and --hf-dir get the weights with the adapters folded in",
    )
    export.set_defaults(handler=export_command)
    prepare = commands.add_parser(
        "prepare", help="tokenize a text job's files once into token files (data.kind text)"
    )
    prepare.add_argument("config", help="job spec (YAML)")
    add_overrides(prepare, what="a spec key, e.g. --set data.tokenizer=tokenizer.json")
    prepare.set_defaults(handler=prepare_command)
    from trainstack.cli.doctor import add_doctor_parser
    from trainstack.cli.k8s import add_k8s_parser
    from trainstack.cli.plan import add_plan_parser
    from trainstack.cli.report import add_report_parser
    from trainstack.cli.submit import add_submit_parser

    add_plan_parser(commands)
    add_submit_parser(commands)
    add_report_parser(commands)
    add_k8s_parser(commands)
    add_doctor_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
