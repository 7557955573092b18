"""`trainstack.compat.ray` without a Ray instance: each private route on this
Ray, and its fallback on a Ray that lacks it (the module hidden from the import system,
or the name hidden from the module), still doing its job. Also that nothing else in the
package names a private Ray module, that each feature's release in the table is right
for this Ray, and the public routes that replaced private ones.

It runs on any supported Ray: a test of a private route this Ray does not have is
skipped (its fallback's test still runs). No Ray instance is started:
`ray.get_runtime_context()` would join one (another process's, if one runs on this
machine), so every test that needs it is given a stand-in.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
import ray.train
from packaging.version import Version
from ray.train.torch import TorchTrainer
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

from trainstack.compat import ray as ray_compat
from trainstack.config import ConfigError, config_from_dict
from trainstack.machine import local_cpus
from trainstack.runtime import cluster, launcher
from trainstack.runtime.capacity import (
    HEALTH_CHECK_INTERVAL_ENV,
    WORKER_GROUP_START_TIMEOUT_ENV,
    is_start_timeout,
)
from trainstack.runtime.events import FailureWatch, StartAttemptRecorder, controller_watches
from trainstack.runtime.preflight import check_ray_features
from trainstack.sweep.tuning import NODE_SHARE, trial_resources

CALLBACK = "ray.train.v2._internal.execution.callback"
DATASETS = "ray.train.v2._internal.callbacks.datasets"
CLEANER_CALLBACK = "ray.train.v2._internal.callbacks.placement_group_callback"
CLEANER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
EXCEPTIONS = "ray.train.v2._internal.exceptions"
CONSTANTS = "ray.train.v2._internal.constants"
CONTEXT = "ray.train.v2._internal.execution.context"
UTILS = "ray._private.utils"


def rays(module: str, name: str) -> Any:
    """Ray's own `module.name`; the test is skipped on a Ray without it."""
    found = getattr(pytest.importorskip(module), name, None)
    if found is None:
        pytest.skip(f"Ray {ray.__version__} has no {module}.{name}")
    return found


PACKAGE = Path(__file__).resolve().parents[2] / "platform" / "trainstack"


def hide_module(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """This Ray, as one without `module`: importing it fails, and its spec is None."""
    monkeypatch.setitem(sys.modules, module, None)


class FakeQueue:
    """Stands in for the run's `ray.util.queue.Queue`."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def put_nowait(self, record: dict[str, Any]) -> None:
        self.records.append(record)


def trainer_args(**extra: Any) -> dict[str, Any]:
    return {
        "train_loop_per_worker": lambda: None,
        "scaling_config": ray.train.ScalingConfig(num_workers=1),
        **extra,
    }


def callback_types(trainer: TorchTrainer) -> list[type]:
    return [type(c) for c in trainer._create_default_callbacks()]  # type: ignore[attr-defined]


# --- the rule: private Ray names live in compat alone --------------------------------


PRIVATE_RAY = re.compile(
    r"ray\._private|ray\._raylet|ray\._common|ray\.train\.v2\._internal|__internal_head__"
    r"|_create_default_callbacks|PlacementGroupCleaner"
)


def test_no_module_outside_compat_names_a_private_ray_module_or_hook() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if path.parent.name != "compat"
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if PRIVATE_RAY.search(line)
    ]
    assert offenders == []


def test_importing_the_compat_module_imports_no_ray() -> None:
    code = (
        "import sys, trainstack.compat.ray; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- start attempts ------------------------------------------------------------------


def test_start_attempts_reach_the_queue_through_the_controllers_hook_after_pickling() -> None:
    events = FakeQueue()
    controller_callback = rays(CALLBACK, "ControllerCallback")
    if not hasattr(controller_callback, "on_controller_start_worker_group"):
        pytest.skip(f"Ray {ray.__version__}'s controller has no start hook")
    recorder = StartAttemptRecorder(events)  # type: ignore[arg-type]
    callback = ray_compat.start_attempt_callback(recorder)
    assert isinstance(callback, controller_callback)
    # Ray sends the callback to the controller's process pickled (its class by value).
    in_controller = ray.cloudpickle.loads(ray.cloudpickle.dumps(callback))
    assert isinstance(in_controller, controller_callback)
    hook = in_controller.on_controller_start_worker_group
    assert hook(scaling_config=None, num_workers=3) is None  # no label selector
    hook(scaling_config=None, num_workers=2)
    records = in_controller.on_attempt.events.records  # the controller's copy of the queue
    assert [(r["event"], r["workers"]) for r in records] == [
        ("start_attempt", 3),
        ("start_attempt", 2),
    ]


def test_without_the_controllers_hook_the_run_has_no_start_attempt_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = FakeQueue()
    recorder = StartAttemptRecorder(events)  # type: ignore[arg-type]
    controller_callback = getattr(importlib.import_module(CALLBACK), "ControllerCallback", None)
    if hasattr(controller_callback, "on_controller_start_worker_group"):
        watches = controller_watches(events)  # type: ignore[arg-type]
        assert [type(w) for w in watches][:1] == [FailureWatch] and len(watches) == 2
        monkeypatch.delattr(controller_callback, "on_controller_start_worker_group")
        assert ray_compat.start_attempt_callback(recorder) is None
        monkeypatch.undo()
    hide_module(monkeypatch, CALLBACK)
    assert ray_compat.start_attempt_callback(recorder) is None
    assert [type(w) for w in controller_watches(events)] == [FailureWatch]  # type: ignore[arg-type]


# --- the trainer's helper actors -----------------------------------------------------


def test_a_run_without_datasets_starts_no_dataset_manager_and_embedded_no_cleaner() -> None:
    datasets_callback = rays(DATASETS, "DatasetsCallback")
    rays_cleaner = rays(CLEANER_CALLBACK, "PlacementGroupCleanerCallback")
    embedded = callback_types(ray_compat.torch_trainer(embedded=True, **trainer_args()))
    assert not any(issubclass(t, (datasets_callback, rays_cleaner)) for t in embedded)
    on_cluster = callback_types(ray_compat.torch_trainer(embedded=False, **trainer_args()))
    cleaners = [t for t in on_cluster if issubclass(t, rays_cleaner)]
    assert [t.__name__ for t in cleaners] == ["OwnInstanceCleanerCallback"]
    streams = ray_compat.torch_trainer(embedded=True, **trainer_args(datasets={"train": list}))
    assert datasets_callback in callback_types(streams)


def test_without_the_default_callbacks_hook_the_trainer_is_rays_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(DataParallelTrainer, "_create_default_callbacks")
    trainer = ray_compat.torch_trainer(embedded=True, **trainer_args())
    assert type(trainer) is TorchTrainer


def test_without_the_cleaner_or_datasets_module_rays_callbacks_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    datasets_callback = rays(DATASETS, "DatasetsCallback")
    rays_cleaner = rays(CLEANER_CALLBACK, "PlacementGroupCleanerCallback")
    hide_module(monkeypatch, CLEANER)
    assert ray_compat.own_instance_cleaner_class() is None
    types = callback_types(ray_compat.torch_trainer(embedded=False, **trainer_args()))
    assert rays_cleaner in types
    monkeypatch.undo()
    hide_module(monkeypatch, DATASETS)
    types = callback_types(ray_compat.torch_trainer(embedded=True, **trainer_args()))
    assert datasets_callback in types  # not known to be Ray's data hand-off here: it stays


def test_the_callback_starts_the_own_instance_cleaner_and_gives_ray_back_its_global(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rays_cleaner = rays(CLEANER, "PlacementGroupCleaner")
    module = importlib.import_module(CLEANER_CALLBACK)
    built: list[type] = []

    def rays_start(self: Any, train_run_context: Any) -> None:  # what Ray's would build
        built.append(module.PlacementGroupCleaner)

    monkeypatch.setattr(module.PlacementGroupCleanerCallback, "after_controller_start", rays_start)
    callback_class = ray_compat._own_instance_cleaner_callback_class()
    assert callback_class is not None
    callback_class().after_controller_start(None)
    assert built[0].__name__ == "OwnInstanceCleaner" and issubclass(built[0], rays_cleaner)
    assert module.PlacementGroupCleaner is rays_cleaner  # Ray's own again after the call


def test_the_own_instance_cleaner_asks_its_own_instance_unless_the_environment_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rays(CLEANER, "PlacementGroupCleaner")
    cleaner_class = ray_compat.own_instance_cleaner_class()
    assert cleaner_class is not None
    context = SimpleNamespace(gcs_address="10.0.0.7:6379")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    kwargs: dict[str, Any] = {
        "controller_actor_id": "c0",
        "check_interval_s": 1.0,
        "get_actor_timeout_s": 1.0,
        "stop_timeout": None,
    }
    cleaner_class(**kwargs)
    assert os.environ["RAY_ADDRESS"] == "10.0.0.7:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.8:6379")
    cleaner_class(**kwargs)
    assert os.environ["RAY_ADDRESS"] == "10.0.0.8:6379"


# --- errors, logs, CPUs --------------------------------------------------------------


def test_a_start_timeout_is_told_from_other_controller_failures_with_or_without_its_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timeout_error = rays(EXCEPTIONS, "WorkerGroupStartupTimeoutError")
    timed_out = ray.train.ControllerError(timeout_error(num_workers=8))
    other = ray.train.ControllerError(RuntimeError("controller died"))
    assert is_start_timeout(timed_out) and not is_start_timeout(other)
    assert not is_start_timeout(ValueError("no controller_failure at all"))
    hide_module(monkeypatch, EXCEPTIONS)

    # another Ray's error, known by its type's name alone
    renamed = type("WorkerGroupStartupTimeoutError", (RuntimeError,), {})
    assert is_start_timeout(ray.train.ControllerError(renamed("no room")))
    assert not is_start_timeout(other)


def test_report_lines_are_quieted_where_rays_module_is_and_left_alone_where_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    context = pytest.importorskip(CONTEXT)
    by_file = logging.getLogger(context.__file__)
    monkeypatch.setattr(by_file, "level", logging.NOTSET)
    assert ray_compat.quiet_train_report_logs()
    assert by_file.level == logging.WARNING
    monkeypatch.setattr(by_file, "level", logging.NOTSET)
    hide_module(monkeypatch, CONTEXT)
    assert not ray_compat.quiet_train_report_logs()
    assert by_file.level == logging.NOTSET


def test_local_cpus_are_rays_count_or_without_it_the_cpus_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    get_num_cpus = rays(UTILS, "get_num_cpus")
    assert local_cpus() == float(get_num_cpus())
    hide_module(monkeypatch, UTILS)
    assert local_cpus() == float(len(os.sched_getaffinity(0)))


# --- which features this Ray has -----------------------------------------------------


def test_this_ray_has_exactly_the_features_whose_release_it_has_reached() -> None:
    """The table's releases (found in each release's source) hold for the installed Ray:
    on 2.60 every feature is there; on 2.51 and 2.52 the four from 2.54 on are not."""
    features = ray_compat.features()
    assert len({f.name for f in features}) == len(features)
    installed = Version(ray.__version__).release[:2]
    for feature in features:
        assert re.fullmatch(r"2\.\d+", feature.since) and feature.fallback and feature.uses
        since = Version(feature.since).release[:2]
        assert feature.available == (installed >= since), feature.name


def test_the_controller_settings_trainstack_names_are_the_ones_ray_train_reads() -> None:
    assert rays(CONSTANTS, "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR") == WORKER_GROUP_START_TIMEOUT_ENV
    assert rays(CONSTANTS, "HEALTH_CHECK_INTERVAL_S_ENV_VAR") == HEALTH_CHECK_INTERVAL_ENV
    propagated = rays(CONSTANTS, "ENV_VARS_TO_PROPAGATE")  # driver -> controller
    assert {WORKER_GROUP_START_TIMEOUT_ENV, HEALTH_CHECK_INTERVAL_ENV} <= propagated


def test_elastic_groups_on_a_ray_without_them_are_refused_in_one_line_naming_the_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = config_from_dict(
        {"train": {"global_batch_size": 24}, "scaling": {"num_workers": {"min": 2, "max": 4}}}
    )
    if ray_compat.has_elastic_scaling():
        check_ray_features(cfg)  # this Ray has them
        assert ray_compat.missing_ray_feature("elastic_scaling", setting="s", value=1) is None

    class OldScalingConfig:  # Ray 2.54's: no elastic arguments
        def __init__(self, *, num_workers: int = 1, use_gpu: bool = False) -> None: ...

    monkeypatch.setattr(ray.train, "ScalingConfig", OldScalingConfig)
    with pytest.raises(ConfigError) as refused:
        check_ray_features(cfg)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("scaling.min_workers=2 needs Ray >= 2.55 (")
    assert f"this environment has Ray {ray.__version__}: install ray>=2.55" in message
    check_ray_features(config_from_dict({"scaling": {"num_workers": 4}}))  # fixed size: fine
    assert not next(f for f in ray_compat.features() if f.name == "elastic_scaling").available


def test_without_train_logging_config_the_run_keeps_ray_trains_default_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if hasattr(ray.train, "LoggingConfig"):  # Ray 2.56 on
        assert launcher._quiet_driver_logs()["logging_config"].log_level == "WARNING"
        monkeypatch.delattr(ray.train, "LoggingConfig")
    assert launcher._quiet_driver_logs() == {}


# --- the public routes that replaced private ones ------------------------------------


@pytest.mark.parametrize(
    ("url", "auth", "line"),
    [
        ("127.0.0.1:8265", "", "Ray dashboard: http://127.0.0.1:8265"),
        (
            "127.0.0.1:8265",
            "token",
            "Ray dashboard: http://127.0.0.1:8265 (it asks for the cluster's token: "
            "paste what `ray get-auth-token` prints)",
        ),
        ("", "token", "Ray dashboard: not started by this Ray"),
    ],
)
def test_the_dashboard_line_comes_from_the_context_ray_init_returns(
    monkeypatch: pytest.MonkeyPatch, url: str, auth: str, line: str
) -> None:
    asked: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> Any:
        asked.append(kwargs)
        return SimpleNamespace(dashboard_url=url)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setenv("RAY_AUTH_MODE", auth)
    assert cluster.dashboard_line() == line
    assert asked == [{"ignore_reinit_error": True}]  # the running instance's, nothing started


def test_a_trial_driver_reserves_a_sliver_of_the_sweep_drivers_own_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nodes = [
        {"NodeID": "aa", "NodeManagerAddress": "10.0.0.2", "Resources": {"node:10.0.0.2": 1.0}},
        {"NodeID": "bb", "NodeManagerAddress": "10.0.0.3", "Resources": {"node:10.0.0.3": 1.0}},
    ]
    context = SimpleNamespace(get_node_id=lambda: "bb")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert cluster.this_node_resource() == "node:10.0.0.3"
    assert trial_resources(cluster.this_node_resource()) == {"CPU": 0, "node:10.0.0.3": NODE_SHARE}
