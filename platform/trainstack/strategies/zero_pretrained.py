"""`model.pretrained` under ZeRO, each rank reading what it holds.

ZeRO-3 partitions every parameter over the data-parallel ranks: a parameter's
`ds_tensor` holds this rank's contiguous run of its flattened elements (ceil(numel / N)
of them from rank × that, the last rank's run padded; deepspeed/runtime/zero/
partition_parameters.py). A pretrained model comes with its parameters on the meta
device (`models/on_meta.py`). `partition_on_meta` makes each a ZeRO-3 parameter whose
partition has storage and no values yet, what `deepspeed.zero.Init(module=model)` makes
of a model built whole, but without the whole parameter (Init broadcasts each from rank 0
and copies this rank's run out of it) - before DeepSpeed's engine is built, which then
takes the model as partitioned. `read_held` fills them from the folder: a run of a
flattened tensor is one byte range of its safetensors file (`checkpoint/pretrained.py`
`read_runs`), so a rank reads and holds 1/N of each tensor. Under stages 1 and 2 every
rank holds every parameter whole (`pretrained_parts.materialise`) and `read_held` reads
each whole. Buffers stay real as built (the rotary `inv_freq`); a buffer the folder
saves is read whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainstack.checkpoint.pretrained import read_runs, saved_shapes
from trainstack.models.on_meta import saved_names


def partition_on_meta(model: nn.Module, *, config: Mapping[str, Any]) -> None:
    """Make every parameter of `model` (each on the meta device) a ZeRO-3 parameter that
    holds storage for this rank's partition alone, uninitialised, in the dtype and on the
    device DeepSpeed's `config` trains it in (bf16 under `bf16.enabled`; host memory
    under `offload_param`). Nothing is sent between ranks."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    init = deepspeed.zero.Init(config_dict_or_path=dict(config))
    param: Any  # a Parameter that DeepSpeed gives its ds_* attributes and methods
    for param in model.parameters():  # a tied Parameter once
        assert param.is_meta, "build_hf_model(on_meta=True) leaves no parameter real"
        # Swapped in place (every module and tie holds this Parameter) for one element
        # seen in the parameter's shape: DeepSpeed takes the shape, then frees the data.
        one = torch.empty((), dtype=init.dtype, device=init.local_device)
        stand_in = nn.Parameter(one.expand(param.shape), requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, stand_in)
        init._convert_to_deepspeed_param(param)  # ds_* attributes, gather/partition methods
        size = param.aligned_size() // param.ds_zero_partition_world_size
        partition = torch.empty(size, dtype=init.dtype, device=init.remote_device)
        if init.pin_memory:  # where Init pins an offloaded partition
            from deepspeed.accelerator import get_accelerator

            partition = get_accelerator().pin_memory(partition)
        # What DeepSpeed's `_partition_param` records of a partition it allocates.
        partition.requires_grad = False
        partition.ds_numel = size  # type: ignore[attr-defined]
        partition.status = PartitionedParamStatus.AVAILABLE  # type: ignore[attr-defined]
        partition.final_location = None  # type: ignore[attr-defined]
        param.ds_tensor = partition
        param.ds_numel_aligned = size * param.ds_zero_partition_world_size
        param.partition()  # already partitioned: DeepSpeed marks it so and frees `data`
    # As Init(module=...) does, so training runs the same: DeepSpeed 0.19.4 and later swap
    # in their memory-efficient linear there; earlier ones leave torch's.
    enable_linear = getattr(init, "_enable_mem_efficient_linear", None)
    if init.mem_efficient_linear and enable_linear is not None:
        enable_linear()


def read_held(model: nn.Module, folder: str) -> None:
    """Fill every tensor of `model`'s state dict from the save_pretrained `folder`, under
    the first of its names the folder saves (a tied LM head is saved as the embedding):
    a ZeRO-3 parameter's partition with its run of the saved tensor (padding zeroed),
    any other tensor whole. Not a collective; `build_hf_model(on_meta=True)` checked
    that the folder fits."""
    path = Path(folder).expanduser()
    saved = saved_shapes(path)
    assert saved is not None, "build_hf_model loads such a folder whole"
    state = model.state_dict(keep_vars=True)
    runs: dict[str, tuple[int, torch.Tensor]] = {}
    with torch.no_grad():
        for key, found in saved_names(model, saved):
            assert found is not None, (key, "build_hf_model checked every tensor is saved")
            runs[found] = _run(state[key])
        read_runs(path, runs)


def _run(tensor: Any) -> tuple[int, torch.Tensor]:
    """Where this rank's part of `tensor` starts in it, flattened, and a 1-D view of the
    storage it goes into: a ZeRO-3 parameter's partition (its padding zeroed here), or
    the whole tensor."""
    partition = getattr(tensor, "ds_tensor", None)
    if partition is None:
        whole: torch.Tensor = tensor.detach().view(-1)
        return 0, whole
    assert partition.numel() == tensor.partition_numel(), "ZeRO-3 keeps a flat partition"
    first = partition.numel() * tensor.ds_zero_partition_rank
    count = max(0, min(partition.numel(), tensor.ds_numel - first))
    partition.narrow(0, count, partition.numel() - count).zero_()
    return first, partition.narrow(0, 0, count)
