"""Entrypoint for `ray job submit`: run a sweep file on the cluster the job runs in.

CPU-sized example (the demo sweep, about 5 minutes on 2 cores):

    ray start --head --dashboard-host=127.0.0.1
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python tune/sweep.py tune/demo_sweep.yaml --storage-path /tmp/sweeps
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import trainstack  # noqa: F401
except ImportError:  # run from a checkout that was not pip-installed (e.g. --working-dir .)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))

from trainstack.cli.sweep import add_sweep_arguments, sweep_command


def main() -> int:
    parser = argparse.ArgumentParser(description="Run a trainstack sweep file on Ray Tune.")
    add_sweep_arguments(parser)
    return sweep_command(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
