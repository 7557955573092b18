"""Every Ray name trainstack uses from outside Ray's public API, and the public ones newer
than the oldest Ray trainstack supports.

Each private name is imported when a function here is called, never when this module
is, and only after a feature check (`_private`: the module is there and has the name).
Where the installed Ray lacks it, the function falls back to something that works on
every supported release, slower or less informative:

- `start_attempt_callback`: an event each time the Train controller starts the worker
  group (its `ControllerCallback` hook); without it, no `start_attempt` events (the
  run starts, retries and times out the same).
- `torch_trainer`: a `TorchTrainer` without the helper actors a run has no use for
  (its `_create_default_callbacks`); without it, Ray's own trainer: a dataset-manager
  actor at each worker-group start and Ray's own placement-group cleaner.
- `own_instance_cleaner_class`: Ray Train's placement-group cleaner asking its own
  instance; without it, Ray's cleaner (or none, on a Ray that has none).
- `is_worker_group_start_timeout`: Ray Train's start-timeout error by its type;
  without it, by its type's name.
- `quiet_train_report_logs`: Ray Train's INFO line per `report()`, silenced; without
  it, the line stays in the workers' logs.
- `embedded_ray_cpus`: the CPUs `ray.init` gives a local instance (the cgroup quota in
  a container); without it, the CPUs this process may use.

`RAY_FEATURES` lists these and the public features newer than the oldest Ray release
trainstack supports (`trainstack.stack` holds the range; 2.51 is the oldest that runs
it: Train V2 on by default, `FailureConfig(controller_failure_limit=...)`,
`ray.train.ControllerError`), each with the release that brought it, what trainstack does
without it, and whether the installed Ray has it (`features()`, which `trainstack
doctor` prints); `missing_ray_feature` is pre-flight's one line refusing a feature the
installed Ray cannot give, naming the release it needs.

This is the lowest layer: it imports nothing from trainstack.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.train.torch import TorchTrainer

_CALLBACK = "ray.train.v2._internal.execution.callback"
_DATASETS_CALLBACK = "ray.train.v2._internal.callbacks.datasets"
_CLEANER_CALLBACK = "ray.train.v2._internal.callbacks.placement_group_callback"
_CLEANER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
_EXCEPTIONS = "ray.train.v2._internal.exceptions"
_TRAIN_CONTEXT = "ray.train.v2._internal.execution.context"
_RAY_UTILS = "ray._private.utils"


def _find_spec(module: str) -> ModuleSpec | None:
    """`module`'s spec without importing it, or None when this Ray has no such module
    (nor its parent package)."""
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package missing, or a stub without spec
        return None


def _private(module: str, name: str) -> Any | None:
    """`module.name` when this Ray has it (imported now), else None."""
    if _find_spec(module) is None:
        return None
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:  # there, but its own imports fail on this Ray
        return None


# --- start attempts -----------------------------------------------------------------


def start_attempt_callback(on_attempt: Callable[[int], None]) -> Any | None:
    """A Train controller callback that calls `on_attempt(workers)` each time the
    controller starts the worker group (the first start, a restart after a failure, a
    retry of a start that found no room), for `RunConfig(callbacks=...)`; None on a Ray
    whose controller has no such hook.

    `on_attempt` runs in the controller's process: it must pickle, and must not raise.
    """
    base = _private(_CALLBACK, "ControllerCallback")
    if base is None or not hasattr(base, "on_controller_start_worker_group"):
        return None

    class StartAttemptCallback(base):  # type: ignore[misc, valid-type]
        def __init__(self, on_attempt: Callable[[int], None]) -> None:
            self.on_attempt = on_attempt

        def on_controller_start_worker_group(
            self, *, scaling_config: Any, num_workers: int
        ) -> dict[str, str] | None:
            self.on_attempt(num_workers)
            return None  # no label selector: the group is placed as the scaling config says

    return StartAttemptCallback(on_attempt)


# --- the trainer and its helper actors ----------------------------------------------


def torch_trainer(*, embedded: bool, **trainer_args: Any) -> TorchTrainer:
    """Ray Train's `TorchTrainer(**trainer_args)`, less the helper actors the run has no
    use for, where this Ray lets them be left out (its `_create_default_callbacks`):

    - Its Ray Data hand-off, when the run streams no `datasets`. Train V2 starts a
      dataset-manager actor at every worker-group start, datasets or not (a process that
      imports Ray Data: about 1.5 s of CPU), and hands each worker Ray Data's context.
    - Its placement-group cleaner: none on an `embedded` instance (one this run started
      and shuts down when the fit returns: the group ends with it), elsewhere one that
      asks its own instance (`own_instance_cleaner_class`).

    On a Ray without the hook: `TorchTrainer` as Ray builds it (both helpers, and Ray's
    own cleaner).
    """
    from ray.train.torch import TorchTrainer

    if not hasattr(TorchTrainer, "_create_default_callbacks"):
        return TorchTrainer(**trainer_args)
    datasets_callback = _private(_DATASETS_CALLBACK, "DatasetsCallback")
    cleaner_callback = _private(_CLEANER_CALLBACK, "PlacementGroupCleanerCallback")
    own_cleaner_callback = None if embedded else _own_instance_cleaner_callback_class()
    streams = bool(trainer_args.get("datasets"))

    def wanted(callback: Any) -> Any | None:
        """The callback to keep in `callback`'s place, or None to leave it out."""
        if datasets_callback is not None and isinstance(callback, datasets_callback):
            return callback if streams else None
        if cleaner_callback is not None and isinstance(callback, cleaner_callback):
            if embedded:
                return None
            return own_cleaner_callback() if own_cleaner_callback is not None else callback
        return callback

    class LeanTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            made = super()._create_default_callbacks()  # type: ignore[misc]
            return [kept for kept in map(wanted, made) if kept is not None]

    return LeanTorchTrainer(**trainer_args)


def own_instance_cleaner_class() -> type | None:
    """Ray Train's placement-group cleaner actor class, asking its own Ray instance
    whether the run's controller lives; None on a Ray without that cleaner.

    The cleaner is a detached actor that removes a worker group's placement group once
    the run's controller is gone: a sweep's trial stopped early by ASHA takes its
    controller with it, and the group stays. Ray's asks the state API with no address,
    which finds "the" Ray instance on the machine: with a `ray start` cluster there too,
    that cluster (which knows no such controller: the cleaner ends at once, before any
    group is registered), or with several, an error that ends its watch. Either way a
    stopped trial's group was never removed: beside a `ray start` cluster, the demo
    sweep's next trial waited for its CPUs until the sweep was killed minutes later.
    Given its own instance's address (`RAY_ADDRESS`, from the public runtime context),
    the answer is about its own controller. A state-API address the environment names
    (`RAY_API_SERVER_ADDRESS`) still wins.
    """
    base = _private(_CLEANER, "PlacementGroupCleaner")
    if base is None:
        return None

    class OwnInstanceCleaner(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            import ray

            os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
            super().__init__(*args, **kwargs)

    return OwnInstanceCleaner


def _own_instance_cleaner_callback_class() -> type | None:
    """Ray Train's callback that starts the cleaner, starting `OwnInstanceCleaner`; None
    on a Ray whose callback does not build the cleaner from its module's global."""
    callback = _private(_CLEANER_CALLBACK, "PlacementGroupCleanerCallback")
    cleaner = own_instance_cleaner_class()
    if callback is None or cleaner is None:
        return None
    module: Any = importlib.import_module(_CLEANER_CALLBACK)
    if not hasattr(module, "PlacementGroupCleaner"):
        return None

    class OwnInstanceCleanerCallback(callback):  # type: ignore[misc, valid-type]
        def after_controller_start(self, train_run_context: Any) -> None:
            # Ray's callback builds the actor from its module's global, in the controller's
            # process (its own for each run): that global is ours for this call only.
            rays = module.PlacementGroupCleaner
            module.PlacementGroupCleaner = cleaner
            try:
                super().after_controller_start(train_run_context)
            finally:
                module.PlacementGroupCleaner = rays

    return OwnInstanceCleanerCallback


# --- errors, logs, CPUs -------------------------------------------------------------


def is_worker_group_start_timeout(failure: BaseException | None) -> bool:
    """Whether `failure` (a `ray.train.ControllerError`'s `controller_failure`) is Ray
    Train giving up because the worker group found no room in time."""
    if failure is None:
        return False
    error_type = _private(_EXCEPTIONS, "WorkerGroupStartupTimeoutError")
    if error_type is not None:
        return isinstance(failure, error_type)
    return any(cls.__name__ == "WorkerGroupStartupTimeoutError" for cls in type(failure).__mro__)


def quiet_train_report_logs() -> bool:
    """Silence the INFO line Ray Train logs for every `report()`, metrics and all, under a
    logger named by its module's file path (outside `ray.train`'s level setting); return
    whether this Ray has that module (else its lines, if any, stay)."""
    spec = _find_spec(_TRAIN_CONTEXT)
    if spec is None or spec.origin is None:
        return False
    logging.getLogger(spec.origin).setLevel(logging.WARNING)
    return True


def embedded_ray_cpus() -> float:
    """CPUs a local Ray instance started here gets: Ray's own count, which `ray.init`
    uses (the cgroup quota in a container, else the machine's CPUs); on a Ray without
    it, the CPUs this process may use."""
    get_num_cpus = _private(_RAY_UTILS, "get_num_cpus")
    if get_num_cpus is not None:
        return float(get_num_cpus())
    return float(len(os.sched_getaffinity(0)))


# --- which features the installed Ray has -------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RayFeature:
    """Something trainstack uses that not every supported Ray release has."""

    name: str
    uses: str
    """What trainstack does with it."""
    since: str
    """The first Ray release that has it."""
    private: bool
    """Reached through a name outside Ray's public API (so behind a check here)."""
    fallback: str
    """What trainstack does on a Ray without it."""
    check: Callable[[], bool]
    """Whether the installed Ray has it (imports Ray Train to look)."""

    @property
    def available(self) -> bool:
        return self.check()


def has_elastic_scaling() -> bool:
    """Whether Ray Train's ScalingConfig resizes a group between (min, max) workers."""
    import ray.train

    parameters = inspect.signature(ray.train.ScalingConfig).parameters
    return "elastic_resize_monitor_interval_s" in parameters


def train_logging_config() -> type | None:
    """`ray.train.LoggingConfig`, or None on a Ray without it."""
    import ray.train

    found: type | None = getattr(ray.train, "LoggingConfig", None)
    return found


def _has_start_attempt_hook() -> bool:
    base = _private(_CALLBACK, "ControllerCallback")
    return base is not None and hasattr(base, "on_controller_start_worker_group")


def _has_default_callbacks_hook() -> bool:
    from ray.train.torch import TorchTrainer

    return hasattr(TorchTrainer, "_create_default_callbacks")


RAY_FEATURES: tuple[RayFeature, ...] = (
    RayFeature(
        name="elastic_scaling",
        uses="elastic worker groups: ScalingConfig(num_workers=(min, max))",
        since="2.55",
        private=False,
        fallback="refused by pre-flight",
        check=has_elastic_scaling,
    ),
    RayFeature(
        name="train_logging_config",
        uses="RunConfig(logging_config=LoggingConfig(log_level='WARNING'))",
        since="2.56",
        private=False,
        fallback="Ray Train's driver-side logs at its default level",
        check=lambda: train_logging_config() is not None,
    ),
    RayFeature(
        name="start_attempt_events",
        uses="a start_attempt event for each start of the worker group",
        since="2.50",
        private=True,
        fallback="no start_attempt events",
        check=_has_start_attempt_hook,
    ),
    RayFeature(
        name="lean_trainer",
        uses="no dataset-manager actor for a run that streams no Ray Data",
        since="2.54",
        private=True,
        fallback="Ray's default callbacks (2.54 on: a dataset-manager actor per group start)",
        check=lambda: (
            _has_default_callbacks_hook()
            and _private(_DATASETS_CALLBACK, "DatasetsCallback") is not None
        ),
    ),
    RayFeature(
        name="own_instance_cleaner",
        uses="the placement-group cleaner asks its own Ray instance (none when embedded)",
        since="2.54",
        private=True,
        fallback="Ray's own cleaner where it has one (2.54 on), asking the machine's Ray",
        check=lambda: (
            _has_default_callbacks_hook() and _own_instance_cleaner_callback_class() is not None
        ),
    ),
    RayFeature(
        name="start_timeout_error_type",
        uses="a start that found no room told from other controller failures",
        since="2.43",
        private=True,
        fallback="told by the error type's name",
        check=lambda: _private(_EXCEPTIONS, "WorkerGroupStartupTimeoutError") is not None,
    ),
    RayFeature(
        name="quiet_report_logs",
        uses="Ray Train's INFO line per report() silenced",
        since="2.43",
        private=True,
        fallback="one INFO line per report() in the workers' logs",
        check=lambda: _find_spec(_TRAIN_CONTEXT) is not None,
    ),
    RayFeature(
        name="ray_cpu_count",
        uses="the CPUs an embedded instance gets, as Ray counts them (cgroup quota)",
        since="2.43",
        private=True,
        fallback="the CPUs this process may use",
        check=lambda: _private(_RAY_UTILS, "get_num_cpus") is not None,
    ),
)
"""Every feature trainstack uses that the oldest supported Ray lacks or that it reaches
privately."""


def features() -> list[RayFeature]:
    """Every feature in `RAY_FEATURES`; each one's `available` says whether the installed
    Ray has it (`trainstack doctor` prints them)."""
    return list(RAY_FEATURES)


def missing_ray_feature(name: str, *, setting: str, value: object) -> str | None:
    """One line saying the spec's `setting`=`value` needs feature `name`, which the
    installed Ray lacks, and the release that brought it; None when Ray has it."""
    feature = next(f for f in RAY_FEATURES if f.name == name)
    if feature.available:
        return None
    return (
        f"{setting}={value} needs Ray >= {feature.since} ({feature.uses}); this environment "
        f"has Ray {installed_ray_version()}: install ray>={feature.since}, or unset {setting}"
    )


def installed_ray_version() -> str:
    """The installed Ray's version, without importing it."""
    try:
        return version("ray")
    except PackageNotFoundError:
        return "none"
