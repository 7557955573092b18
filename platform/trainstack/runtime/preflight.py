"""Pre-flight: everything about a job the driver can check before Ray starts.

The checkpoint storage must take a file (a probe is written there and removed; in an object
store, a probe object, after checking that the bucket exists). The data's files
are found (globs expanded to absolute paths, which is the spec the workers get),
checked (sizes, dtypes, token ids and labels in range) and, for text, prepared once;
the user's model target imports and builds (seeded, as the workers will build it),
`task.loss` imports, one micro-batch of the job's data goes through
the model and the task's loss (so an output of the wrong shape is one line here, not
a worker traceback), and the layout fits the model (pipeline layers, parameter-server
shards). trainstack's own models (gpt, mlp) past `META_BUILD_PARAMS` parameters are
built on the meta device, for their shapes only: no weights are initialised on the
driver. A spec that asks Ray Train for what the installed Ray lacks (elastic worker
groups before Ray 2.55) is refused. Every problem is a `ConfigError`: one line, exit 2,
nothing started.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainstack import checkpoint as ckpt
from trainstack.compat.ray import missing_ray_feature
from trainstack.config import ConfigError, JobConfig
from trainstack.data import Source, build_corpus
from trainstack.data.paths import resolve_data
from trainstack.errors import first_line, show
from trainstack.kinds import data_kind_of, kind_of, model_kind_of
from trainstack.models import block_classes, build_model, num_params
from trainstack.planner.workload import parameter_count
from trainstack.storage import OPTION_SCHEMES, StorePath, is_store_uri, open_location
from trainstack.tasks import Task, TaskOutputError, build_task
from trainstack.user_code import describe_exception

META_BUILD_PARAMS = 50_000_000
"""Above this many parameters a built-in model is checked on the meta device."""


@dataclass(frozen=True, kw_only=True)
class PreflightReport:
    """What the driver learnt about the job."""

    cfg: JobConfig
    """The spec the workers run: data paths resolved (`data.paths.resolve_data`)."""
    data_fingerprint: str
    """Digest of the data, which a checkpoint must match to resume."""
    model_class: str
    params: int
    shapes: dict[str, list[int]]
    """State-dict names and shapes, which a checkpoint must match."""


def preflight(cfg: JobConfig) -> PreflightReport:
    """Check `cfg` against its model and data on the driver; raise ConfigError."""
    check_ray_features(cfg)
    check_storage(cfg)
    cfg = resolve_data(cfg)
    corpus = check_data(cfg)
    task = build_task(cfg)
    if model_kind_of(cfg).builtin and parameter_count(cfg) > META_BUILD_PARAMS:
        # trainstack's own, large: its shapes only, on the meta device (a 1.3B GPT: 1 s,
        # not 16 s of initialising weights; the meta device's first use costs 0.8 s)
        with torch.device("meta"):
            model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    else:  # built and run on one sample of the job's data
        model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
        check_model_runs(cfg, model, task=task, corpus=corpus)
    if cfg.train.compile and not block_classes(model, class_names=cfg.model.checkpoint_modules):
        raise ConfigError(
            f"train.compile=true compiles the model's repeated blocks, but "
            f"{type(model).__name__} has none; name their class in model.checkpoint_modules, "
            "give the model a pipeline_layers() method, or set train.compile=false"
        )
    for check in kind_of(cfg).checks():  # the layout's own checks of the built model
        check(cfg, model)
    return PreflightReport(
        cfg=cfg,
        data_fingerprint=corpus.fingerprint,
        model_class=type(model).__name__,
        params=num_params(model),
        shapes=ckpt.parameter_shapes(model),
    )


def check_ray_features(cfg: JobConfig) -> None:
    """The installed Ray has what the spec asks of Ray Train beyond trainstack's oldest
    supported Ray (`compat.ray.RAY_FEATURES`): elastic worker groups."""
    if cfg.scaling.elastic:
        missing = missing_ray_feature(
            "elastic_scaling", setting="scaling.min_workers", value=cfg.scaling.min_workers
        )
        if missing is not None:
            raise ConfigError(missing)


def check_storage(cfg: JobConfig) -> None:
    """`checkpoint.storage_path` (and the run's directory, if it exists) takes a file: the
    missing folders are created, a probe file is written and removed, and the folders
    this check created are removed again, so a job refused later leaves nothing behind.
    An object store's bucket must exist and take a small probe object, deleted again."""
    if is_store_uri(cfg.checkpoint.storage_path):
        check_object_store(cfg)
        return
    storage = Path(cfg.checkpoint.storage_path).expanduser().resolve()
    run_dir = ckpt.run_dir_for(cfg)
    for folder in (storage, run_dir) if run_dir.is_dir() else (storage,):
        created = [p for p in (folder, *folder.parents) if not p.exists()]
        probe = folder / f".trainstack-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            reason = (e.strerror or type(e).__name__).lower()
            raise ConfigError(
                f"checkpoint.storage_path={show(cfg.checkpoint.storage_path)}: cannot write "
                f"in {str(folder)!r} ({reason}); allowed: a directory this user can create "
                "files in (on a cluster, one every node mounts)"
            ) from None
        finally:
            for path in created:  # deepest first
                with contextlib.suppress(OSError):
                    path.rmdir()


def check_object_store(cfg: JobConfig) -> None:
    """The store answers with these credentials, the bucket exists, and a probe object
    can be written and deleted in `storage_path`."""
    uri, options = cfg.checkpoint.storage_path, cfg.checkpoint.storage_options
    where = f"checkpoint.storage_path={show(uri)}"
    storage = open_location(uri, options)
    assert isinstance(storage, StorePath)
    bucket = StorePath(storage.fs, storage.path.split("/", 1)[0], scheme=storage.scheme)
    probe = storage / f".trainstack-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if storage.scheme in OPTION_SCHEMES and not bucket.exists():
            raise ConfigError(
                f"{where}: bucket {bucket.name!r} does not exist (or these credentials cannot "
                "see it); allowed: an existing bucket (create it first)"
            )
        probe.write_text("")
        probe.delete_file()
    except OSError as e:
        reason = first_line(e)
        raise ConfigError(
            f"{where}: cannot write there ({reason[:300]}); check that the store is reachable "
            "(checkpoint.storage_options endpoint_override, region, scheme) and the "
            "credentials in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
        ) from None


def check_data(cfg: JobConfig) -> Source:
    """The job's data, checked and (text) prepared; its corpus as workers will build it."""
    if data_kind_of(cfg).prepared:
        from trainstack.data.prepare import ensure_prepared

        ensure_prepared(cfg)
    from trainstack.data.checks import check_data as check_files

    check_files(cfg)
    return build_corpus(cfg.data)


def check_model_runs(cfg: JobConfig, model: nn.Module, *, task: Task, corpus: Source) -> None:
    """One sample of the job's data through the model and the task's loss."""
    x, y = corpus.train_batch(0, 1, seq_len=cfg.model.block_size)
    where = cfg.model.target or cfg.model.kind
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            outputs = task.outputs(model, x, y)
    except ConfigError:  # the model refuses the spec in its own line (data.pack)
        raise
    except Exception as e:
        raise ConfigError(
            f"model {where!r} failed on one input of shape {list(x.shape)} "
            f"({x.dtype}, from data.kind={cfg.data.kind}): {describe_exception(e)}"
        ) from None
    try:
        with torch.no_grad():
            task.loss(outputs, y, inputs=x)
    except TaskOutputError as e:
        raise ConfigError(f"model {where!r}: {e}") from None
    except Exception as e:
        what = f"task.loss={cfg.task.loss!r}" if cfg.task.loss else f"task.kind={cfg.task.kind}"
        raise ConfigError(
            f"{what} failed on the output of model {where!r}: {describe_exception(e)}"
        ) from None
