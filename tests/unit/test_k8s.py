"""`trainstack k8s`: the RayJob manifests it writes are ones KubeRay's own schema accepts.

No Kubernetes runs here. The manifests are validated against the `v1` openAPIV3Schema of
KubeRay's RayJob CRD, vendored as `kuberay/ray.io_rayjobs-v1.7.0.yaml.gz`: an unchanged
gzip of `ray-operator/config/crd/bases/ray.io_rayjobs.yaml` from github.com/ray-project/
kuberay at tag v1.7.0 (commit 59d663ae), the file `kubectl apply` installs with the
operator. The schema is what the API server checks a RayJob against; what the operator
then does with it (pods starting, the job submitted) is not run here.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from trainstack.cli.app import main
from trainstack.cli.k8s import rayjob_manifest, resource_name
from trainstack.config import ConfigError, config_from_dict, load_config

HERE = Path(__file__).parent
CRD = HERE / "kuberay" / "ray.io_rayjobs-v1.7.0.yaml.gz"
DEMO = str(HERE.parents[1] / "jobs" / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def rayjob_schema() -> dict[str, Any]:
    with gzip.open(CRD) as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: dict[str, Any] = v1["schema"]["openAPIV3Schema"]
    return schema


def validate(manifest: dict[str, Any], schema: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(schema).validate(manifest)


def test_the_vendored_schema_refuses_what_kuberay_refuses(rayjob_schema: dict) -> None:
    """The check can fail: a wrong type and a container without its required name are
    refused. (A field the CRD does not know is not: the API server prunes such fields
    rather than refusing them, and the schema says so by leaving them open.)"""
    manifest = demo_manifest()
    manifest["spec"]["shutdownAfterJobFinishes"] = "yes"
    with pytest.raises(jsonschema.ValidationError, match="'yes' is not of type 'boolean'"):
        validate(manifest, rayjob_schema)
    manifest = demo_manifest()
    manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'integer'"):
        validate(manifest, rayjob_schema)
    manifest = demo_manifest()
    del manifest["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "name"
    ]
    with pytest.raises(jsonschema.ValidationError, match="'name' is a required property"):
        validate(manifest, rayjob_schema)


def demo_manifest(**changes: Any) -> dict[str, Any]:
    overrides = ["checkpoint.storage_path=s3://bucket/runs", *changes.pop("overrides", [])]
    cfg = load_config(DEMO, overrides)
    keys: dict[str, Any] = {
        "working_dir": "s3://bucket/trainstack.zip",
        "image": None,
        "deps": "pip",
    }
    return rayjob_manifest(
        cfg,
        spec="jobs/configs/demo.yaml",
        overrides=overrides,
        ray_version="2.60.0",
        **(keys | changes),
    )


def test_a_cpu_job_becomes_a_head_without_training_and_a_pod_per_worker(
    rayjob_schema: dict,
) -> None:
    manifest = demo_manifest(namespace="ml")
    validate(manifest, rayjob_schema)
    spec = manifest["spec"]
    cluster = spec["rayClusterSpec"]
    assert manifest["metadata"] == {
        "name": "demo",
        "namespace": "ml",
        "labels": {"app.kubernetes.io/name": "trainstack", "trainstack.name": "demo"},
    }
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (workers,) = cluster["workerGroupSpecs"]
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (2, 2, 2)
    (container,) = workers["template"]["spec"]["containers"]
    assert container["image"] == "rayproject/ray:2.60.0-py311"
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "8Gi"}
    assert workers["rayStartParams"] == {"num-cpus": "1"}
    assert spec["entrypoint"] == (
        "python jobs/train.py --config jobs/configs/demo.yaml "
        "--set checkpoint.storage_path=s3://bucket/runs --progress lines"
    )
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == "s3://bucket/trainstack.zip"
    # Ray's image has Ray alone: the job installs the rest, Ray held at the image's own
    packages = runtime_env["pip"]["packages"]
    assert "ray[default,train,tune]==2.60.0" in packages
    assert {p.split(">")[0].split("=")[0] for p in packages} >= {"torch", "deepspeed", "mlflow"}
    assert not any(p.startswith("transformers") for p in packages)  # the demo needs no hf
    assert spec["shutdownAfterJobFinishes"] is True and spec["metadata"]["job_name"] == "demo"


def test_a_gpu_job_asks_each_worker_pod_for_one_gpu_and_uses_the_cuda_image(
    rayjob_schema: dict,
) -> None:
    manifest = demo_manifest(
        overrides=["scaling.use_gpu=true", "scaling.num_workers=4", "scaling.cpus_per_worker=8"],
        secret="aws-credentials",
    )
    validate(manifest, rayjob_schema)
    cluster = manifest["spec"]["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == 4
    (container,) = workers["template"]["spec"]["containers"]
    assert container["image"] == "rayproject/ray:2.60.0-py311-gpu"
    assert container["resources"]["limits"] == {
        "cpu": "8",
        "memory": "8Gi",
        "nvidia.com/gpu": 1,
    }
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]  # the head trains nothing
    for pod in (head, container, *manifest["spec"]["submitterPodTemplate"]["spec"]["containers"]):
        assert pod["envFrom"] == [{"secretRef": {"name": "aws-credentials"}}]


def test_an_elastic_job_lets_the_worker_group_shrink_to_its_minimum(rayjob_schema: dict) -> None:
    manifest = demo_manifest(
        overrides=["scaling.num_workers={min: 2, max: 4}", "train.global_batch_size=48"],
        image="registry.example.com/team/trainstack:1.0",
        working_dir=None,
        deps="image",
    )
    validate(manifest, rayjob_schema)
    (workers,) = manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (4, 2, 4)
    assert "runtimeEnvYAML" not in manifest["spec"]  # the image has the project


@pytest.mark.parametrize(
    ("storage", "working_dir", "image", "deps", "words"),
    [
        (
            "runs",
            "s3://bucket/p.zip",
            None,
            "pip",
            "is a local path, which Kubernetes pods do not share",
        ),
        ("s3://bucket/runs", None, None, "image", "the pods need the project: give --working-dir"),
        ("s3://bucket/runs", "s3://bucket/p.zip", None, "image", "has no torch, DeepSpeed"),
        ("s3://bucket/runs", None, "team/img:1", "uv", "not trainstack: give --working-dir"),
    ],
)
def test_a_manifest_pods_could_not_run_is_refused_in_one_line(
    storage: str, working_dir: str | None, image: str | None, deps: str, words: str
) -> None:
    cfg = config_from_dict({"name": "x", "checkpoint": {"storage_path": storage}})
    with pytest.raises(ConfigError) as refused:
        rayjob_manifest(
            cfg,
            spec="x.yaml",
            overrides=[],
            working_dir=working_dir,
            image=image,
            ray_version="2.60.0",
            deps=deps,
        )
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_names_become_kubernetes_resource_names() -> None:
    assert resource_name("My_Run.v2") == "my-run-v2"
    assert resource_name("7b-sweep") == "trainstack-7b-sweep"
    assert len(resource_name("x" * 80)) == 47


def test_the_command_writes_a_manifest_that_validates(
    tmp_path: Path, rayjob_schema: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo-rayjob.yaml"
    code = main(
        [
            "k8s",
            DEMO,
            "--working-dir",
            "s3://bucket/p.zip",
            "--deps",
            "uv",
            "--storage",
            "s3://bucket/runs",
            "--secret",
            "aws-credentials",
            "--out",
            str(out),
            "--set",
            "train.steps=100",
        ]
    )
    assert code == 0
    text = out.read_text()
    manifest = yaml.safe_load(text)
    validate(manifest, rayjob_schema)
    assert "&" not in text and "*id" not in text  # plain YAML: no anchors or aliases
    assert (
        "--set train.steps=100 --set checkpoint.storage_path=s3://bucket/runs"
        in (manifest["spec"]["entrypoint"])
    )
    assert f"kubectl apply -f {out}" in capsys.readouterr().out
    assert "uv" in yaml.safe_load(manifest["spec"]["runtimeEnvYAML"])
    assert main(["k8s", DEMO, "--working-dir", "s3://bucket/p.zip", "--deps", "pip"]) == 2
    assert "is a local path" in capsys.readouterr().err
    # Ray's image and nothing to install torch with: refused before anything is written
    assert (
        main(["k8s", DEMO, "--working-dir", "s3://bucket/p.zip", "--storage", "s3://bucket/r"]) == 2
    )
    assert "trainstack k8s needs --deps" in capsys.readouterr().err


def test_the_package_puts_trainstack_where_rays_working_dir_makes_it_importable(
    tmp_path: Path,
) -> None:
    """Ray's working_dir puts the unpacked zip first on PYTHONPATH (its
    `set_pythonpath_in_context`): from there, `import trainstack` and `jobs/train.py`
    find the zip's copy, not an installed one."""
    import subprocess
    import sys
    import zipfile

    from trainstack.cli.k8s import package_project

    root = HERE.parents[1]
    count = package_project(root, tmp_path / "project.zip")
    unpacked = tmp_path / "working_dir"
    with zipfile.ZipFile(tmp_path / "project.zip") as archive:
        names = set(archive.namelist())
        archive.extractall(unpacked)
    assert count > 100 and len(names) == count
    assert {"trainstack/__init__.py", "trainstack/cli/k8s.py", "jobs/train.py"} <= names
    assert "jobs/configs/demo.yaml" in names and not any(n.startswith("platform/") for n in names)
    found = subprocess.run(
        [sys.executable, "-c", "import trainstack; print(trainstack.__file__)"],
        cwd=unpacked,
        env={"PYTHONPATH": str(unpacked), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == str(unpacked / "trainstack" / "__init__.py")
