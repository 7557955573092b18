"""Entrypoint for `ray job submit`: train one job spec on the cluster the job runs in.

CPU-sized example (2 workers, about two minutes on 2 cores):

    ray start --head --dashboard-host=127.0.0.1
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/train.py --config jobs/configs/demo.yaml --set train.steps=100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import trainstack  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed (e.g. --working-dir .)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from trainstack.cli.run import add_run_arguments, run_command


def main() -> int:
    parser = argparse.ArgumentParser(description="Train a trainstack job spec on Ray.")
    add_run_arguments(parser, config_flag=True)
    return run_command(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
