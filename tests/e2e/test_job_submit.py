"""`trainstack submit` and `ray job submit` of jobs/train.py and tune/sweep.py against a
`ray start --head` cluster on 127.0.0.1 with token authentication (one cluster for the
module); and, beside that cluster, a run's placement-group cleaner on an instance of its
own."""

import contextlib
import csv
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow
import psutil
import pytest
import ray
import torch
import yaml
from ray.job_submission import JobStatus, JobSubmissionClient
from ray.util.placement_group import placement_group, placement_group_table

from trainstack import checkpoint as ckpt
from trainstack.cli.probe import job_client
from trainstack.compat.ray import own_instance_cleaner_class
from trainstack.config import config_to_dict, load_config
from trainstack.runtime.gloo_processes import run_processes

from bounds import assert_trained, max_difference
from user_shell import BIN, ROOT, run, user_env

pytestmark = pytest.mark.slow

STARTED = "This command will now block forever until terminated by a signal."
"""The line `ray start --block` prints once its node is up."""


@dataclass(frozen=True)
class HeadNode:
    address: str
    """The job API (and dashboard) address, as Ray reported it."""
    session: Path
    """The Ray session directory of this cluster (`session_<date>_<time>_<pid>`)."""


@pytest.fixture(scope="module")
def auth() -> dict[str, str]:
    """Token authentication, as a secured cluster runs: every command carries the token."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture(scope="module")
def head_node(auth: dict[str, str]) -> Iterator[HeadNode]:
    """A one-node Ray cluster on loopback, every port but the dashboard agent's (see
    `free_port`) chosen by Ray (0: "allocate an available port"). `ray start --block` runs
    in its own process group and a temporary directory of its own (so no other Ray on this
    machine finds it, nor it theirs); ending that process stops the node, and nothing of it
    may be left."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's sockets live here
    log_path = temp_dir / "ray-start.log"
    with log_path.open("w") as log:
        head = subprocess.Popen(
            [
                *(str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1"),
                *("--port=0", "--dashboard-host=127.0.0.1", "--dashboard-port=0"),
                f"--dashboard-agent-listen-port={free_port()}",
                *("--num-cpus=2", "--disable-usage-stats"),
                f"--temp-dir={temp_dir}",
            ],
            cwd=ROOT,
            # a user's package must reach the workers through --working-dir; nothing to
            # drain on SIGTERM (no Serve), so the node stops at once
            env=user_env(PYTHONPATH="", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", **auth),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        output = started_output(head, log_path)
        address = re.search(r"RAY_API_SERVER_ADDRESS='(http://[^']+)'", output)
        assert address, output[-3000:]
        session = (temp_dir / "session_latest").resolve()  # every Ray release links it
        assert session.name.endswith(f"_{head.pid}"), session  # started by this process
        yield HeadNode(address=address[1], session=session)
    finally:
        stop_head(head, temp_dir)


def free_port() -> int:
    """A port free on loopback now. The dashboard agent's port is chosen so, not left to
    Ray (0): Ray 2.51's job API cannot reach an agent that picked its own port (a job's
    log ends at once, unread), and the default port is taken by any other Ray here."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def started_output(head: subprocess.Popen[bytes], log_path: Path) -> str:
    """`ray start`'s output once its node is up (ANSI colours removed)."""

    def output() -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text())

    while STARTED not in output() and head.poll() is None:
        time.sleep(0.2)
    assert STARTED in output(), f"ray start exited with {head.returncode}:\n{output()[-3000:]}"
    return output()


def stop_head(head: subprocess.Popen[bytes], temp_dir: Path) -> None:
    """End `ray start --block`, which stops its node's processes (GCS, raylet, dashboard,
    ...) and waits for them: none naming the cluster's directory may be left. Then end
    its process group: the workers and helpers they started, on their way out."""
    head.terminate()
    head.wait()
    left = [
        process.info["cmdline"]
        for process in psutil.process_iter(["cmdline"])
        if any(str(temp_dir) in arg for arg in process.info["cmdline"] or ())
    ]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"left running after `ray start --block` ended: {left}"


def job_api(head_node: HeadNode, auth: dict[str, str]) -> JobSubmissionClient:
    """The cluster's Job API as a user's script reaches it, with the cluster's token: at
    the address given, which Ray's client would trade for a `RAY_ADDRESS` an earlier test's
    Ray left in this process (trainstack's `job_client` keeps it)."""
    token = {"Authorization": f"Bearer {auth['RAY_AUTH_TOKEN']}"}
    return job_client(head_node.address, headers=token)


def until(condition: Callable[[], object]) -> None:
    """Poll `condition` until it holds (the test's timeout is the hang guard)."""
    while not condition():
        time.sleep(1)


DEMO_STEPS = 30


@pytest.mark.timeout(420)
def test_trainstack_submit_trains_the_demo_under_its_name_as_gloo_processes_do(
    head_node: HeadNode, auth: dict[str, str], tmp_path: Path
) -> None:
    """`trainstack submit` runs what `ray job submit ... python jobs/train.py` runs, as a
    job the dashboard lists by the spec's name and strategy, and trains exactly what the
    same spec trains on 2 local gloo processes."""
    summary_path = tmp_path / "summary.json"
    sets = [f"train.steps={DEMO_STEPS}", f"checkpoint.storage_path={tmp_path / 'runs'}"]
    proc = run(
        [
            *(str(BIN / "trainstack"), "submit", "jobs/configs/demo.yaml", "--deps", "image"),
            *("--address", head_node.address, "--set", sets[0], "--set", sets[1]),
            *("--summary-json", str(summary_path)),
        ],
        **auth,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = re.search(r"submitted (trainstack-demo-ddp-[0-9a-f]{8}) to ", proc.stdout)
    assert job is not None, proc.stdout[-2000:]
    assert f"trainstack: job {job[1]} succeeded" in proc.stdout
    assert f"step {DEMO_STEPS}/{DEMO_STEPS}" in proc.stdout
    # The job's log says where to watch it and how to get past the token login.
    dashboard = head_node.address.removesuffix("/")
    assert f"trainstack: Ray dashboard: {dashboard} (it asks for the cluster's token" in proc.stdout
    assert "`ray get-auth-token`" in proc.stdout
    metadata = job_api(head_node, auth).get_job_info(job[1]).metadata
    assert metadata["trainstack.name"] == "demo" and metadata["trainstack.strategy"] == "ddp"
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == DEMO_STEPS and summary["world_size"] == 2
    # Thirty steps end on the demo's plateau (3.428; ln 32 = 3.466, a context-blind model
    # 3.464), where no loss bound tells a broken run from a right one; equality does: Ray's
    # worker group and gloo processes run the same math, bit for bit (as in
    # tests/cluster/test_node_failure.py).
    reference_dir = tmp_path / "reference"
    spec = load_config(
        str(ROOT / "jobs/configs/demo.yaml"),
        [sets[0], f"checkpoint.storage_path={reference_dir / 'runs'}"],
    )
    reference = run_processes(spec, world_size=2, out_dir=reference_dir)
    expected = torch.load(reference_dir / "model.pt", weights_only=True)
    weights = ckpt.verify(Path(summary["final_checkpoint"])).load("model.pt")
    assert_trained(weights, config_to_dict(spec))
    assert max_difference(weights, expected) == 0.0
    assert summary["final_loss"] == reference["final_loss"]


@pytest.mark.timeout(420)
def test_job_submit_runs_a_sweep_whose_failed_trial_is_retried(
    head_node: HeadNode, auth: dict[str, str], tmp_path: Path
) -> None:
    """The trial's run fails once for good (a worker killed, no restarts allowed in the
    job spec); the sweep's failure policy retries the trial, which then finishes."""
    base = {
        "name": "submitted",
        "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
        "data": {"vocab_size": 16, "order": 1, "eval_samples": 32},
        "train": {"steps": 12, "global_batch_size": 16, "micro_batch_size": 8},
        "optim": {"warmup_steps": 2, "grad_clip": 0.0},
        "strategy": {"kind": "ps", "num_shards": 1},
        "compression": {"ratio": 0.05, "min_numel": 0},
        "scaling": {"num_workers": 1},
        "log": {"every_steps": 4},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
        "failure": {"max_failures": 0},
        "faults": {"kill_at_steps": [6], "rank": 0},  # fires once per run directory
        "tracking": {"backend": "mlflow", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    (tmp_path / "base.yaml").write_text(json.dumps(base))
    sweep = {
        "name": "submitted-sweep",
        "base": "base.yaml",
        "space": {"compression.kind": ["topk"]},
        "search": {"algorithm": "grid"},
        "scheduler": {"kind": "fifo"},
        "failure": {"max_failures": 1},
    }
    (tmp_path / "sweep.yaml").write_text(json.dumps(sweep))
    proc = run(
        [
            *(str(BIN / "ray"), "job", "submit", "--address", head_node.address),
            *("--working-dir", ".", "--", "python", "tune/sweep.py", str(tmp_path / "sweep.yaml")),
            *("--storage-path", str(tmp_path / "sweeps")),
        ],
        **auth,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "failed; retrying" in proc.stdout
    results = tmp_path / "sweeps" / "submitted-sweep"
    rows = list(csv.DictReader((results / "results.csv").open()))
    assert [r["compression.kind"] for r in rows] == ["topk"]
    assert rows[0]["status"] == "completed" and rows[0]["step"] == "12"
    assert (results / "best.yaml").exists()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    trial_runs = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(runs) == 2 and len(trial_runs) == 1  # the retry continued the trial's run
    assert trial_runs[0].info.status == "FINISHED"
    assert trial_runs[0].data.tags["trainstack.resumed_count"] == "1"


@pytest.mark.timeout(420)
def test_job_submit_ships_a_users_own_model_package_with_working_dir(
    head_node: HeadNode, auth: dict[str, str], tmp_path: Path
) -> None:
    """A user's project: their package and spec in one directory, submitted with
    --working-dir; nothing of it is on the cluster's PYTHONPATH."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "examples" / "user_models", project / "acme_models")
    spec = {
        "name": "acme-cnn",
        "model": {"kind": "custom", "target": "acme_models.cnn:build", "args": {"width": 8}},
        "task": {"kind": "classify"},
        "data": {"kind": "clusters", "num_classes": 10, "eval_samples": 256},
        "train": {"steps": 60, "global_batch_size": 64, "micro_batch_size": 32},
        "scaling": {"num_workers": 1},  # the package reaches a worker process: the point
        "optim": {"lr": 3e-3, "warmup_steps": 5},
        "log": {"every_steps": 20},
        "checkpoint": {"storage_path": str(tmp_path / "runs")},
    }
    (project / "cnn.yaml").write_text(json.dumps(spec))
    summary_path = tmp_path / "summary.json"
    proc = run(
        [
            *(str(BIN / "ray"), "job", "submit", "--address", head_node.address),
            *("--working-dir", str(project), "--"),
            *("trainstack", "run", "cnn.yaml", "--progress", "lines"),
            *("--summary-json", str(summary_path)),
        ],
        PYTHONPATH="",
        **auth,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 60/60" in proc.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["task"] == "classify" and summary["world_size"] == 1
    # Chance is 10% on 10 classes, the Bayes accuracy 98%; measured after these 60 steps
    # (the run is seeded): 96.1%.
    assert summary["eval_accuracy"] > 0.9


@pytest.mark.timeout(480)
def test_the_dashboard_shows_the_job_by_name_its_progress_and_its_actors(
    head_node: HeadNode, auth: dict[str, str], tmp_path: Path
) -> None:
    """What a user sees in a browser: headless Chromium gets past Ray's token dialog with
    the cluster's token, finds a parameter-server job on the Jobs page under its name,
    reads trainstack's progress lines on its page, and finds the run's shards and worker
    by name on the Actors page. Screenshots go to .cache/screenshots/."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (make test installs it)")
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        pytest.skip("no chromium/chromedriver (Debian's chromium, chromium-driver; make browser)")
    steps = 40
    proc = run(
        [
            *(str(BIN / "trainstack"), "submit", "jobs/configs/ps.yaml", "--deps", "image"),
            *("--address", head_node.address, "--no-wait"),
            *("--set", f"train.steps={steps}", "--set", "scaling.num_workers=1"),
            *("--set", f"checkpoint.storage_path={tmp_path / 'runs'}"),
        ],
        **auth,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = re.search(r"submitted (trainstack-ps-demo-ps-[0-9a-f]{8}) to ", proc.stdout)
    assert found is not None, proc.stdout[-2000:]
    job = found[1]
    shots = ROOT / ".cache" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1000")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    page = webdriver.Chrome(service=Service(driver), options=options)
    try:

        def shows(*texts: str) -> bool:
            # what the page shows (the log viewer renders spaces as no-break ones)
            shown = page.execute_script("return document.body.innerText").replace("\xa0", " ")
            return all(text in shown for text in texts)

        def shows_after_reloads(*texts: str) -> bool:
            """For a page that reads what it shows once per load: 5 s, then a reload."""
            for _ in range(5):
                if shows(*texts):
                    return True
                time.sleep(1)
            page.refresh()
            return False

        page.get(head_node.address)
        token_box = "input[placeholder='Enter your authentication token']"
        until(lambda: page.find_elements(By.CSS_SELECTOR, token_box))
        page.save_screenshot(str(shots / "dashboard_token.png"))
        page.find_element(By.CSS_SELECTOR, token_box).send_keys(auth["RAY_AUTH_TOKEN"])
        page.find_element(By.XPATH, "//button[normalize-space()='Submit']").click()

        def filter_by(label: str, text: str) -> None:
            """Type into one of a table's filters (the tables show 10 rows a page)."""
            box = f"//label[normalize-space()='{label}']"
            until(lambda: page.find_elements(By.XPATH, box))
            for_id = page.find_element(By.XPATH, box).get_attribute("for")
            page.find_element(By.ID, for_id).send_keys(text)

        page.get(f"{head_node.address}/#/jobs")
        filter_by("Submission ID", job)
        until(lambda: shows(job))
        name_cell = "//td[normalize-space()='ps-demo']"  # the spec's name, in the Name column
        until(lambda: page.find_elements(By.XPATH, name_cell))
        page.save_screenshot(str(shots / "dashboard_jobs.png"))

        page.get(f"{head_node.address}/#/jobs/{job}")
        until(lambda: shows_after_reloads(f"step {steps}/{steps}", "trainstack: Ray dashboard:"))
        page.execute_script("window.scrollBy(0, 640)")  # the driver's log, below the summary
        page.save_screenshot(str(shots / "dashboard_job_log.png"))

        page.get(f"{head_node.address}/#/actors")
        filter_by("Name", "trainstack-ps-ps-demo-")
        until(
            lambda: shows("trainstack-ps-ps-demo-", "-shard-0", "-worker-0", "ParameterServerShard")
        )
        page.save_screenshot(str(shots / "dashboard_actors.png"))
    finally:
        page.quit()
    client = job_api(head_node, auth)
    until(lambda: client.get_job_status(job).is_terminal())  # not into the next test
    assert client.get_job_status(job) == JobStatus.SUCCEEDED, client.get_job_logs(job)[-2000:]


@pytest.mark.timeout(180)
def test_a_runs_placement_group_cleaner_asks_its_own_instance_with_another_on_the_machine(
    head_node: HeadNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With another Ray instance on the machine (the module's cluster), the cleaner
    trainstack's trainer starts keeps the run's placement group while the controller
    lives and removes it once the controller is gone. Ray's own cleaner asks the state API
    of "the" instance on the machine: it finds two here and stops watching (with a `ray
    start` cluster's address file it asks that cluster, which knows no such controller),
    so a sweep's trial that ASHA stopped kept its group, and the next trial waited for
    CPUs that never came back."""
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):  # the state API found on its own
        monkeypatch.delenv(name, raising=False)
    if ray.is_initialized():  # another module's instance
        ray.shutdown()
    ray.init(address="local", num_cpus=1, log_to_driver=False)  # with the state API

    class Controller:  # stands in for the run's Train controller (sent by value)
        def ready(self) -> bool:
            return True

    own_instance_cleaner = own_instance_cleaner_class()
    assert own_instance_cleaner is not None  # this Ray has a cleaner (2.54 on)
    try:
        controller = ray.remote(num_cpus=0)(Controller).remote()
        assert ray.get(controller.ready.remote())
        group = placement_group([{"CPU": 1}])
        ray.get(group.ready())
        cleaner = (
            ray.remote(num_cpus=0)(own_instance_cleaner)
            .options(lifetime="detached")
            .remote(
                controller_actor_id=controller._actor_id.hex(),
                check_interval_s=0.5,
                get_actor_timeout_s=10,
                stop_timeout=None,
            )
        )
        ray.get(cleaner.register_placement_group.remote(group))
        ray.get(cleaner.start_monitoring.remote())
        time.sleep(3)  # six questions at least, each answered "alive"
        assert placement_group_table(group)["state"] == "CREATED"
        ray.kill(controller)
        until(lambda: placement_group_table(group)["state"] == "REMOVED")
    finally:
        ray.shutdown()


@pytest.mark.timeout(180)  # the module's cluster stops after it
def test_grafana_provisioning_of_the_head_nodes_session_loads_trainstacks_dashboard(
    head_node: HeadNode,
) -> None:
    """`make grafana` (dashboards/provision.py) puts the dashboard in the folder the Ray
    session's Grafana provider reads. Grafana itself cannot be downloaded here: the
    provider file Ray wrote is read as Grafana would read it."""
    session = head_node.session
    provision = [str(BIN / "python"), "dashboards/provision.py", "--session-dir"]
    proc = run([*provision, str(session)])
    assert proc.returncode == 0, proc.stderr
    provider_file = session / "metrics/grafana/provisioning/dashboards/default.yml"
    provider = yaml.safe_load(provider_file.read_text())["providers"][0]
    assert provider["type"] == "file"
    copied = Path(provider["options"]["path"]) / "grafana_trainstack.json"
    assert copied.is_relative_to(session)
    shipped = json.loads((ROOT / "dashboards/grafana_trainstack.json").read_text())
    assert json.loads(copied.read_text()) == shipped
    nowhere = run([*provision, "/nonexistent"])
    assert nowhere.returncode == 2 and len(nowhere.stderr.strip().splitlines()) == 1
