"""Where a run starts: the newest checkpoint that verifies (its own, else `--resume-from`),
refused when it holds another model, other data or, for the run's own checkpoints,
another spec (naming the keys), with a one-line warning for each one skipped."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from trainstack.checkpoint.format import (
    MANIFEST,
    Checkpoint,
    CheckpointError,
    checkpoints_for,
    latest_valid,
    store_errors,
    verify,
)
from trainstack.config import ConfigError, JobConfig, config_from_dict, config_to_dict
from trainstack.errors import show
from trainstack.storage import (
    Location,
)


def check_same_data(start: Checkpoint, fingerprint: str, *, allow: bool) -> None:
    """Raise CheckpointError when `start` was trained on other data than `fingerprint`
    describes, unless `allow` (`data.allow_changed`)."""
    saved = start.manifest.get("data", {}).get("fingerprint")
    if saved is None or saved == fingerprint or allow:
        return
    raise CheckpointError(
        f"{start.path} was trained on other data (fingerprint {saved[:12]} in the checkpoint, "
        f"{fingerprint[:12]} now); resume anyway with --set data.allow_changed=true, or choose "
        "another name"
    )


SAME_RUN_EXEMPT = (
    "name",
    "checkpoint.",
    "log.",
    "tracking.",
    "failure.",
    "faults.",
    "data.allow_changed",
    "data.train",
    "data.val",
    "data.prepared_dir",
    "scaling.start_timeout_s",
    "scaling.resize_check_s",
    "scaling.resources_per_worker",
    "strategy.ps_cpus",
)
"""Spec keys (with a trailing dot: whole sections) a rerun may change and still be the
same run: how it saves, logs, is tracked, waits for workers and survives failures, and
where its data lies (the data's fingerprint, `check_same_data`, says whether it is the
same data)."""


LAYOUT_KEYS = (
    "scaling.num_workers",
    "scaling.min_workers",
    "scaling.use_gpu",
    "scaling.cpus_per_worker",
    "train.micro_batch_size",
)
"""Keys a run that trains on may change: the same steps on another world size
(docs/checkpoints-and-failures.md, "Another world size"). A finished run would not train
at all, so there they count."""


def check_same_run(start: Checkpoint, cfg: JobConfig) -> None:
    """Raise CheckpointError when `start`, a checkpoint of `cfg`'s own run, was written
    under a spec that differs from `cfg` in a key that changes what the run computes or
    reports: rerunning would report, or continue, another run than `cfg` describes.

    Keys that do not count: `SAME_RUN_EXEMPT`; every `data.` key with `data.allow_changed`;
    `LAYOUT_KEYS` while the run has steps left; `train.steps` raised (training continues).
    """
    saved = _flat_spec(start.manifest["spec"])
    now = _flat_spec(config_to_dict(cfg))
    trains_on = start.step < cfg.train.steps

    def counts(key: str) -> bool:
        old, new = saved.get(key, _ABSENT), now.get(key, _ABSENT)
        if old == new or _is_key_in(key, SAME_RUN_EXEMPT):
            return False
        if key.startswith("data.") and cfg.data.allow_changed:
            return False
        if trains_on and _is_key_in(key, LAYOUT_KEYS):
            return False
        raised = key == "train.steps" and isinstance(old, int) and new > old
        return not raised

    differences = [
        f"{key} {_show(saved.get(key, _ABSENT))} → {_show(now.get(key, _ABSENT))}"
        for key in sorted(saved.keys() | now.keys())
        if counts(key)
    ]
    if not differences:
        return
    run_dir = start.path.parent
    shown = "; ".join(differences[:6])
    more = f"; and {len(differences) - 6} more" if len(differences) > 6 else ""
    finished = " (finished)" if start.step >= saved.get("train.steps", start.step) else ""
    raise CheckpointError(
        f"run {cfg.name!r} already has a checkpoint at step {start.step}{finished} in "
        f"{run_dir}, from another spec: {shown}{more}; to train this spec start a new run "
        f"with --set name=NEW (add --resume-from {run_dir} to start it from this run's "
        "checkpoint on purpose), or rerun with the old values"
    )


_ABSENT = object()


def _show(value: object) -> str:
    return "absent" if value is _ABSENT else show(value)


def _flat_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` as dotted keys to JSON values, with defaults filled in by this trainstack's
    spec (a spec it cannot read, from another version, is compared as written)."""
    plain = json.loads(json.dumps(spec))  # as a manifest holds it: lists, string keys
    with contextlib.suppress(ConfigError):
        plain = json.loads(json.dumps(config_to_dict(config_from_dict(plain))))
    flat: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(plain, "")
    return flat


def _is_key_in(key: str, entries: tuple[str, ...]) -> bool:
    return any(key == e or (e.endswith(".") and key.startswith(e)) for e in entries)


def warn(message: str) -> None:
    print(f"trainstack: warning: {message}", flush=True)


def find_start(
    run_dir: Location,
    *,
    resume_from: Location | None,
    on_corrupt: str,
    warn: Callable[[str], None] = warn,
) -> Checkpoint | None:
    """Where a run starts: its own newest valid checkpoint, else `resume_from`, else None.

    `resume_from` may be a checkpoint directory or a run directory (its newest valid
    checkpoint is used). Raises CheckpointError when checkpoints exist but none verifies
    and `on_corrupt` is `fail`, or when `resume_from` does not verify, and
    StorageUnreachableError when the store does not answer.
    """
    found, skipped = latest_valid(run_dir, warn=warn)
    if found is not None:
        return found
    if skipped and on_corrupt == "fail":
        raise CheckpointError(
            f"{run_dir}: none of its {skipped} checkpoint(s) verifies; set "
            "checkpoint.on_corrupt=restart to start fresh"
        )
    if skipped:
        warn(f"{run_dir}: no checkpoint verifies; starting fresh (checkpoint.on_corrupt=restart)")
    if resume_from is None:
        return None
    return resolve(resume_from, warn=warn)


def checked_start(
    cfg: JobConfig,
    *,
    resume_from: Location | None,
    shapes: dict[str, list[int]],
    data_fingerprint: str,
) -> Checkpoint | None:
    """Where `cfg`'s run starts (`find_start`), checked before anything starts: the same
    model (`shapes`), the same data (`data_fingerprint`) and, for the run's own
    checkpoint, the same run (`check_same_run`). Raises CheckpointError."""
    run_dir = checkpoints_for(cfg)
    start = find_start(run_dir, resume_from=resume_from, on_corrupt=cfg.checkpoint.on_corrupt)
    if start is None:
        return None
    check_same_model(start, shapes)
    check_same_base(start, cfg)
    check_same_data(start, data_fingerprint, allow=cfg.data.allow_changed)
    if start.path.parent == run_dir:  # not --resume-from: that starts another run on purpose
        check_same_run(start, cfg)
    return start


def resolve(path: Location, *, warn: Callable[[str], None] = warn) -> Checkpoint:
    """`path` as a checkpoint: the directory itself if it has a manifest, else the newest
    valid checkpoint of the run directory `path`. Raises CheckpointError."""
    with store_errors(path):
        has_manifest = (path / MANIFEST).exists()
    if has_manifest:
        return verify(path)
    chosen, _ = latest_valid(path, warn=warn)
    if chosen is None:
        raise CheckpointError(f"{path}: no valid checkpoint there")
    return chosen


def lora_base(cfg: JobConfig) -> dict[str, Any]:
    """What a LoRA run's adapters load over, for its manifests: the pretrained folder
    and its fingerprint, else the seed the spec's model is built from."""
    folder = cfg.model.pretrained
    if folder:
        from trainstack.checkpoint.pretrained import folder_fingerprint

        return {"pretrained": folder, "fingerprint": folder_fingerprint(folder)}
    return {"seed": cfg.train.seed}


def check_same_base(start: Checkpoint, cfg: JobConfig) -> None:
    """Raise CheckpointError when `start` holds adapters (`model.lora`) trained over
    another base than `cfg`'s: another pretrained folder's contents, or another seed."""
    saved: dict[str, Any] | None = start.manifest.get("lora")
    if saved is None:
        return
    now = lora_base(cfg)
    if "fingerprint" in saved and saved.get("fingerprint") == now.get("fingerprint"):
        return  # the same weights, wherever the folder lies now
    if saved == now:
        return

    def said(base: dict[str, Any]) -> str:
        if "fingerprint" in base:
            return f"{base['pretrained']} (fingerprint {base['fingerprint'][:12]})"
        return f"the model built from train.seed={base['seed']}"

    raise CheckpointError(
        f"{start.path} holds LoRA adapters trained over {said(saved)}, not over "
        f"{said(now)}; resume over the base they were trained on, or start a new run "
        "(another name)"
    )


def check_same_model(start: Checkpoint, shapes: dict[str, list[int]]) -> None:
    """Raise CheckpointError when `start` holds weights of another model than the one
    whose state-dict names and shapes are `shapes` (`parameter_shapes(model)`)."""
    saved: dict[str, list[int]] | None = start.manifest.get("model_shapes")
    if saved is None:  # written before checkpoints recorded shapes: loading will tell
        return
    differences = [
        f"{name} {saved.get(name, 'absent')} in the checkpoint, {shapes.get(name, 'absent')} now"
        for name in sorted(saved.keys() | shapes.keys())
        if saved.get(name) != shapes.get(name)
    ]
    if differences:
        shown = "; ".join(differences[:5])
        more = f"; and {len(differences) - 5} more" if len(differences) > 5 else ""
        raise CheckpointError(
            f"{start.path} holds another model ({len(differences)} tensors differ: {shown}"
            f"{more}); choose another name, another checkpoint.storage_path, or remove the "
            "old run"
        )
