"""cluster.yaml passes Ray's own cluster-launcher validation and keeps the cluster closed.

Validation is what `ray up` runs before it talks to AWS: `prepare_config` merges Ray's
AWS defaults in, then `validate_config` checks the result against
ray/autoscaler/ray-schema.json. No cloud call, no Ray cluster.
"""

import copy
import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


def load_cluster_yaml() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(CLUSTER_YAML.read_text())
    return config


def prepared(config: dict[str, Any]) -> dict[str, Any]:
    """`config` merged with Ray's AWS defaults and validated, as `ray up` does."""
    merged: dict[str, Any] = prepare_config(copy.deepcopy(config))
    validate_config(merged)
    return merged


def ray_start_commands(commands: list[str]) -> list[list[str]]:
    """The commands among `commands` that run `ray start`, each split into words."""
    return [shlex.split(command) for command in commands if "ray start" in command]


def public_binds(config: dict[str, Any]) -> list[str]:
    """Every wildcard address anywhere in the config Ray would run."""
    text = json.dumps(config)
    return [address for address in ("0.0.0.0", "[::]", "=::") if address in text]


def test_cluster_yaml_passes_rays_launcher_schema() -> None:
    prepared(load_cluster_yaml())


# A misspelled top-level key is the dangerous case: Ray fills the real key from its own
# defaults, whose head start command binds the dashboard to 0.0.0.0.
MISSPELLINGS = [
    (("head_start_ray_commands",), "head_start_ray_command"),
    (("available_node_types", "gpu_worker", "max_workers"), "max_worker"),
    (("available_node_types", "head", "resources"), "resource"),
]


@pytest.mark.parametrize(("path", "typo"), MISSPELLINGS, ids=[typo for _, typo in MISSPELLINGS])
def test_rays_validator_rejects_a_misspelled_key(path: tuple[str, ...], typo: str) -> None:
    config = load_cluster_yaml()
    *parents, key = path
    holder = config
    for name in parents:
        holder = holder[name]
    holder[typo] = holder.pop(key)
    with pytest.raises(jsonschema.ValidationError) as rejected:
        prepared(config)
    assert list(rejected.value.path) == parents


def test_dashboard_and_job_api_bind_to_loopback_only() -> None:
    config = prepared(load_cluster_yaml())
    (head_start,) = ray_start_commands(config["head_start_ray_commands"])
    assert "--head" in head_start
    hosts = [word.split("=", 1)[1] for word in head_start if word.startswith("--dashboard-host=")]
    assert hosts == ["127.0.0.1"]
    assert public_binds(config) == []


def test_loopback_check_catches_rays_public_default() -> None:
    """Without our start commands Ray's default binds 0.0.0.0, and the check says so."""
    config = load_cluster_yaml()
    del config["head_start_ray_commands"]
    assert public_binds(prepared(config)) == ["0.0.0.0"]


def test_every_node_starts_ray_with_token_auth() -> None:
    config = prepared(load_cluster_yaml())
    starts = ray_start_commands(
        config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    )
    assert len(starts) == 2
    for words in starts:
        assert "RAY_AUTH_MODE=token" in words
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_head_takes_no_training_and_gpu_workers_scale_within_bounds() -> None:
    config = prepared(load_cluster_yaml())
    node_types = config["available_node_types"]
    head = node_types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    gpu_worker = node_types["gpu_worker"]
    assert gpu_worker["resources"]["GPU"] >= 1
    assert 0 <= gpu_worker["min_workers"] <= gpu_worker["max_workers"] <= config["max_workers"]


def test_project_mount_leaves_local_state_behind() -> None:
    config = load_cluster_yaml()
    assert config["file_mounts"]["~/trainstack"] == "."
    assert {".git", ".venv", ".cache", "runs", "mlflow.db"} <= set(config["rsync_exclude"])
    assert config["rsync_filter"] == [".gitignore"]
