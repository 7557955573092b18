"""trainstack.compat.torch: every private torch feature, checked on this torch and
with its name taken away (monkeypatch), and each fallback doing what the feature does: a
strided shard's positions, computed by checkpoint/blocks.py's own arithmetic, equal
torch's own layout and offsets on many shapes and each rank's local part on a fake
process group; DDP leaves hidden experts out either way; a module's parameters are
swapped and put back in their order either way; a pipeline stage's shape inference
leaves its buffers (and, before torch 2.12, the random generators) as they were; what
cannot work without its feature is refused in one line naming the torch it needs."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, placement_types
from torch.nn.parallel import DistributedDataParallel

from trainstack.checkpoint.blocks import (
    held_indices,
    local_blocks,
    shard_positions,
    strided_shard_positions,
)
from trainstack.compat import torch as torch_compat
from trainstack.compat.torch import TorchFeatureMissing
from trainstack.config import ConfigError
from trainstack.models.flops import count_training_flops, cpu_attention_formulas
from trainstack.strategies.comm_count import CollectiveBytes
from trainstack.strategies.mesh import flattened_group

NESTED_STRIDED_LAYOUT = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 10)
"""torch 2.10+ lays an uneven strided shard out as pieces each cut over the ranks (what
blocks.py computes); 2.9 cut it into split_factor x chunks pieces, 2.5-2.8 refused it."""

CASES = [
    (size, chunks, split_factor)
    for size in range(13)
    for chunks in (1, 2, 3, 4)
    for split_factor in (1, 2, 3)
    if NESTED_STRIDED_LAYOUT or size % (chunks * split_factor) == 0
]


PACKAGE = Path(__file__).resolve().parents[2] / "platform" / "trainstack"
TORCH_HOOKS = {
    # torch's private names trainstack used before compat held them: methods and
    # attributes (reached on torch's objects), and the hooks a subclass overrides
    "_flatten",
    "_set_params_and_buffers_to_ignore_for_model",
    "_make_subclass",
    "_parameters",
    "_buffers",
    "_PipelineSchedule",
    "_resolve_process_group",
    "_StridedShard",
    "_StridedShardOffsetMode",
    "_local_shard_size_and_offset",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
}
TORCH_OVERRIDES = {
    "_shape_inference",
    "_forward_metadata_inference",
    "_post_metadata_inference_cleanup",
    "_get_init_p2p_neighbors_ops",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_torch_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) for every private torch name `tree` imports, reaches or overrides."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [*(node.module or "").split("."), *(a.name for a in node.names)]
            if any(_private(n) for n in names):
                yield node.lineno, f"from {node.module} import ..."
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(
                    _private(n) for n in alias.name.split(".")
                ):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            rooted = isinstance(value, ast.Name) and value.id == "torch"
            reached = node.attr in TORCH_HOOKS | TORCH_OVERRIDES
            if reached or (rooted and any(_private(n) for n in chain)):
                yield node.lineno, ".".join(reversed(chain))
        elif isinstance(node, ast.FunctionDef) and node.name in TORCH_OVERRIDES:
            yield node.lineno, f"def {node.name}"


def test_no_module_outside_compat_names_a_private_torch_name() -> None:
    """The rule (docs: DESIGN.md): a private torch name lives in compat/torch.py
    alone; docstrings may speak of them, code may not reach them."""
    offenders = [
        f"{path.relative_to(PACKAGE)}:{line}: {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.parent.name != "compat"
        for line, what in _private_torch_names(ast.parse(path.read_text()))
    ]
    assert offenders == []


def test_importing_the_compat_module_imports_nothing_of_torch_beyond_torch_itself() -> None:
    """Every private name is imported when a function needs it, never with the module."""
    code = (
        "import sys, torch; before = set(sys.modules); import trainstack.compat.torch; "
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def test_this_torch_has_exactly_the_features_its_release_is_in_the_range_of() -> None:
    """Each feature says which torch releases have it (read in each release's source)
    and what trainstack does without it (`trainstack doctor`); the installed torch has
    exactly those whose range it is in."""
    found = torch_compat.features()
    assert len({f.name for f in found}) == len(found)
    installed = _release(torch.__version__)
    for f in found:
        assert re.fullmatch(r"2\.\d+", f.since) and f.uses and f.fallback and f.torch_name, f
        within = _release(f.since) <= installed and (
            f.until is None or installed <= _release(f.until)
        )
        assert f.available == within, f"{f.name} ({f.torch_name}) on torch {torch.__version__}"
        assert torch_compat.feature(f.name) is f


# ---- a strided shard's positions: our arithmetic, torch's layout ------------------------


def test_shard_positions_are_torch_chunks() -> None:
    for size, chunks, _ in CASES:
        pieces = list(torch.arange(size).chunk(chunks)) if size else []
        for rank in range(chunks):
            theirs = pieces[rank].tolist() if rank < len(pieces) else []
            assert shard_positions(size, chunks, rank) == theirs, (size, chunks, rank)


def test_strided_shard_positions_are_torchs_own_layout() -> None:
    """Each rank's positions are what torch's `_StridedShard` cuts an arange into (the
    layout itself, on every torch that has strided shards)."""
    strided = placement_types._StridedShard
    for size, chunks, split_factor in CASES:
        shards, _ = strided(0, split_factor=split_factor)._split_tensor(
            torch.arange(size), chunks, with_padding=False
        )
        for rank in range(chunks):
            ours = strided_shard_positions(size, chunks, rank, split_factor=split_factor)
            assert ours == shards[rank].tolist(), (size, chunks, split_factor, rank)


def test_strided_shard_positions_equal_torchs_offsets_where_torch_has_them() -> None:
    """torch 2.13's `_StridedShardOffsetMode.ALL` (2.10-2.12: `return_first_offset=False`)
    gives the same positions blocks.py computes without it."""
    strided = placement_types._StridedShard
    mode = getattr(placement_types, "_StridedShardOffsetMode", None)
    if mode is not None:
        offsets = {"offset_mode": mode.ALL}
    elif NESTED_STRIDED_LAYOUT:
        offsets = {"return_first_offset": False}
    else:
        pytest.skip(f"torch {torch.__version__} has no strided shard offsets")
    for size, chunks, split_factor in CASES:
        placement = strided(0, split_factor=split_factor)
        for rank in range(chunks):
            length, theirs = placement._local_shard_size_and_offset(size, chunks, rank, **offsets)
            ours = strided_shard_positions(size, chunks, rank, split_factor=split_factor)
            assert (len(ours), ours) == (length, list(theirs)), (size, chunks, split_factor, rank)


LAYOUTS: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]] = [
    # (mesh, whole shape, placements)
    ((4,), (2, 8, 3), ("packed",)),
    ((2, 2), (4, 8, 6), (Replicate(), "packed")),
    ((2, 2), (4, 8, 6), (Shard(0), "packed")),
    ((2, 2), (3, 8, 6), (Shard(0), "packed")),
    ((2, 2), (4, 8, 6), ("fsdp's own", Shard(0))),
    ((2, 2), (5, 7, 3), (Shard(1), Shard(1))),
    ((2, 2), (4, 8, 6), (Replicate(), Shard(2))),
]
if NESTED_STRIDED_LAYOUT:
    LAYOUTS.append(((2, 2), (3, 6, 2), (Shard(0), "packed")))  # 3 rows a half: 2 and 1


def _placements(named: tuple[Any, ...]) -> tuple[Any, ...]:
    strided = {
        "packed": torch_compat.strided_shard(1, split_factor=2),
        "fsdp's own": torch_compat.strided_shard(0, split_factor=2),
    }
    return tuple(strided.get(p, p) if isinstance(p, str) else p for p in named)


@pytest.fixture
def without_offset_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on torch 2.11, which has no `_StridedShardOffsetMode`."""
    monkeypatch.delattr(placement_types, "_StridedShardOffsetMode", raising=False)


@pytest.mark.usefixtures("without_offset_mode")
@pytest.mark.parametrize(("mesh_shape", "shape", "named"), LAYOUTS)
def test_held_indices_are_each_ranks_local_part(
    mesh_shape: tuple[int, ...], shape: tuple[int, ...], named: tuple[Any, ...]
) -> None:
    """On a fake process group, as each rank of the mesh in turn: the indices blocks.py
    computes pick out of the whole tensor exactly the local part DTensor gives that rank
    (the cut without communication), with no `_StridedShardOffsetMode` in torch."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    world = torch.Size(mesh_shape).numel()
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            tensor = distribute_tensor(full, mesh, _placements(named), src_data_rank=None)
            picked = full[torch.meshgrid(*held_indices(tensor), indexing="ij")]
            assert torch.equal(picked, tensor.to_local()), (named, rank)
            for offsets, sizes, at in local_blocks(tensor):
                theirs, ours = full, tensor.to_local()
                for dim, (start, size, here) in enumerate(zip(offsets, sizes, at, strict=True)):
                    theirs, ours = theirs.narrow(dim, start, size), ours.narrow(dim, here, size)
                assert torch.equal(theirs, ours), (named, rank, offsets)
        finally:
            dist.destroy_process_group()


# ---- strided shards: present, and taken away -------------------------------------------


def test_a_strided_shard_is_built_and_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = torch_compat.strided_shard(1, split_factor=2)
    assert torch_compat.strided_split_factor(packed) == 2
    assert torch_compat.strided_split_factor(Shard(1)) is None
    assert torch_compat.strided_split_factor(Replicate()) is None
    monkeypatch.delattr(placement_types, "_StridedShard")
    assert not torch_compat.feature("strided_shard").available
    assert torch_compat.strided_split_factor(packed) is None  # no strided shard exists then
    needs = torch_compat.feature("strided_shard").needs
    with pytest.raises(TorchFeatureMissing, match=rf"needs {needs} .*_StridedShard"):
        torch_compat.strided_shard(1, split_factor=2)


def test_tensor_parallel_experts_without_strided_shards_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("transformers")
    from trainstack.config import config_from_dict
    from trainstack.models import build_model
    from trainstack.strategies.tensor_parallel import check_tensor_parallel

    hf = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 1}
    hf |= {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}
    hf |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    raw = {"model": {"kind": "hf", "hf": hf, "block_size": 16}, "data": {"vocab_size": 16}}
    model = build_model(config_from_dict(raw).model, vocab_size=16, seed=0)
    check_tensor_parallel(model, 2)  # this torch has them
    monkeypatch.delattr(placement_types, "_StridedShard")
    with pytest.raises(ConfigError) as refused:
        check_tensor_parallel(model, 2)
    line = str(refused.value)
    needs = torch_compat.feature("strided_shard").needs
    assert "\n" not in line and needs in line and torch.__version__ in line, line
    assert "strategy.tensor_parallel=1" in line, line


# ---- counting collectives -----------------------------------------------------------------


def test_operators_are_seen_where_torch_has_dispatch_modes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    mode = torch_compat.collective_dispatch_mode(lambda name, args: seen.append(name))
    assert mode is not None and CollectiveBytes().counting
    with mode:
        torch.ones(2).add(1)
    assert "aten.add" in seen
    import torch.utils._python_dispatch as python_dispatch

    monkeypatch.delattr(python_dispatch, "TorchDispatchMode")
    assert not torch_compat.feature("dispatch_mode").available
    assert torch_compat.collective_dispatch_mode(lambda name, args: None) is None
    counter = CollectiveBytes()
    with counter:  # counts nothing, breaks nothing: fsdp models its bytes
        torch.ones(2).add(1)
    assert not counter.counting and counter.sent == 0


def test_without_group_names_nothing_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.delattr(c10d, "_resolve_process_group")
    assert not torch_compat.feature("group_by_name").available
    assert not CollectiveBytes().counting


# ---- FLOPs --------------------------------------------------------------------------------


def test_flops_of_a_meta_model_without_fake_tensors_are_six_per_parameter_and_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch._subclasses.fake_tensor as fake_tensor

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    batch = (torch.randint(16, (2, 5)), torch.randint(16, (2, 5)))
    assert torch_compat.fake_tensor_mode() is not None
    monkeypatch.delattr(fake_tensor, "FakeTensorMode")
    assert torch_compat.fake_tensor_mode() is None
    assert not torch_compat.feature("fake_tensors").available
    params = 16 * 8 + 8 * 16 + 16
    assert count_training_flops(model, batch, task=cast(Any, None)) == 6 * params * 10


def test_cpu_attention_is_counted_where_torch_names_its_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert len(cpu_attention_formulas()) == 2
    monkeypatch.setattr(torch_compat, "_CPU_ATTENTION_OPS", ("_no_such_op", "_no_such_op_bw"))
    assert torch_compat.cpu_attention_ops() is None and cpu_attention_formulas() == {}
    assert not torch_compat.feature("cpu_attention_ops").available


# ---- modules' parameters ------------------------------------------------------------------


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("torch_has_it", [True, False])
def test_ddp_leaves_hidden_parameters_out_and_the_model_as_it_was(
    torch_has_it: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not torch_has_it:
        ignore = "_set_params_and_buffers_to_ignore_for_model"
        monkeypatch.delattr(DistributedDataParallel, ignore)
        assert not torch_compat.feature("ddp_ignore").available
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    before = list(model.named_parameters())
    with torch_compat.hidden_from_ddp(model, ["2.weight"]):
        ddp = DistributedDataParallel(model)
    reduced: set[int] = set()

    def record(_, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        reduced.update(id(p) for p in bucket.parameters())
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    ddp.register_comm_hook(None, record)
    ddp(torch.randn(5, 3)).sum().backward()
    params = dict(before)
    assert list(model.named_parameters()) == before  # the same objects, in their order
    assert id(params["2.weight"]) not in reduced and params["2.weight"].grad is not None
    assert reduced == {id(p) for name, p in before if name != "2.weight"}


@pytest.mark.parametrize("torch_has_it", [True, False])
def test_parameters_replaced_inside_and_put_back_in_order(
    torch_has_it: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not torch_has_it:
        monkeypatch.setattr(torch_compat, "_has_parameter_table", lambda module: False)
    layer = nn.Linear(3, 2)
    before = list(layer.named_parameters())
    x = torch.randn(4, 3)
    doubled = layer.weight * 2
    with torch_compat.parameters_replaced(layer, {"weight": doubled}):
        assert layer.weight is doubled
        out = layer(x)
    assert torch.equal(out, F.linear(x, doubled, layer.bias))
    out.sum().backward()  # through the replacement to the parameter
    assert torch.allclose(layer.weight.grad, 2 * x.sum(0).expand(2, 3))
    assert list(layer.named_parameters()) == before
    assert isinstance(layer.weight, nn.Parameter)


# ---- pipeline stages' shape inference ------------------------------------------------------


class _Stage:
    """What a PipelineStage's shape inference does to its module: a forward in training
    mode, which moves the batch-norm statistics and draws from the random generator."""

    def __init__(self) -> None:
        self.submod = nn.Sequential(nn.BatchNorm1d(3), nn.Dropout(0.5))
        self.device = torch.device("cpu")

    def _run(self) -> str:
        self.submod.train()
        self.submod(torch.randn(4, 3) + 5)
        return "shapes"

    def _shape_inference(self, *args: Any) -> str:  # torch 2.6-2.11
        return self._run()

    def _forward_metadata_inference(self, *args: Any) -> str:  # torch 2.12+
        return self._run()

    def _post_metadata_inference_cleanup(self) -> None:
        pass


class _QuietStage(torch_compat.ShapeInferenceLeavesNoTrace, _Stage):
    pass


@pytest.mark.parametrize("torch_hooks", ["_shape_inference", "_forward_metadata_inference"])
def test_shape_inference_leaves_buffers_and_generators_as_they_were(torch_hooks: str) -> None:
    stage = _QuietStage()
    buffers = [b.clone() for b in stage.submod.buffers()]
    rng = torch.get_rng_state()
    assert getattr(stage, torch_hooks)() == "shapes"
    if torch_hooks == "_forward_metadata_inference":
        stage._post_metadata_inference_cleanup()
        torch.set_rng_state(rng)  # torch 2.12+ forks the generators around both itself
    assert all(torch.equal(a, b) for a, b in zip(buffers, stage.submod.buffers(), strict=True))
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_stage_hooks_are_found_and_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.pipelining import PipelineStage

    assert torch_compat.feature("stage_shape_inference").available
    for hook in ("_shape_inference", "_forward_metadata_inference"):
        for klass in PipelineStage.__mro__:
            if hook in vars(klass):
                monkeypatch.delattr(klass, hook)
    assert not torch_compat.feature("stage_shape_inference").available


class _Warmup:
    """torch 2.9's warm-up: float32 receives, int64 sends, to and from either rank."""

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        send, recv = torch.tensor(3), torch.zeros(1)
        ops = [(dist.irecv, recv, 0), (dist.isend, send, 0), (dist.irecv, recv, 1)]
        ops += [(dist.isend, send, 1)]
        return [SimpleNamespace(op=op, tensor=t, peer=peer) for op, t, peer in ops]


class _GlooWarmup(torch_compat.GlooWarmup, _Warmup):
    pass


@pytest.mark.usefixtures("one_rank")
def test_the_links_are_warmed_up_as_gloo_can() -> None:
    """Nothing sent by this rank (0) to itself; every send float32, as receives expect."""
    ops = _GlooWarmup()._get_init_p2p_neighbors_ops()
    assert [(op.op, op.peer) for op in ops] == [(dist.irecv, 1), (dist.isend, 1)]
    assert all(op.tensor.dtype == torch.float32 for op in ops)
    assert float(ops[1].tensor) == 3


def test_a_schedules_plan_is_read_as_compute_actions(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own `_Action`s (their kinds' values differ before and after 2.11), sends,
    receives and a None slot left out; a schedule without a plan gives None."""
    from torch.distributed.pipelining import schedules

    act = schedules._Action
    plan = {
        0: [act(0, schedules.FORWARD, 0), None, act(0, schedules.SEND_F, 0)],
        1: [act(1, schedules.FULL_BACKWARD, 0), act(1, schedules.BACKWARD_INPUT, 1)],
        2: [act(2, schedules.BACKWARD_WEIGHT, 1)],
    }
    schedule = SimpleNamespace(pipeline_order=plan)
    assert torch_compat.schedule_compute_actions(schedule) == {
        0: [("F", 0, 0)],
        1: [("B", 1, 0), ("I", 1, 1)],
        2: [("W", 2, 1)],
    }
    assert torch_compat.schedule_compute_actions(SimpleNamespace()) is None
    assert torch_compat.feature("schedule_plan").available
    monkeypatch.delattr(schedules, "FULL_BACKWARD")
    assert not torch_compat.feature("schedule_plan").available


def test_schedules_this_torch_cannot_run_are_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainstack.config import config_from_dict
    from trainstack.strategies.pipeline_split import check_schedule_runs_here

    def spec(schedule: str, *, use_gpu: bool = False) -> Any:
        strategy = {"kind": "pipeline", "stages": 2, "microbatches": 4, "schedule": schedule}
        return config_from_dict(
            {
                "model": {"kind": "gpt", "n_layer": 4},
                "train": {"global_batch_size": 32, "micro_batch_size": 8},
                "strategy": strategy,
                "scaling": {"num_workers": 2, "use_gpu": use_gpu},
            }
        )

    if torch_compat.feature("zbv_on_gloo").available:
        check_schedule_runs_here(spec("zbv"))
    monkeypatch.setattr(torch_compat, "_release", lambda: (2, 9))
    assert not torch_compat.feature("zbv_on_gloo").available
    with pytest.raises(ConfigError) as refused:
        check_schedule_runs_here(spec("zbv"))
    line = str(refused.value)
    assert "\n" not in line and "torch>=2.10" in line and "strategy.schedule=" in line, line
    check_schedule_runs_here(spec("zb_interleaved"))  # the others run
    check_schedule_runs_here(spec("zbv", use_gpu=True))  # NCCL takes a rank's own sends
    from torch.distributed.pipelining import schedules

    if torch_compat.feature("dualpipev").available:
        check_schedule_runs_here(spec("dualpipev"))
        monkeypatch.delattr(schedules, "ScheduleDualPipeV")
    assert not torch_compat.feature("dualpipev").available
    with pytest.raises(ConfigError) as refused:
        check_schedule_runs_here(spec("dualpipev"))
    line = str(refused.value)
    assert "\n" not in line and "torch>=2.9" in line and "ScheduleDualPipeV" in line, line


# ---- DeviceMesh._flatten's public stand-in -------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "names"),
    [
        ((2, 2, 2), ("dp_replicate", "dp_shard", "tp")),
        ((2, 2, 3, 1), ("pp", "dp_replicate", "dp_shard", "tp")),
        ((3, 2, 1, 2), ("pp", "dp_replicate", "dp_shard", "tp")),
    ],
)
def test_flattened_group_holds_the_ranks_torchs_flatten_would(
    shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    """The public stand-in for `DeviceMesh._flatten`: this rank's replicas, the ranks
    sharing its every other coordinate, in mesh order (torch's own where it has it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    replicas = ("dp_replicate", "dp_shard")
    world = torch.Size(shape).numel()
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            ours = dist.get_process_group_ranks(flattened_group(mesh, replicas))
            others = [d for d, name in enumerate(names) if name not in replicas]
            mine = [
                r
                for r in range(world)
                if all(_at(mesh, r)[d] == _at(mesh, rank)[d] for d in others)
            ]
            assert ours == mine, (rank, ours, mine)
            # torch's own, to compare (2.9 keeps flattened meshes across process groups:
            # on a fake group made again for each rank it names one destroyed)
            if hasattr(mesh, "_flatten") and _release(torch.__version__) >= (2, 10):
                theirs = mesh[replicas]._flatten("dp").get_group()
                assert ours == dist.get_process_group_ranks(theirs)
        finally:
            dist.destroy_process_group()


def _at(mesh: Any, rank: int) -> list[int]:
    """`rank`'s coordinates on `mesh`."""
    return [int(x) for x in (mesh.mesh == rank).nonzero()[0]]
