"""`trainstack k8s SPEC`: the same job on Kubernetes, as a KubeRay `RayJob` manifest.

    trainstack k8s jobs/configs/demo.yaml --working-dir s3://BUCKET/trainstack.zip \
        --deps pip --storage s3://BUCKET/runs --secret aws-credentials --out demo-rayjob.yaml
    kubectl apply -f demo-rayjob.yaml

KubeRay's operator turns a `RayJob` into a Ray cluster (a head pod and a group of worker
pods), submits the entrypoint to it once it is up, and (`shutdownAfterJobFinishes`)
deletes the cluster when the job ends. The manifest `rayjob_manifest` writes:

- **head**: runs no training (`num-cpus: 0`, as `cluster.yaml`'s head does), serves the
  dashboard and the Job API inside the cluster (reach it with `kubectl port-forward`);
- **workers**: one pod per training worker (`scaling.num_workers`, `minReplicas` the
  elastic minimum), each with the CPUs the worker reserves (`scaling.cpus_per_worker`),
  one GPU under `scaling.use_gpu` (`nvidia.com/gpu`), and `resources_per_worker` as Ray
  resources;
- **the project**: `working_dir`, a zip of the project at a URI every pod can read (Ray
  downloads it, as `ray job submit --working-dir` uploads one, and puts it first on
  every process's PYTHONPATH), and/or an image with trainstack installed. `--package
  ZIP` writes that zip: the checkout's tracked files, with `platform/trainstack` at the
  top as `trainstack/`, so the pods import it from there;
- **the libraries** (`--deps`): Ray's own image has Ray alone, so either `--image` names
  one that has torch, DeepSpeed and MLflow too (`--deps image`), or the job's runtime
  environment installs them over Ray's image with pip or uv (`--deps pip`, `--deps uv`),
  Ray pinned to the image's version;
- **the entrypoint**: `python jobs/train.py --config SPEC ...`, the command
  `trainstack submit` sends, with the job's metadata (`trainstack submit`'s too);
- **checkpoints**: pods share no disk, so `checkpoint.storage_path` must be an object
  store (`--storage s3://...` sets it); credentials come from a Kubernetes secret
  (`--secret`, as environment variables in every pod).
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from trainstack.cli.submit import (
    add_deps_argument,
    dependency_env,
    deps_required,
    entrypoint,
    job_metadata,
)
from trainstack.config import ConfigError, JobConfig, load_config
from trainstack.storage import is_store_uri

RAY_IMAGE = "rayproject/ray:{version}-py311{gpu}"
"""Ray's published image for the Ray this job runs on (`-gpu`: with CUDA)."""
NAME_CHARS = 47
"""Longest RayJob name: KubeRay derives its cluster's and pods' names from it."""


def rayjob_manifest(
    cfg: JobConfig,
    *,
    spec: str,
    overrides: list[str],
    working_dir: str | None,
    image: str | None,
    ray_version: str,
    deps: str,
    namespace: str | None = None,
    secret: str | None = None,
    worker_memory: str = "8Gi",
    head_memory: str = "4Gi",
) -> dict[str, Any]:
    """The `RayJob` for `spec` (with `overrides`, as `trainstack run` takes them), its
    libraries from `deps` (`image`, `pip` or `uv`). ConfigError when pods could not run
    it: checkpoints on a local path, the project nowhere a pod can find it, or Ray's own
    image (which has no torch) with nothing to install the libraries."""
    if not is_store_uri(cfg.checkpoint.storage_path):
        raise ConfigError(
            f"checkpoint.storage_path={cfg.checkpoint.storage_path!r} is a local path, which "
            "Kubernetes pods do not share; give --storage s3://BUCKET/PREFIX (or set "
            "checkpoint.storage_path to an object store)"
        )
    if working_dir is None and image is None:
        raise ConfigError(
            "the pods need the project: give --working-dir URI (a zip of it every pod can "
            "read, e.g. s3://BUCKET/trainstack.zip from `git archive -o trainstack.zip "
            "HEAD`) or --image IMAGE (one with it installed)"
        )
    if deps == "image" and image is None:
        raise ConfigError(
            f"--deps image: Ray's own image ({RAY_IMAGE.format(version=ray_version, gpu='')}) "
            "has no torch, DeepSpeed or MLflow; give --image IMAGE (one that has them), or "
            "--deps pip / --deps uv to install them when the job starts"
        )
    if deps != "image" and working_dir is None:
        raise ConfigError(
            f"--deps {deps} installs trainstack's libraries, not trainstack: give --working-dir "
            "URI (a zip of the project; --package writes one)"
        )
    s = cfg.scaling
    gpu = "-gpu" if s.use_gpu else ""
    image = image or RAY_IMAGE.format(version=ray_version, gpu=gpu)
    env = [{"secretRef": {"name": secret}}] if secret else []
    cpus = max(1, math.ceil(s.cpus_per_worker))
    worker_limits: dict[str, Any] = {"cpu": str(cpus), "memory": worker_memory}
    if s.use_gpu:
        worker_limits["nvidia.com/gpu"] = 1
    worker_params: dict[str, str] = {"num-cpus": str(cpus)}
    if s.resources_per_worker:
        worker_params["resources"] = yaml.safe_dump(
            dict(s.resources_per_worker), default_flow_style=True
        ).strip()
    runtime_env: dict[str, Any] = {}
    if working_dir is not None:
        runtime_env["working_dir"] = working_dir
    if deps != "image":
        runtime_env.update(dependency_env(deps, ray_version=ray_version, cfg=cfg))
    name = resource_name(cfg.name)
    manifest: dict[str, Any] = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "trainstack", "trainstack.name": name},
        },
        "spec": {
            "entrypoint": entrypoint(spec, overrides, summary_json=None),
            "metadata": job_metadata(cfg, spec=spec),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "backoffLimit": 0,  # trainstack restarts failed workers itself (failure.*)
            "rayClusterSpec": {
                "rayVersion": ray_version,
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": _pod("ray-head", image, cpu="2", memory=head_memory, env=env),
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "trainers",
                        "replicas": s.num_workers,
                        "minReplicas": s.min_workers if s.elastic else s.num_workers,
                        "maxReplicas": s.num_workers,
                        "rayStartParams": worker_params,
                        "template": _pod("ray-worker", image, limits=worker_limits, env=env),
                    }
                ],
            },
        },
    }
    if runtime_env:
        manifest["spec"]["runtimeEnvYAML"] = yaml.safe_dump(runtime_env, sort_keys=True)
    if namespace:
        manifest["metadata"]["namespace"] = namespace
    if env:
        manifest["spec"]["submitterPodTemplate"] = _pod("ray-job-submitter", image, env=env)
        submitter = manifest["spec"]["submitterPodTemplate"]["spec"]
        submitter["restartPolicy"] = "Never"
    return manifest


def _pod(
    container: str,
    image: str,
    *,
    cpu: str = "1",
    memory: str = "2Gi",
    limits: dict[str, Any] | None = None,
    env: list[dict[str, Any]],
) -> dict[str, Any]:
    resources = limits or {"cpu": cpu, "memory": memory}
    spec: dict[str, Any] = {
        "name": container,
        "image": image,
        "resources": {"limits": resources, "requests": dict(resources)},
    }
    if env:
        spec["envFrom"] = copy.deepcopy(env)  # each pod its own: no YAML anchors, aliases
    return {"spec": {"containers": [spec]}}


def resource_name(name: str) -> str:
    """`name` as a Kubernetes resource name: lower-case letters, digits and '-', starting
    with a letter, at most `NAME_CHARS`."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not cleaned or not cleaned[0].isalpha():
        cleaned = f"trainstack-{cleaned}".strip("-")
    return cleaned[:NAME_CHARS].rstrip("-")


def manifest_yaml(manifest: dict[str, Any]) -> str:
    return yaml.safe_dump(manifest, sort_keys=False)


def package_project(root: Path, out: Path) -> int:
    """Zip the checkout at `root` (the files git tracks, and new ones it does not ignore)
    into `out`, `platform/trainstack/...` as `trainstack/...` (importable from the zip's
    top, where Ray's working_dir puts it on PYTHONPATH); return how many files.
    ConfigError when `root` is not a git checkout."""
    import subprocess
    import zipfile

    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        raise ConfigError(
            f"--package: {str(root)!r} is not a git checkout (the zip holds the files git "
            "tracks); run it from the project's checkout"
        )
    files = [name for name in listed.stdout.decode().split("\0") if name]
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in files:
            target = (
                name.removeprefix("platform/") if name.startswith("platform/trainstack/") else name
            )
            if (root / name).is_file():
                archive.write(root / name, target)
    return len(files)


def add_k8s_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from trainstack.cli.args import add_overrides

    parser = commands.add_parser(
        "k8s", help="write a KubeRay RayJob manifest that runs a job spec on Kubernetes"
    )
    parser.add_argument("config", help="job spec (YAML), a path inside the project")
    add_overrides(parser, what="a spec key")
    parser.add_argument(
        "--working-dir", default=None, help="a zip of the project at a URI every pod can read"
    )
    parser.add_argument("--image", default=None, help="container image (default: Ray's)")
    parser.add_argument(
        "--storage", default=None, help="checkpoint.storage_path on an object store (s3://...)"
    )
    parser.add_argument("--secret", default=None, help="a Secret whose keys become env vars")
    parser.add_argument("--namespace", default=None, help="the RayJob's namespace")
    parser.add_argument("--worker-memory", default="8Gi", help="each worker pod (default 8Gi)")
    parser.add_argument("--head-memory", default="4Gi", help="the head pod (default 4Gi)")
    parser.add_argument("--out", default=None, help="write the manifest here (default: stdout)")
    parser.add_argument(
        "--package", default=None, help="also zip this checkout here, to upload as --working-dir"
    )
    add_deps_argument(parser, image="--image")
    parser.set_defaults(handler=k8s_command)


def k8s_command(args: argparse.Namespace) -> int:
    import ray

    overrides = list(args.overrides)
    if args.storage:
        overrides.append(f"checkpoint.storage_path={args.storage}")
    try:
        cfg = load_config(args.config, overrides)
        if args.deps is None:
            raise ConfigError(deps_required(command="trainstack k8s"))
        manifest = rayjob_manifest(
            cfg,
            spec=args.config,
            overrides=overrides,
            working_dir=args.working_dir,
            image=args.image,
            ray_version=ray.__version__,
            deps=args.deps,
            namespace=args.namespace,
            secret=args.secret,
            worker_memory=args.worker_memory,
            head_memory=args.head_memory,
        )
    except ConfigError as err:
        print(f"trainstack: error: {err}", file=sys.stderr)
        return 2
    text = manifest_yaml(manifest)
    if args.package:
        try:
            count = package_project(Path.cwd(), Path(args.package))
        except ConfigError as err:
            print(f"trainstack: error: {err}", file=sys.stderr)
            return 2
        where = args.working_dir or "a URI every pod can read, given as --working-dir"
        print(
            f"trainstack: zipped {count} files into {args.package}; upload it to {where}",
            file=sys.stderr,
        )
    if args.out is None:
        print(text, end="")
        return 0
    Path(args.out).write_text(text)
    print(f"trainstack: wrote {args.out}; run it with `kubectl apply -f {args.out}`")
    return 0
