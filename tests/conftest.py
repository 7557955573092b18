"""Session-wide set-up: the example user package is importable, as a user's would be.

`examples/` goes on sys.path and PYTHONPATH before any worker process starts, so the
gloo harness's processes, Ray's workers and the CLI's subprocesses import
`user_models` the way a user's job imports their own package.
"""

import os
import sys
from pathlib import Path

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")

if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if EXAMPLES not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([EXAMPLES, *_paths])
