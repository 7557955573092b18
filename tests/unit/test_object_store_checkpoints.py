"""Checkpoints in an object store (a real local S3: moto's server): verification reads
back from the store, cut-off uploads are skipped and pruned by the local rules, export
and resume take URIs, and bad settings or a stopped store are one line."""

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pyarrow.fs as pafs
import pytest
import torch
from moto.server import ThreadedMotoServer

from trainstack import checkpoint as ckpt
from trainstack.cli import main
from trainstack.config import ConfigError, config_from_dict, config_to_dict
from trainstack.runtime.gloo_processes import run_processes
from trainstack.runtime.preflight import check_storage
from trainstack.storage import StorePath, open_location

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def start_server() -> tuple[ThreadedMotoServer, dict[str, Any]]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    options = {"endpoint_override": f"http://127.0.0.1:{port}", "scheme": "http"}
    return server, {**options, "region": "us-east-1"}


@pytest.fixture(scope="module")
def store() -> Iterator[dict[str, Any]]:
    """The server's storage_options, with the credentials in the environment."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in CREDENTIALS.items():
            env.setenv(key, value)
        server, options = start_server()
        yield options
        server.stop()


@pytest.fixture
def bucket(store: dict[str, Any]) -> str:
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=store["endpoint_override"], region_name="us-east-1")
    s3.create_bucket(Bucket=name)
    return name


def spec(storage: str, options: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "demo",
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8},
        "data": {"vocab_size": 16, "eval_samples": 8},
        "train": {"steps": 20, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"warmup_steps": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": storage, "storage_options": options, "every_steps": 5},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def weights(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), float(step)), "b": torch.arange(step, dtype=torch.float32)}


def upload(run: StorePath, tmp_path: Path, *, step: int, raw: dict[str, Any]) -> StorePath:
    """A checkpoint as two ranks and Ray Train leave it: each rank's files and rank 0's
    manifest listing them all, copied into the store's checkpoint folder."""
    staging = tmp_path / f"staging-{step}"
    files = {
        "model.pt": weights(step),
        "rng/rank_00000.pt": {"r": 0},
        "rng/rank_00001.pt": {"r": 1},
    }
    entries = ckpt.write_rank_files(staging, files)
    manifest = {
        "format": ckpt.FORMAT_VERSION,
        "step": step,
        "samples_seen": step * 16,
        "spec": config_to_dict(config_from_dict(raw)),
        "world": {"world_size": 2},
        "files": entries,
    }
    ckpt.write_manifest(staging, manifest)
    target = run / ckpt.dir_name(step)
    pafs.copy_files(str(staging), target.path, destination_filesystem=run.fs)
    return target


def run_location(bucket: str, options: dict[str, Any]) -> StorePath:
    run = open_location(f"s3://{bucket}/runs/demo", options)
    assert isinstance(run, StorePath)
    return run


def overwrite(file: StorePath, data: bytes) -> None:
    with file.fs.open_output_stream(file.path) as stream:
        stream.write(data)


def test_newest_checkpoint_that_verifies_in_the_store_is_chosen_past_cut_off_uploads(
    store: dict[str, Any], bucket: str, tmp_path: Path
) -> None:
    raw = spec(f"s3://{bucket}/runs", store)
    run = run_location(bucket, store)
    for step in (5, 10, 15, 20, 25):
        upload(run, tmp_path, step=step, raw=raw)
    (run / ckpt.dir_name(25) / ckpt.MANIFEST).delete_file()  # cut off before the manifest
    (run / ckpt.dir_name(20) / "rng/rank_00001.pt").delete_file()  # rank 1's upload lost
    model = run / ckpt.dir_name(15) / "model.pt"
    overwrite(model, model.read_bytes()[:-10])  # truncated
    model = run / ckpt.dir_name(10) / "model.pt"
    data = model.read_bytes()
    overwrite(model, data[:-1] + bytes([data[-1] ^ 1]))  # same size, other bytes

    warnings: list[str] = []
    start = ckpt.find_start(run, resume_from=None, on_corrupt="fail", warn=warnings.append)

    assert start is not None and start.step == 5
    assert start.path == run / ckpt.dir_name(5)
    assert str(start.path) == f"s3://{bucket}/runs/demo/checkpoint_00000005"
    assert len(warnings) == 4
    assert "checkpoint_00000025/manifest.json: missing" in warnings[0]
    assert "checkpoint_00000020/rng/rank_00001.pt: missing" in warnings[1]
    assert "checkpoint_00000015/model.pt: size" in warnings[2]
    assert "checkpoint_00000010/model.pt: sha256 does not match" in warnings[3]
    for name, value in weights(5).items():
        assert torch.equal(start.load("model.pt")[name], value)
        assert torch.equal(start.full_weights()[name], value)


def test_pruning_in_the_store_keeps_the_newest_valid_and_newer_incomplete_ones(
    store: dict[str, Any], bucket: str, tmp_path: Path
) -> None:
    raw = spec(f"s3://{bucket}/runs", store)
    run = run_location(bucket, store)
    for step in (5, 10, 12, 15, 20):
        upload(run, tmp_path, step=step, raw=raw)
    (run / ckpt.dir_name(12) / "model.pt").delete_file()  # older than a valid one: cut off
    (run / ckpt.dir_name(20) / ckpt.MANIFEST).delete_file()  # newest: may still be uploading

    ckpt.prune(run, keep=2)

    assert [p.name for p in ckpt.list_checkpoints(run)] == [
        ckpt.dir_name(20),
        ckpt.dir_name(15),
        ckpt.dir_name(10),
    ]
    assert not (run / ckpt.dir_name(5) / "model.pt").exists()


def test_rerun_resume_and_export_take_the_store_uri(
    store: dict[str, Any], bucket: str, tmp_path: Path
) -> None:
    raw = spec(f"s3://{bucket}/runs", store)
    run = run_location(bucket, store)
    upload(run, tmp_path, step=20, raw=raw)

    start = ckpt.checked_start(
        config_from_dict(raw), resume_from=None, shapes={}, data_fingerprint=""
    )
    assert start is not None and start.path == run / ckpt.dir_name(20)
    with pytest.raises(ckpt.CheckpointError, match=rf"in s3://{bucket}/runs/demo, from another"):
        changed = spec(f"s3://{bucket}/runs", store, strategy={"kind": "zero"})
        ckpt.checked_start(
            config_from_dict(changed), resume_from=None, shapes={}, data_fingerprint=""
        )
    # Another run (another name) starts from this one's newest checkpoint on purpose.
    other = config_from_dict({**raw, "name": "other"})
    chosen = ckpt.checked_start(other, resume_from=run, shapes={}, data_fingerprint="")
    assert chosen is not None and chosen.step == 20

    out = tmp_path / "exported.pt"
    options = [arg for k, v in store.items() for arg in ("--storage-option", f"{k}={v}")]
    assert main(["export", f"s3://{bucket}/runs/demo", "--out", str(out), *options]) == 0
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == weights(20).keys()
    assert all(torch.equal(exported[k], v) for k, v in weights(20).items())


def test_preflight_probes_the_bucket_and_leaves_nothing_behind(
    store: dict[str, Any], bucket: str
) -> None:
    check_storage(config_from_dict(spec(f"s3://{bucket}/runs", store)))
    s3 = boto3.client("s3", endpoint_url=store["endpoint_override"], region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert all(key.endswith("/") for key in keys), keys  # pyarrow's folder markers only

    with pytest.raises(ConfigError) as missing:
        check_storage(config_from_dict(spec("s3://no-such-bucket-here/runs", store)))
    assert "bucket 'no-such-bucket-here' does not exist" in str(missing.value)
    assert "\n" not in str(missing.value)


def test_the_endpoint_may_come_from_the_environment_as_boto3_reads_it(
    store: dict[str, Any], bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`, which wins) names an S3-compatible
    store when the spec gives no `endpoint_override`; an explicit one wins over both; the
    workers get the variable in their runtime env."""
    from trainstack.runtime.cluster import worker_env

    endpoint = store["endpoint_override"]
    dead = "http://127.0.0.1:9"  # the discard port: nothing answers S3 there
    bare = config_from_dict(spec(f"s3://{bucket}/runs", {}))
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    check_storage(bare)  # without the variable: BUCKET.s3.us-east-1.amazonaws.com
    assert worker_env(bare)["AWS_ENDPOINT_URL"] == endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    with pytest.raises(ConfigError, match="cannot write there"):
        check_storage(bare)
    check_storage(config_from_dict(spec(f"s3://{bucket}/runs", store)))  # explicit option


@pytest.mark.parametrize(
    ("checkpoint", "says"),
    [
        ({"storage_path": "ftp://host/runs"}, "has an unknown scheme 'ftp'"),
        ({"storage_path": "s3://B/runs"}, "with a valid bucket name ('B')"),
        (
            {"storage_path": "s3://bkt/runs", "storage_options": {"endpoint": "x"}},
            "pyarrow refuses",
        ),
        (
            {"storage_path": "s3://bkt/runs", "storage_options": {"secret_key": "x"}},
            "storage_options.secret_key: credentials do not go in the spec",
        ),
        ({"storage_path": "runs", "storage_options": {"region": "x"}}, "needs an object store"),
        (
            {"storage_path": "hdfs://nn/runs", "storage_options": {"region": "x"}},
            "options apply to s3://, gs://, gcs:// storage only",
        ),
    ],
    ids=["scheme", "bucket", "option", "credentials", "local-path", "hdfs-options"],
)
def test_bad_object_store_settings_are_one_line(checkpoint: dict[str, Any], says: str) -> None:
    raw = spec("runs", {})
    raw["checkpoint"] = checkpoint
    with pytest.raises(ConfigError) as refused:
        config_from_dict(raw)
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_what_cannot_use_an_object_store_yet_is_refused_naming_the_alternative(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"strategy.kind=ps keeps its shard checkpoints"):
        config_from_dict(spec("s3://bkt/runs", {}, strategy={"kind": "ps"}, optim={"grad_clip": 0}))
    with pytest.raises(ConfigError, match="or train on Ray"):
        run_processes(config_from_dict(spec("s3://bkt/runs", {})), world_size=1, out_dir=tmp_path)


def test_a_stopped_store_is_one_line_never_a_corrupt_checkpoint(
    bucket: str, store: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, options = start_server()
    boto3.client("s3", endpoint_url=options["endpoint_override"]).create_bucket(Bucket=bucket)
    raw = spec(f"s3://{bucket}/runs", options)
    run = run_location(bucket, options)
    upload(run, tmp_path, step=5, raw=raw)
    server.stop()

    warnings: list[str] = []
    for on_corrupt in ("fail", "restart"):  # unreachable is not corrupt: never starts fresh
        with pytest.raises(ckpt.StorageUnreachableError) as down:
            ckpt.find_start(run, resume_from=None, on_corrupt=on_corrupt, warn=warnings.append)
        assert str(down.value).startswith(f"s3://{bucket}/runs/demo: the checkpoint store did")
        assert "\n" not in str(down.value)
    assert warnings == []
    with pytest.raises(ConfigError) as refused:
        check_storage(config_from_dict(raw))
    assert "cannot write there" in str(refused.value) and "\n" not in str(refused.value)
    flags = [arg for k, v in options.items() for arg in ("--storage-option", f"{k}={v}")]
    assert main(["export", str(run), "--out", str(tmp_path / "m.pt"), *flags]) == 2


def test_a_file_uri_is_a_local_path_and_a_store_runs_local_files_under_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = config_from_dict(spec(f"file://{tmp_path}/runs", {}))
    assert ckpt.checkpoints_for(local) == ckpt.run_dir_for(local) == tmp_path / "runs/demo"
    monkeypatch.chdir(tmp_path)
    remote = config_from_dict(spec("s3://bkt/runs", {"region": "us-east-1"}))
    assert ckpt.run_dir_for(remote) == tmp_path / ".cache/trainstack/runs/demo"
    assert str(ckpt.checkpoints_for(remote)) == "s3://bkt/runs/demo"
