"""Session-wide set-up: the example user package is importable, as a user's would be.

`examples/` goes on sys.path and PYTHONPATH before any worker process starts, so the
gloo harness's processes, Ray's workers and the CLI's subprocesses import
`user_models` the way a user's job imports their own package.
"""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run and machine (a failure reproduces
# anywhere), with no per-example deadline (a wall-clock bound a slow CI machine fails).
# HYPOTHESIS_PROFILE=explore draws fresh ones, for a hunt for new counterexamples.
settings.register_profile("suite", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

# Every Ray instance the suite starts (in-process, simulated clusters, `ray start`, the
# CLI's subprocesses) inherits this. Ray Train starts an actor per worker group to watch
# for node drains (preemption), a process of its own that no test uses: one process
# fewer per group start. (How often the controller polls the group, which every run's
# reports, end and restart wait for, is the spec's `failure.health_check_s`.)
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")

if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if EXAMPLES not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([EXAMPLES, *_paths])


@pytest.fixture
def refuse_ray_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """For checks that must refuse before Ray starts: starting Ray fails the test, and a
    Ray instance another test module left running in this process is not seen (so the
    code under test takes the path of a fresh `trainstack run`)."""
    import ray

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ray.init was called: the check did not refuse before Ray started")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
