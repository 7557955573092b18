"""Run trainstack's commands as a user would: subprocesses with the venv on PATH.

No command here has a timeout of its own: each test's `pytest.mark.timeout` is its hang
guard (pytest-timeout ends the test, and `subprocess.run` kills the command it waits on)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def user_env(*, unset: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """The environment of a shell with the project's venv activated, less `unset` (such
    as a setting the suite makes for every Ray, where trainstack's own default is what a
    test checks)."""
    # The user's command picks its own Ray (RAY_ADDRESS), and its own state API: tests/ray
    # points the state API of its session at a port nobody answers.
    dropped = {"RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", *unset}
    env = {name: value for name, value in os.environ.items() if name not in dropped}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(
    args: list[str], *, unset: tuple[str, ...] = (), **extra_env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=ROOT,
        env=user_env(unset=unset, **extra_env),
        capture_output=True,
        text=True,
        check=False,
    )
