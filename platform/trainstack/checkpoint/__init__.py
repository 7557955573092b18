"""The on-disk checkpoint format: one directory per checkpoint, verified before use.

    checkpoint_00000120/
      manifest.json        step, samples seen, spec and its hash, strategy, world layout,
                           library versions, metrics, and sha256 + size of every file
      model.pt             portable full model weights (any strategy or world size loads them)
      model/stage_00001.pt or, from a pipeline, one file per stage with that stage's weights
                           under the full model's names (merged, they are model.pt)
      optimizer.pt ...     strategy state, as the strategy lays it out
      state/.metadata      or, from a sharded layout (fsdp, tensor parallel), model and
      state/__0_0.distcp   optimizer state written by torch.distributed.checkpoint, each
                           rank its own shards (sharded.py); any layout reads it
      rng/rank_00000.pt    RNG states (python, numpy, torch) of each rank

Every file is written to a temporary name and renamed; the manifest goes last and is
the proof that a checkpoint is complete. Loading verifies every file's size and hash
first and uses `torch.load(weights_only=True)`.

Checkpoints live in a local folder (a `Path`) or in an object store (a
`storage.StorePath`, `checkpoint.storage_path: s3://bucket/prefix`); every function
here takes either, and verification reads sizes and hashes back from the store itself.

`format.py` writes, verifies, lists and prunes checkpoints; `resume.py` picks the one a
run starts from; `rng.py` saves and restores RNG states; `sharded.py` holds DCP state.
"""

from trainstack.checkpoint.format import (
    FORMAT_VERSION,
    MANIFEST,
    SHARDED_FOLDER,
    Checkpoint,
    CheckpointError,
    StorageUnreachableError,
    build_manifest,
    checkpoints_for,
    dir_name,
    gather_entries,
    latest_valid,
    list_checkpoints,
    location,
    parameter_shapes,
    prune,
    rank_file,
    read,
    run_dir_for,
    save_atomically,
    spec_hash,
    stage_file,
    verify,
    write_manifest,
    write_rank_files,
)
from trainstack.checkpoint.resume import (
    LAYOUT_KEYS,
    SAME_RUN_EXEMPT,
    check_same_data,
    check_same_model,
    check_same_run,
    checked_start,
    find_start,
    resolve,
    warn,
)
from trainstack.checkpoint.rng import (
    rng_state,
    set_rng_state,
)

__all__ = [
    "FORMAT_VERSION",
    "LAYOUT_KEYS",
    "MANIFEST",
    "SAME_RUN_EXEMPT",
    "SHARDED_FOLDER",
    "Checkpoint",
    "CheckpointError",
    "StorageUnreachableError",
    "build_manifest",
    "check_same_data",
    "check_same_model",
    "check_same_run",
    "checked_start",
    "checkpoints_for",
    "dir_name",
    "find_start",
    "gather_entries",
    "latest_valid",
    "list_checkpoints",
    "location",
    "parameter_shapes",
    "prune",
    "rank_file",
    "read",
    "resolve",
    "rng_state",
    "run_dir_for",
    "save_atomically",
    "set_rng_state",
    "spec_hash",
    "stage_file",
    "verify",
    "warn",
    "write_manifest",
    "write_rank_files",
]
