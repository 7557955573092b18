"""Run trainstack's commands as a user would: subprocesses with the venv on PATH."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def user_env(**extra: str) -> dict[str, str]:
    """The environment of a shell with the project's venv activated."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(args: list[str], *, timeout: float, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=ROOT,
        env=user_env(**extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
