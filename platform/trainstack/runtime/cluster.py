"""Where a run's Ray is: connecting (an address, else an embedded local instance), the
dashboard's address, placement beside the driver, and the environment workers on a
`ray start` cluster would not otherwise have."""

from __future__ import annotations

import os
import re
from pathlib import Path

import ray
import ray.train
import ray.train.torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainstack.config import ConfigError, JobConfig
from trainstack.kinds import kind_of
from trainstack.storage import (
    credential_env,
    is_store_uri,
)

EMBEDDED_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
"""What an embedded local instance's processes get in their environment (they inherit the
driver's), where the driver has not set it. Ray Train starts a PreemptionWatcher actor
with each worker group, to hear of nodes an autoscaler drains; the embedded instance is
one node that nothing drains, so there the watcher is only a process per group start
and a core_worker error line on the console about its restart arguments. A cluster
keeps Ray's default."""


def connect(address: str | None, *, log_to_driver: bool = True) -> bool:
    """Connect to Ray as `ray_target` says; return True when this call started an
    embedded local instance."""
    target = ray_target(address)
    if target == "cluster":
        where = address or os.environ["RAY_ADDRESS"]
        try:
            ray.init(address=where, log_to_driver=log_to_driver)
        except RuntimeError as err:
            if not str(err).startswith("Version mismatch"):
                raise
            raise ConfigError(version_mismatch(where, str(err))) from None
    elif target == "local":
        for name, value in EMBEDDED_RAY_ENV.items():
            os.environ.setdefault(name, value)
        # "local": a new instance even when a `ray start` cluster runs on this machine.
        ray.init(address="local", log_to_driver=log_to_driver)
    return target == "local"


def version_mismatch(address: str, message: str) -> str:
    """Ray's refusal to join a cluster of another Ray or Python, as one line."""
    found = re.findall(r"Ray: (\S+)\s+Python: (\S+)", message)
    theirs, ours = found if len(found) == 2 else (("?", "?"), ("?", "?"))
    return (
        f"the cluster at {address} runs Ray {theirs[0]} on Python {theirs[1]}, this driver "
        f"Ray {ours[0]} on Python {ours[1]}: a driver joins only a cluster of its own Ray and "
        "Python; run it from the cluster's environment, or `trainstack submit` the job "
        "(the Job API needs no matching Ray)"
    )


def dashboard_line() -> str:
    """Where to watch the run (call once connected): the Ray dashboard's address and,
    with token authentication on, how to get past its login.

    The address is the `RayContext` that `ray.init` returns, asked again of the running
    instance (`ignore_reinit_error`: it returns the context and starts nothing; it
    honours `RAY_OVERRIDE_DASHBOARD_URL`). Token authentication is on where
    `RAY_AUTH_MODE` is `token`: Ray reads only the environment variable, and sets it
    itself when a new local instance turns authentication on by default.
    """
    assert ray.is_initialized(), "dashboard_line() asks the instance this process is connected to"
    url = ray.init(ignore_reinit_error=True).dashboard_url  # host:port, no scheme
    if not url:
        return "Ray dashboard: not started by this Ray"
    line = f"Ray dashboard: http://{url}"
    if os.environ.get(RAY_AUTH_MODE_ENV, "").lower() == "token":
        line += " (it asks for the cluster's token: paste what `ray get-auth-token` prints)"
    return line


RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
"""Ray's authentication mode (`token` or `disabled`), documented with token
authentication; Ray versions without it ignore it."""


def ray_target(address: str | None) -> str | None:
    """What `connect(address)` will do: `local` (start an embedded instance on this
    machine), `cluster` (join `address`, else `$RAY_ADDRESS`), or None (Ray is already
    running in this process)."""
    if ray.is_initialized():
        return None
    return "cluster" if address or os.environ.get("RAY_ADDRESS") else "local"


def on_this_node() -> NodeAffinitySchedulingStrategy:
    """Placement beside the driver, for the run's small actors (the event queue): they
    live and die with the driver, never with a worker node that is lost."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def this_node_resource() -> str:
    """The resource only this process's node has, `node:<its IP>` as `ray.nodes()` lists
    it (call once connected): what reserves a sliver of it runs beside this process."""
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return f"node:{node['NodeManagerAddress']}"


def worker_env(cfg: JobConfig) -> dict[str, str]:
    """Environment the workers need that a `ray start` cluster would not give them."""
    env: dict[str, str] = {}
    user_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if user_paths:  # where the user's model and loss code lives (model.target, task.loss)
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in user_paths)
    if kind_of(cfg).engine_of(cfg) == "deepspeed":  # its JIT-built ops (cpu_adam): build once
        cache = os.environ.get("TORCH_EXTENSIONS_DIR") or ".cache/torch_extensions"
        env["TORCH_EXTENSIONS_DIR"] = str(Path(cache).resolve())
    if is_store_uri(cfg.checkpoint.storage_path):
        # Object-store credentials travel in the workers' runtime env (never in the spec,
        # which every checkpoint copies): each worker builds its own pyarrow filesystem
        # from `checkpoint.storage_options`, and pyarrow reads these from its environment.
        env.update(credential_env())
    return env
