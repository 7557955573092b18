"""`trainstack doctor` as a user runs it, in an environment inside trainstack's ranges
and in one whose Ray and DeepSpeed are not (their metadata shadowed by older releases',
which is what `importlib.metadata`, pip and pre-flight all read), and the same check in
pre-flight and in `trainstack submit`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainstack.stack
from trainstack.cli.app import main
from trainstack.cli.probe import job_client
from trainstack.cli.submit import dependency_env
from trainstack.config import ConfigError, config_from_dict
from trainstack.runtime.cluster import version_mismatch
from trainstack.runtime.stack_check import check_versions_here
from trainstack.stack import dependency

BIN = Path(sys.executable).parent


def _shadow(site: Path, name: str, version: str) -> None:
    """Metadata of `name` `version` in `site`, found before the installed release's."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _doctor(*, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [str(BIN / "trainstack"), "doctor"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_doctor_in_range_lists_every_library_and_exits_0(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for dep in ("torch", "ray", "deepspeed", "mlflow"):
        assert f"\n{dep} " in out
    assert dependency("ray").versions in out
    assert "gloo                    yes" in out
    assert "verdict: every library is inside trainstack's tested ranges" in out


def test_doctor_out_of_range_names_each_and_the_pip_command(tmp_path: Path) -> None:
    _shadow(tmp_path, "ray", "2.40.0")
    _shadow(tmp_path, "deepspeed", "0.99.0")
    done = _doctor(pythonpath=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {
        name: next(line for line in done.stdout.splitlines() if line.startswith(f"{name} "))
        for name in ("ray", "deepspeed", "torch")
    }
    assert "2.40.0" in rows["ray"] and "TOO OLD" in rows["ray"]
    assert "0.99.0" in rows["deepspeed"] and "UNTESTED" in rows["deepspeed"]
    assert "OLD" not in rows["torch"] and rows["torch"].endswith("ok")
    verdict = done.stdout.strip().splitlines()[-1]
    assert verdict.startswith("verdict: outside trainstack's ranges here; fix with: pip install")
    assert f"'{dependency('ray').requirement}'" in verdict
    assert f"'{dependency('deepspeed').requirement}'" in verdict


def test_doctor_says_in_one_line_when_the_cluster_cannot_be_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["doctor", "--address", "http://127.0.0.1:9"]) == 2  # nothing listens there
    done = capsys.readouterr()
    assert done.err.strip() == "trainstack: error: could not ask the cluster at http://127.0.0.1:9"
    assert "ray cluster at http://127.0.0.1:9: " in done.out


def test_preflight_refuses_a_library_older_than_the_floor_and_notes_a_newer_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = config_from_dict({"name": "x"})
    assert check_versions_here(cfg) is None  # this venv: all inside
    real = trainstack.stack.installed_version
    versions = {"ray": "2.40.0"}
    monkeypatch.setattr(
        trainstack.stack, "installed_version", lambda name: versions.get(name) or real(name)
    )
    with pytest.raises(ConfigError) as refused:
        check_versions_here(cfg)
    message = str(refused.value)
    assert message.startswith("this Python: ray 2.40.0 (trainstack needs ")
    assert "\n" not in message and "pip install" in message
    versions["ray"] = "2.99.0"  # newer than the tested top: a note, the run goes on
    note = check_versions_here(cfg)
    assert note is not None and "ray 2.99.0" in note and "newer than" in note


def test_a_jobs_dependencies_need_a_clusters_ray_inside_the_range() -> None:
    cfg = config_from_dict({"name": "x", "model": {"kind": "hf", "hf": {"model_type": "qwen2"}}})
    with pytest.raises(ConfigError, match=r"the cluster runs Ray 2\.40\.0; trainstack needs"):
        dependency_env("uv", ray_version="2.40.0", cfg=cfg)
    env = dependency_env("uv", ray_version="2.60.0", cfg=cfg)
    packages = env["uv"]["packages"]
    assert "ray[default,train,tune]==2.60.0" in packages
    assert dependency("transformers").requirement in packages  # an hf model's extra


def test_submit_without_deps_is_refused_in_one_line_before_anything_is_sent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["submit", "jobs/configs/demo.yaml", "--address", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainstack: error: trainstack submit needs --deps")


def test_a_cluster_of_another_ray_is_refused_in_one_line_naming_both() -> None:
    rays = (
        "Version mismatch: The cluster was started with:\n    Ray: 2.58.0\n    Python: 3.11.9\n"
        "This process on node 10.0.0.1 was started with:\n    Ray: 2.60.0\n    Python: 3.11.7\n"
    )
    line = version_mismatch("10.0.0.2:6379", rays)
    assert "\n" not in line
    assert line.startswith(
        "the cluster at 10.0.0.2:6379 runs Ray 2.58.0 on Python 3.11.9, this driver Ray 2.60.0 "
        "on Python 3.11.7"
    )
    assert "trainstack submit" in line


def test_the_job_client_asks_the_address_given_over_a_leftover_ray_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's client trades the address it is handed for `$RAY_ADDRESS`; trainstack's asks
    the one given (nothing listens on either port: the error names the one it tried) and
    leaves the environment as it was."""
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:9")
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:7\b"):
        job_client("http://127.0.0.1:7")
    assert os.environ["RAY_ADDRESS"] == "http://127.0.0.1:9"
