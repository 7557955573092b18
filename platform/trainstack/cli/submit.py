"""`trainstack submit SPEC`: a job spec on a Ray cluster through Ray's Job API.

It runs what `ray job submit --working-dir . -- python jobs/train.py --config SPEC`
runs, from a checked spec, under a submission id and metadata that name the job, so
that the dashboard's Jobs page lists it as `trainstack-<name>-<strategy>-<id>`:

    ray start --head --dashboard-host=127.0.0.1
    trainstack submit jobs/configs/demo.yaml --address http://127.0.0.1:8265 \\
        --deps image --set train.steps=100

`--deps` says where the job's libraries (torch, DeepSpeed, MLflow, trainstack itself)
come from on the cluster: `image` (the cluster's image has them; `trainstack doctor
--address` checks), or `pip` / `uv` (the job's runtime environment installs them into a
virtualenv over the image's packages, with Ray pinned to the version the cluster runs,
and ships this trainstack as a `py_modules` package). Without it nothing is submitted.

It follows the job's log until the job ends (exit 0 when it succeeded, 1 otherwise);
`--no-wait` returns once the job is submitted. With token authentication on, the
cluster's token comes from `RAY_AUTH_TOKEN` (or `ray get-auth-token`'s file), as for
`ray job submit`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
import uuid
from typing import Any

from trainstack.cli.probe import job_client
from trainstack.config import ConfigError, JobConfig, load_config
from trainstack.stack import DEPS_CHOICES, dependency, extras_for, job_requirements

DEFAULT_ADDRESS = "http://127.0.0.1:8265"


def add_submit_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from trainstack.cli.args import add_overrides

    parser = commands.add_parser(
        "submit", help="run a job spec on a Ray cluster through its Job API, named after it"
    )
    parser.add_argument("config", help="job spec (YAML), a path inside --working-dir")
    add_overrides(parser, what="a spec key")
    parser.add_argument(
        "--address",
        default=None,
        help=f"the cluster's Job API (default: $RAY_ADDRESS, else {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--working-dir", default=".", help="uploaded for the job (default: this directory)"
    )
    parser.add_argument(
        "--summary-json", default=None, help="the job writes its summary here (on the cluster)"
    )
    parser.add_argument("--no-wait", action="store_true", help="return once submitted")
    add_deps_argument(parser, image="the cluster's image")
    parser.set_defaults(handler=submit_command)


def add_deps_argument(parser: argparse.ArgumentParser, *, image: str) -> None:
    parser.add_argument(
        "--deps",
        choices=DEPS_CHOICES,
        default=None,
        help=f"where the job's libraries come from: image ({image} has torch, DeepSpeed, "
        "MLflow and trainstack), or pip / uv (the job's runtime env installs them, Ray "
        "pinned to the cluster's own)",
    )


def deps_required(*, command: str) -> str:
    """The one line for a submission that does not say where its libraries come from."""
    return (
        f"{command} needs --deps: image (the cluster's image has torch, DeepSpeed, MLflow "
        "and trainstack; `trainstack doctor --address ADDR` checks), pip or uv (the job's "
        "runtime env installs them, resolved against the cluster's Ray)"
    )


def dependency_env(deps: str, *, ray_version: str, cfg: JobConfig) -> dict[str, Any]:
    """The runtime-env entry that installs trainstack's libraries for `cfg` with `deps`
    (pip or uv) over an image whose Ray is `ray_version`. ConfigError when that Ray is
    outside trainstack's range."""
    ray = dependency("ray")
    if not ray.admits(ray_version):
        raise ConfigError(
            f"the cluster runs Ray {ray_version}; trainstack needs {ray.versions}: start the "
            f"cluster from an image with Ray in that range (its Ray cannot be replaced by a "
            "job's runtime env)"
        )
    extras = extras_for(
        model_kind=cfg.model.kind, data_kind=cfg.data.kind, lora=bool(cfg.model.lora.rank)
    )
    return {deps: {"packages": job_requirements(ray_version=ray_version, extras=extras)}}


def submit_command(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        if args.deps is None:
            raise ConfigError(deps_required(command="trainstack submit"))
    except ConfigError as err:
        print(f"trainstack: error: {err}", file=sys.stderr)
        return 2
    address = args.address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS
    runtime_env: dict[str, Any] = {"working_dir": args.working_dir}
    if args.deps != "image":
        try:
            runtime_env.update(_bring_dependencies(args.deps, address=address, cfg=cfg))
        except ConfigError as err:
            print(f"trainstack: error: {err}", file=sys.stderr)
            return 2
    try:
        client = job_client(address)
        job_id = client.submit_job(
            entrypoint=entrypoint(args.config, args.overrides, summary_json=args.summary_json),
            submission_id=submission_id(cfg),
            runtime_env=runtime_env,
            metadata=job_metadata(cfg, spec=args.config),
        )
    except (ConnectionError, RuntimeError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        print(f"trainstack: error: submitting to {address}: {first}", file=sys.stderr)
        return 1
    print(f"trainstack: submitted {job_id} to {address} (its Jobs page lists it by that id)")
    if args.no_wait:
        print(f"trainstack: follow it with `ray job logs --address {address} --follow {job_id}`")
        return 0
    asyncio.run(_follow(client, job_id))
    status = client.get_job_status(job_id)
    ended = str(getattr(status, "value", status))
    print(f"trainstack: job {job_id} {ended.lower()}")
    return 0 if ended == "SUCCEEDED" else 1


def _bring_dependencies(deps: str, *, address: str, cfg: JobConfig) -> dict[str, Any]:
    """The runtime env's `pip`/`uv` entry, Ray pinned to the version the cluster's head
    runs (asked by a probe job), and this trainstack as a `py_modules` package."""
    from pathlib import Path

    from trainstack.cli.probe import ClusterProbeError, head_ray_version, probe_cluster

    try:
        ray_version = head_ray_version(probe_cluster(address))
    except ClusterProbeError as err:
        raise ConfigError(f"asking the cluster at {address} for its Ray version: {err}") from err
    if ray_version is None:
        raise ConfigError(f"the cluster at {address} answered with no Ray version")
    package = Path(__file__).resolve().parents[1]  # platform/trainstack, or site-packages'
    env = dependency_env(deps, ray_version=ray_version, cfg=cfg)
    print(
        f"trainstack: the job's runtime env installs with {deps}, Ray pinned to the cluster's "
        f"{ray_version}: {' '.join(env[deps]['packages'])}"
    )
    return {**env, "py_modules": [str(package)]}


def submission_id(cfg: JobConfig) -> str:
    """`trainstack-<name>-<strategy>-<8 hex>`: what the Jobs page shows."""
    return f"trainstack-{cfg.name}-{cfg.strategy.kind}-{uuid.uuid4().hex[:8]}"


def job_metadata(cfg: JobConfig, *, spec: str) -> dict[str, str]:
    return {
        "job_name": cfg.name,  # the Jobs page's Name column
        "trainstack.name": cfg.name,
        "trainstack.strategy": cfg.strategy.kind,
        "trainstack.workers": str(cfg.scaling.num_workers),
        "trainstack.spec": spec,
    }


def entrypoint(spec: str, overrides: list[str], *, summary_json: str | None) -> str:
    """The job's command: jobs/train.py on the spec, progress as lines in the job's log."""
    sets = [part for override in overrides for part in ("--set", override)]
    command = ["python", "jobs/train.py", "--config", spec, *sets, "--progress", "lines"]
    if summary_json:
        command += ["--summary-json", summary_json]
    return shlex.join(command)


async def _follow(client: Any, job_id: str) -> None:
    """Print the job's log as it grows until the job ends. A log stream may close before
    the job does (Ray 2.51's does when the job has not started yet): then it is opened
    again, which streams the log from its start, and only what is new is printed; what
    the last stream missed comes from the whole log once the job has ended."""
    printed = 0
    while True:
        seen = 0
        async for lines in client.tail_job_logs(job_id):
            new = lines[max(0, printed - seen) :]
            seen += len(lines)
            if new:
                print(new, end="", flush=True)
                printed += len(new)
        if client.get_job_status(job_id).is_terminal():
            break
        await asyncio.sleep(1)
    print(client.get_job_logs(job_id)[printed:], end="", flush=True)
