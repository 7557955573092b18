"""Every torch name trainstack uses outside torch's public API, each behind a feature
check with a fallback for the torch versions that lack it.

A private name is imported inside the function that needs it, guarded, never when this
module is imported; nothing else in trainstack names one. `features()` says which of
them the installed torch has (for `trainstack doctor`); a feature with no fallback is
refused before Ray starts by the pre-flight check of what needs it, naming the torch it
needs (`TorchFeature.refusal`).

What each is for, and what trainstack does without it (the table `TORCH_FEATURES`):

- `strided_shard`: `_StridedShard`, tensor parallelism's packed MoE experts
  (strategies/tensor_parallel.py) and the blocks of checkpoint/blocks.py; without it the
  former is refused.
- `dispatch_mode`, `group_by_name`: `TorchDispatchMode`, `_resolve_process_group`, the
  bytes FSDP's collectives send, counted (strategies/comm_count.py); else modelled.
- `fake_tensors`: `FakeTensorMode`, the FLOPs of a model built on meta
  (models/flops.py); else 6 x its parameters per token.
- `cpu_attention_ops`: the CPU attention kernel's aten operators, counted as FLOPs;
  else left out of MFU.
- `ddp_ignore`: DDP's list of parameters it ignores (expert parallelism beside DDP);
  else the experts are taken out of the model while DDP is built.
- `module_parameters`: `nn.Module._parameters`, tensor parallelism's experts run on
  their local slices; else the parameters are removed and registered again.
- `stage_shape_inference`: the pipeline stage's shape-inference methods, wrapped so
  they leave the buffers and the random generators as they were; else left alone.
- `schedule_plan`: a multi-stage schedule's plan (`pipeline_order`, torch's `_Action`s),
  replayed for the ideal bubble; else that figure is NaN.
- `stage_warmup`: the pipeline stage's warm-up of its links (torch 2.9 to 2.11), made
  one gloo can run (no sends of a rank to itself, float32 throughout); else torch's own.
- `dualpipev` and `zbv_on_gloo`, public: the dualpipev schedule (torch 2.9+) and the zbv
  schedule on gloo, which torch 2.9 cannot run; refused by pre-flight where missing.

No longer used, because trainstack computes it: a strided shard's offsets
(`_StridedShardOffsetMode`, torch 2.13+; checkpoint/blocks.py's own arithmetic, tested
equal to torch's where it has the API).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# ---- what the installed torch has ------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TorchFeature:
    """Something trainstack uses that not every supported torch has: a name outside
    torch's public API (`private`), or a public one newer than the oldest release."""

    name: str
    uses: str
    """What trainstack does with it."""
    torch_name: str
    """Where torch keeps it."""
    since: str
    """The first torch release that has it (`2.8`, the oldest trainstack runs on, for
    what is older)."""
    fallback: str
    """What trainstack does on a torch without it (`refused ...` where nothing can stand
    in: pre-flight refuses what needs it)."""
    until: str | None = None
    """The last torch release that has it (None: every one since)."""
    private: bool = True
    """Reached through a name outside torch's public API (else: a public API or a
    behaviour that not every supported release has)."""
    check: Callable[[], bool]
    """Whether the installed torch has it."""

    @property
    def available(self) -> bool:
        return self.check()

    @property
    def needs(self) -> str:
        return f"torch>={self.since}"

    def refusal(self, what: str, *, instead: str) -> str:
        """The one line that refuses `what`, which needs this feature: what to install,
        or what to ask `instead`."""
        return (
            f"{what} needs {self.needs} ({self.torch_name}), and this is torch "
            f"{torch.__version__}; install {self.needs}, or use {instead}"
        )


class TorchFeatureMissing(RuntimeError):
    """A feature with no fallback was asked of a torch that lacks it (pre-flight refuses
    the spec first; this is for the worker that got past it)."""


def features() -> tuple[TorchFeature, ...]:
    """Every private torch feature trainstack uses (`available` checks the installed
    torch)."""
    return TORCH_FEATURES


def feature(name: str) -> TorchFeature:
    """One of `features()`, by name."""
    (found,) = (f for f in TORCH_FEATURES if f.name == name)
    return found


_CPU_ATTENTION_OPS: tuple[str, str] = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)
_METADATA_HOOKS = ("_forward_metadata_inference", "_post_metadata_inference_cleanup")


def _importable(module: str, name: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            found = __import__(module, fromlist=[name])
        except ImportError:
            return False
        return hasattr(found, name)

    return check


def _stage_has(method: str) -> bool:
    from torch.distributed.pipelining import PipelineStage

    return hasattr(PipelineStage, method)


def _has_stage_shape_inference() -> bool:
    since_2_12 = all(_stage_has(hook) for hook in _METADATA_HOOKS)
    return since_2_12 or _stage_has("_shape_inference")


def _has_ddp_ignore() -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return hasattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model")


def _has_schedule_plan() -> bool:
    from torch.distributed.pipelining import schedules

    constants = ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")
    return all(hasattr(schedules, name) for name in constants)


def _has_cpu_attention_ops() -> bool:
    return all(hasattr(torch.ops.aten, op) for op in _CPU_ATTENTION_OPS)


def _release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_FEATURES: tuple[TorchFeature, ...] = (
    TorchFeature(
        name="strided_shard",
        uses="tensor parallelism of MoE experts with a packed gate_up_proj; their checkpoints",
        torch_name="torch.distributed.tensor.placement_types._StridedShard",
        since="2.8",
        fallback="refused by pre-flight (strategy.tensor_parallel=1 for such experts)",
        check=_importable("torch.distributed.tensor.placement_types", "_StridedShard"),
    ),
    TorchFeature(
        name="dispatch_mode",
        uses="fsdp counts the bytes its collectives send in its first step",
        torch_name="torch.utils._python_dispatch.TorchDispatchMode",
        since="2.8",
        fallback="fsdp's bytes on the wire modelled (ring collectives), not counted",
        check=_importable("torch.utils._python_dispatch", "TorchDispatchMode"),
    ),
    TorchFeature(
        name="group_by_name",
        uses="the size of the group a functional collective names, for the count above",
        torch_name="torch.distributed.distributed_c10d._resolve_process_group",
        since="2.8",
        fallback="fsdp's bytes on the wire modelled (ring collectives), not counted",
        check=_importable("torch.distributed.distributed_c10d", "_resolve_process_group"),
    ),
    TorchFeature(
        name="fake_tensors",
        uses="the FLOPs of a model built on meta (a pretrained one), counted without storage",
        torch_name="torch._subclasses.fake_tensor.FakeTensorMode",
        since="2.8",
        fallback="FLOPs of a model built on meta estimated as 6 x parameters per token",
        check=_importable("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ),
    TorchFeature(
        name="cpu_attention_ops",
        uses="FLOPs of the CPU attention kernel, counted for MFU",
        torch_name="torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
        since="2.8",
        fallback="attention's FLOPs on CPU left out of MFU",
        check=_has_cpu_attention_ops,
    ),
    TorchFeature(
        name="ddp_ignore",
        uses="expert parallelism beside DDP: the experts stay out of DDP's reduction",
        torch_name="DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
        since="2.8",
        fallback="the experts taken out of the model while DDP is built",
        check=_has_ddp_ignore,
    ),
    TorchFeature(
        name="module_parameters",
        uses="tensor parallelism's MoE experts run their own forward on their local slices",
        torch_name="torch.nn.Module._parameters",
        since="2.8",
        fallback="the parameters removed and registered again around each forward",
        check=lambda: _has_parameter_table(nn.Module()),
    ),
    TorchFeature(
        name="stage_shape_inference",
        uses="a pipeline stage's shape inference leaves its buffers and the RNG as they were",
        torch_name="PipelineStage._forward_metadata_inference (2.12+) or ._shape_inference",
        since="2.8",
        fallback="the shape-inference forward moves batch-norm statistics (and, before "
        "2.12, the RNG)",
        check=_has_stage_shape_inference,
    ),
    TorchFeature(
        name="schedule_plan",
        uses="the ideal bubble of a multi-stage schedule, replayed from its own plan",
        torch_name="PipelineScheduleMulti.pipeline_order (its _Action entries)",
        since="2.8",
        fallback="the ideal bubble of a multi-stage schedule reported as NaN",
        check=_has_schedule_plan,
    ),
    TorchFeature(
        name="stage_warmup",
        uses="pipeline stages warm up their links on gloo (no sends to itself, float32)",
        torch_name="PipelineStage._get_init_p2p_neighbors_ops",
        since="2.9",
        fallback="torch's own warm-up (2.12 on: a vote that never calls it; 2.15: gone)",
        until="2.14",
        check=lambda: _stage_has("_get_init_p2p_neighbors_ops"),
    ),
    TorchFeature(
        name="dualpipev",
        uses="strategy.schedule dualpipev",
        torch_name="torch.distributed.pipelining.ScheduleDualPipeV",
        since="2.9",
        private=False,
        fallback="refused by pre-flight",
        check=_importable("torch.distributed.pipelining.schedules", "ScheduleDualPipeV"),
    ),
    TorchFeature(
        name="zbv_on_gloo",
        uses="strategy.schedule zbv on CPU workers (gloo)",
        torch_name="torch.distributed.pipelining.ScheduleZBVZeroBubble",
        since="2.10",
        private=False,
        fallback="refused by pre-flight: torch 2.9's zbv sends between its two stages on "
        "one rank, which gloo cannot",
        check=lambda: _release() >= (2, 10),
    ),
)


# ---- strided shards (tensor parallelism's packed experts; FSDP x TP's own layout) ------


def strided_shard(dim: int, *, split_factor: int) -> Any:
    """torch's `_StridedShard(dim, split_factor=...)`: along `dim`, `split_factor`
    pieces, each split over the mesh dimension, a rank holding its part of every piece.
    TorchFeatureMissing where torch has none (pre-flight refuses what needs one)."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        missing = feature("strided_shard")
        raise TorchFeatureMissing(
            missing.refusal("a strided shard", instead="strategy.tensor_parallel=1")
        ) from None
    return _StridedShard(dim, split_factor=split_factor)


def strided_split_factor(placement: object) -> int | None:
    """The split factor of a strided shard; None for any other placement (and for every
    placement, where torch has no strided shards)."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return None
    if not isinstance(placement, _StridedShard):
        return None
    return int(placement.split_factor)


# ---- counting collectives ------------------------------------------------------------


def collective_dispatch_mode(on_op: Callable[[str, tuple[Any, ...]], None]) -> Any | None:
    """A context manager that calls `on_op("namespace.op", args)` for every operator run
    inside it (a torch dispatch mode: collectives included, on their way to the
    backend); None where torch has no dispatch modes or cannot name a group's size."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: F401
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        return None

    class OperatorWatch(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
        ) -> Any:
            on_op(f"{func.namespace}.{func.__name__.split('.')[0]}", args)
            return func(*args, **(kwargs or {}))

    return OperatorWatch()


def group_size_by_name(group_name: str) -> int:
    """The size of the process group a functional collective names (only called from
    inside `collective_dispatch_mode`, which checks that torch can say)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return int(_resolve_process_group(group_name).size())  # type: ignore[arg-type]


# ---- FLOPs ------------------------------------------------------------------------------


def fake_tensor_mode() -> Any | None:
    """A context in which tensors have shapes and no storage (real tensors made inside it
    are fake too); None where torch has none."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:
        return None
    return FakeTensorMode(allow_non_fake_inputs=True)


def cpu_attention_ops() -> tuple[Any, Any] | None:
    """torch's CPU attention kernel, forward and backward, as operators (FlopCounterMode
    counts the GPU ones itself); None where torch has other names for them."""
    if not all(hasattr(torch.ops.aten, op) for op in _CPU_ATTENTION_OPS):
        return None
    forward, backward = (getattr(torch.ops.aten, op) for op in _CPU_ATTENTION_OPS)
    return forward, backward


# ---- modules' parameters ---------------------------------------------------------------


@contextlib.contextmanager
def hidden_from_ddp(module: nn.Module, names: list[str]) -> Iterator[None]:
    """Build a `DistributedDataParallel` of `module` inside: the parameters `names` stay
    out of it (not broadcast at the start, not reduced with the rest). torch's own list
    of parameters DDP ignores where it has one; else they are taken out of `module` while
    DDP is built (it reads the parameters once, then) and put back, in their order."""
    from torch.nn.parallel import DistributedDataParallel

    ignore = getattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
    if ignore is not None:
        ignore(module, names)
        yield
        return
    owners: dict[int, tuple[nn.Module, list[str], dict[str, nn.Parameter]]] = {}
    for name in names:
        path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(path) if path else module
        _, _, held = owners.setdefault(id(owner), (owner, _own_parameter_names(owner), {}))
        held[leaf] = owner.get_parameter(leaf)
        delattr(owner, leaf)
    try:
        yield
    finally:
        for owner, order, held in owners.values():
            _register_in_order(owner, order=order, held=held)


@contextlib.contextmanager
def parameters_replaced(module: nn.Module, values: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside, `module`'s own parameters named in `values` read as those tensors (plain
    ones: autograd reaches the parameters through them); afterwards the parameters again,
    in their order. torch's own table of a module's parameters where it has one; else
    each is taken out and registered again."""
    if _has_parameter_table(module):
        table = module._parameters
        saved = {name: table[name] for name in values}
        table.update(values)  # type: ignore[arg-type]
        try:
            yield
        finally:
            table.update(saved)
        return
    order = _own_parameter_names(module)
    held = {name: module.get_parameter(name) for name in values}
    for name, value in values.items():
        delattr(module, name)
        setattr(module, name, value)  # a plain attribute: not a Parameter
    try:
        yield
    finally:
        for name in values:
            delattr(module, name)
        _register_in_order(module, order=order, held=held)


def _has_parameter_table(module: nn.Module) -> bool:
    return isinstance(getattr(module, "_parameters", None), dict)


def _own_parameter_names(module: nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters(recurse=False, remove_duplicate=False)]


def _register_in_order(
    module: nn.Module, *, order: list[str], held: Mapping[str, nn.Parameter]
) -> None:
    """Register `held` on `module` again, its other own parameters with them, in `order`
    (which `named_parameters`, so the optimizer and checkpoints, follow)."""
    params = {name: held[name] if name in held else module.get_parameter(name) for name in order}
    for name in order:
        if name not in held:
            delattr(module, name)
    for name, param in params.items():
        module.register_parameter(name, param)


# ---- a pipeline schedule's plan ----------------------------------------------------------


def schedule_compute_actions(schedule: Any) -> dict[int, list[tuple[str, int, int]]] | None:
    """A torch multi-stage schedule's plan, rank by rank, its compute actions only, in
    order: (kind, stage, micro-batch), kind F (forward), B (full backward), I (backward
    for inputs) or W (backward for weights). Read from the schedule's `pipeline_order`,
    whose actions are torch's private `_Action`s (compared with the module's public
    constants: their values changed in 2.11); None where the schedule keeps no plan."""
    from torch.distributed.pipelining import schedules

    plan = getattr(schedule, "pipeline_order", None)
    if not isinstance(plan, dict):
        return None
    kinds = {
        schedules.FORWARD: "F",
        schedules.FULL_BACKWARD: "B",
        schedules.BACKWARD_INPUT: "I",
        schedules.BACKWARD_WEIGHT: "W",
    }
    orders: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in plan.items():
        flat = []
        for action in actions:
            if action is None:
                continue
            for part in getattr(action, "sub_actions", None) or (action,):
                kind = kinds.get(part.computation_type)
                if kind is not None:
                    flat.append((kind, part.stage_index, part.microbatch_index))
        orders[rank] = flat
    return orders


# ---- pipeline stages' shape inference ----------------------------------------------------


class ShapeInferenceLeavesNoTrace:
    """A mixin for a `PipelineStage` subclass (put before it): at the first step torch
    runs the stage once to learn the shapes passed between stages; afterwards the stage's
    buffers (batch-norm statistics) are as they were before it, and the random
    generators too (torch forks them itself since 2.12). Each hook wraps the torch method
    of that name; a torch with neither runs its inference as it likes
    (`stage_shape_inference` in `features()`)."""

    submod: nn.Module
    device: torch.device

    # torch 2.12+: forward metadata first, the cleanup after the backward metadata
    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self._buffers_before_inference: list[tuple[torch.Tensor, torch.Tensor]]
        self._buffers_before_inference = _buffer_values(self.submod)
        return super()._forward_metadata_inference(*args, **kwargs)  # type: ignore[misc]

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()  # type: ignore[misc]
        _restore(getattr(self, "_buffers_before_inference", []))
        self._buffers_before_inference = []

    # torch 2.6-2.11: one forward without gradients, the generators not forked
    def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
        before = _buffer_values(self.submod)
        devices = [self.device] if self.device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            outputs = super()._shape_inference(*args, **kwargs)  # type: ignore[misc]
        _restore(before)
        return outputs


class GlooWarmup:
    """A mixin for a `PipelineStage` subclass (put before it): before the first step
    torch 2.9 to 2.11 warms up the links to each stage's neighbours with a send and a
    receive each; made here into one gloo can run. Sends to a neighbour on the same rank
    (a V schedule's two middle stages) are left out, which gloo cannot do (`Pair is not
    connected`; only links between two ranks need warming), and every send is float32,
    as the receive expects (2.9 sent an int64 into a float32 buffer, on which gloo
    aborts). torch 2.12+ warms up by a vote and never calls this; 2.15 has no such
    method."""

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        import torch.distributed as dist

        ops = super()._get_init_p2p_neighbors_ops()  # type: ignore[misc]
        kept = [op for op in ops if op.peer != dist.get_rank()]
        for op in kept:
            if op.op is dist.isend:
                op.tensor = op.tensor.to(torch.float32)
        return kept


def _buffer_values(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.clone()) for b in module.buffers()]


def _restore(values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, value in values:
            buffer.copy_(value)
