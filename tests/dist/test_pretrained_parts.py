"""`model.pretrained` under each layout starts from the logits transformers loads, and the
layouts that shard or cut the model read it rank by rank without ever building it whole.

One tiny qwen2 (tied embedding and head, so `lm_head.weight` is not in the files; saved
in several safetensors files with an index) is loaded by trainstack's own start of a run
(`build_job_model`, `set_up_strategy`) on 2 gloo processes under ddp (each rank loads
it whole), fsdp (each rank reads its shard of every tensor), a 2-stage pipeline (each
rank its stage's tensors) and tensor parallel 2 (each rank its rows or columns); the
loaded model's logits on fixed tokens, before any step, are held to
`AutoModelForCausalLM.from_pretrained` on the same folder, in float64. Under ZBV (rank 0
holds the first stage and the last: both copies of the tie) the stages' weights are held
to the folder's; and a whole fsdp run from the folder to a ddp run from it. Under ZeRO-3
(with and without offload; DeepSpeed trains in fp32 at most, so held to transformers'
fp32 logits) each rank reads its partition of every tensor, the bytes it reads counted:
half the folder each, every byte once between them; under ZeRO-2 each rank reads it all.
A tiny mixtral saved with its experts stacked is read under tensor parallel 2, each rank
taking two blocks of every packed gate_up_proj (its rows of the gate half and of the up
half): its logits are transformers' (read as one block, DCP's own description, the
wrong rows land 0.029 away).
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from trainstack.checkpoint import pretrained
from trainstack.checkpoint.pretrained import SINGLE_FILE
from trainstack.compat import torch as torch_compat
from trainstack.config import config_from_dict
from trainstack.models.on_meta import has_meta_parameters
from trainstack.runtime.gloo_processes import rendezvous, run_processes
from trainstack.runtime.loop import build_job_model, set_up_strategy
from trainstack.strategies import WorkerContext, build_strategy
from trainstack.strategies.dtensor_state import local_part
from trainstack.strategies.pipeline_split import recv_activation, send_activation

from bounds import FP64_BOUND, MOVED, max_difference
from user_model_specs import HF_WIDTHS

VOCAB, SEQ = 16, 16
WIDTHS = HF_WIDTHS
LOGITS_BOUND = 1e-10
"""float64 on both sides: the same weights through the same math (the pipeline through
the family's plan layers) differ by rounding alone, about 1e-16; a wrong slice, a
skipped tie or a random start differs by 1e-2 and more."""
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "fsdp": {"kind": "fsdp"},
    "pipeline": {"kind": "pipeline", "stages": 2, "microbatches": 2},
    "tensor_parallel": {"kind": "fsdp", "tensor_parallel": 2},  # parts of columns too
    # 4 stages folded back: rank 0 holds the first and the last, both copies of the tie
    "zbv": {"kind": "pipeline", "stages": 2, "schedule": "zbv", "microbatches": 2},
    # DeepSpeed trains in fp32 at most: held to transformers' fp32 logits (ZERO_BOUND)
    "zero3": {"kind": "zero", "stage": 3},
    "zero3_offload": {
        "kind": "zero",
        "stage": 3,
        "offload_optimizer": "cpu",
        "offload_param": "cpu",
    },
    "zero2": {"kind": "zero", "stage": 2},
}
ZERO_BOUND = 1e-5
"""float32 on both sides, the same weights through the same math (DeepSpeed's own linear
under ZeRO-3): rounding alone (0 here); each rank reading the other's run differs by 0.43."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save_pretrained qwen2 with tied weights, in several files and an index."""
    import transformers

    path = tmp_path_factory.mktemp("pretrained") / "qwen2"
    config = transformers.Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=True, **WIDTHS)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def tokens() -> torch.Tensor:
    return torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def spec(layout: str, folder: Path, storage: Path) -> dict[str, Any]:
    return {
        "name": f"pretrained-{layout}",
        "model": {"kind": "hf", "pretrained": str(folder), "block_size": SEQ},
        "data": {"vocab_size": VOCAB, "order": 1},
        "train": {
            "steps": 1,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "precision": "fp32" if LAYOUTS[layout]["kind"] == "zero" else "fp64",
        },
        "optim": {"warmup_steps": 0},
        "strategy": LAYOUTS[layout],
        "scaling": {"num_workers": 2},
        "checkpoint": {"storage_path": str(storage)},
    }


def _worker(rank: int, raw: dict[str, Any], init_method: str, out: str) -> None:
    import transformers

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    whole_loads = []
    load = transformers.AutoModelForCausalLM.from_pretrained

    def counted(*args: Any, **kwargs: Any) -> Any:
        whole_loads.append(args)
        return load(*args, **kwargs)

    transformers.AutoModelForCausalLM.from_pretrained = counted  # type: ignore[method-assign]
    bytes_read = [0]
    read_into = pretrained._read_into

    def counted_read(f: Any, view: memoryview) -> None:  # every read of a saved tensor's bytes
        bytes_read[0] += len(view)
        read_into(f, view)

    pretrained._read_into = counted_read  # type: ignore[assignment]
    try:
        cfg = config_from_dict(raw)
        ctx = WorkerContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
        strategy = build_strategy(cfg, ctx)
        model = build_job_model(cfg, strategy)
        built_on_meta = has_meta_parameters(model)
        total = sum(p.numel() for p in model.parameters())
        set_up_strategy(cfg, strategy, model)
        held = strategy.unwrapped_model().eval()
        with torch.no_grad():
            if cfg.strategy.schedule == "zbv":  # its weights, held to the folder's
                logits = None
            elif cfg.strategy.kind == "pipeline":  # stage 0 on rank 0, stage 1 on rank 1
                (stage,) = held.children()
                if rank == 0:
                    send_activation(stage(tokens()), dst=1)
                    logits = None
                else:
                    logits = stage(recv_activation(src=0, device=ctx.device))
            else:
                logits = held(tokens())
                if isinstance(logits, DTensor):  # sharded by vocabulary (loss_parallel)
                    logits = logits.full_tensor()
        result = {
            "logits": logits,
            "stages": {k: v for k, v in strategy.checkpoint_files().items() if "model" in k},
            "built_on_meta": built_on_meta,
            "whole_loads": len(whole_loads),
            "params": total,
            "held": sum(_held(p).numel() for p in held.parameters()),
            "bytes_read": bytes_read[0],
        }
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _held(p: torch.Tensor) -> torch.Tensor:
    """What this rank stores of a parameter: a DTensor's local shard, a ZeRO-3
    parameter's partition (`ds_tensor`), else the tensor."""
    partition = getattr(p, "ds_tensor", None)
    return partition if partition is not None else local_part(p)


_RUNS: dict[tuple[str, Path], list[dict[str, Any]]] = {}


def loaded(
    layout: str, folder: Path, tmp_path: Path, *, hf: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Each rank's results of loading `folder` under `layout` (with `model.hf` settings
    `hf`), once per module."""
    if (layout, folder) not in _RUNS:
        out = tmp_path / layout
        out.mkdir(parents=True)
        raw = spec(layout, folder, tmp_path / "runs")
        raw["model"]["hf"] = hf or {}
        multiprocessing.set_forkserver_preload(["trainstack.runtime.gloo_processes"])
        args = (raw, rendezvous(out), str(out))
        mp.start_processes(_worker, args=args, nprocs=2, start_method="forkserver")
        runs = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
        _RUNS[(layout, folder)] = runs
    return _RUNS[(layout, folder)]


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "pipeline", "tensor_parallel"])
def test_a_pretrained_model_starts_from_the_logits_transformers_loads(
    layout: str, folder: Path, tmp_path: Path
) -> None:
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    with torch.no_grad():
        theirs = reference.to(torch.float64).eval()(input_ids=tokens()).logits
    ranks = loaded(layout, folder, tmp_path)
    last = 1 if layout == "pipeline" else 0
    for rank in (0, 1) if layout != "pipeline" else (last,):
        ours = ranks[rank]["logits"]
        diff = float((ours - theirs).abs().max())
        print(f"{layout} rank {rank}: max |logit difference| {diff:.3g}")
        assert diff < LOGITS_BOUND


@pytest.fixture(scope="module")
def stacked_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A mixtral saved with its experts stacked as the model holds them (`gate_up_proj`
    [E, 2·I, H], gate and up halves packed): what a rank under tensor parallelism reads
    its two blocks of. (transformers' save_pretrained writes them per expert, names it
    converts while loading: such a folder loads whole, `build_hf_model`.)"""
    import transformers
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("pretrained") / "mixtral"
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2, **WIDTHS
    )
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / SINGLE_FILE)
    return path


def test_mixtrals_experts_under_tensor_parallel_read_their_slices_of_gate_and_up(
    stacked_mixtral: Path, tmp_path: Path
) -> None:
    """Tensor parallel 2 on the stacked mixtral: each rank reads, of every expert's packed
    gate_up_proj, its rows of the gate half and of the up half (two blocks of the saved
    tensor) and its columns of down_proj, built on meta and never loaded whole; its
    logits are transformers' on the same folder, in float64."""
    import transformers

    eager = {"experts_implementation": "eager"}  # grouped matmuls take no float64
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        stacked_mixtral, local_files_only=True, **eager
    )
    with torch.no_grad():
        theirs = reference.to(torch.float64).eval()(input_ids=tokens()).logits
    ranks = loaded("tensor_parallel", stacked_mixtral, tmp_path, hf=eager)
    for rank, result in enumerate(ranks):
        assert result["built_on_meta"] and result["whole_loads"] == 0
        assert result["held"] / result["params"] < 0.75
        diff = float((result["logits"] - theirs).abs().max())
        print(f"mixtral tensor parallel rank {rank}: max |logit difference| {diff:.3g}")
        assert diff < LOGITS_BOUND


def test_zbv_stages_on_one_rank_both_read_their_copy_of_the_tie(
    folder: Path, tmp_path: Path
) -> None:
    """ZBV: rank 0 holds the embedding's stage and the head's, rank 1 the two blocks;
    every stage's weights are the folder's (the head's copy is the saved embedding)."""
    if not torch_compat.feature("zbv_on_gloo").available:
        pytest.skip(f"torch {torch.__version__} runs no zbv on gloo (pre-flight refuses it)")
    saved = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    saved["lm_head.weight"] = saved["model.embed_tokens.weight"]
    ranks = loaded("zbv", folder, tmp_path)
    assert all(r["built_on_meta"] and r["whole_loads"] == 0 for r in ranks)
    stages = {k: v for rank in ranks for k, v in rank["stages"].items()}
    assert len(stages) == 4
    weights = {k: v for state in stages.values() for k, v in state.items()}
    assert weights.keys() == saved.keys()
    unequal = [k for k, v in weights.items() if not torch.equal(v, saved[k].to(v.dtype))]
    assert not unequal  # (bounds.max_difference would let an unread tensor's NaNs through)


@pytest.mark.parametrize("layout", ["fsdp", "pipeline", "tensor_parallel"])
def test_a_sharding_layout_never_loads_the_whole_model_on_a_rank(
    layout: str, folder: Path, tmp_path: Path
) -> None:
    """Built with its parameters on the meta device, never through from_pretrained (the
    whole load, which ddp uses: the probe counts), each rank given storage for about
    half of the model only."""
    ranks = loaded(layout, folder, tmp_path)
    assert [r["whole_loads"] for r in loaded("ddp", folder, tmp_path)] == [1, 1]
    for rank, result in enumerate(ranks):
        share = result["held"] / result["params"]
        print(f"{layout} rank {rank}: holds {result['held']} of {result['params']} ({share:.2f})")
        assert result["built_on_meta"] and result["whole_loads"] == 0
        assert share < 0.75


def test_fsdp_from_a_pretrained_folder_trains_what_ddp_trains_from_it(
    folder: Path, tmp_path: Path
) -> None:
    """The whole run (pre-flight, FLOPs counted without storage, steps, checkpoints):
    3 steps of fsdp reading its shards = ddp loading the whole model, in float64."""
    weights = {}
    for layout in ("ddp", "fsdp"):
        raw = spec(layout, folder, tmp_path / layout)
        raw["train"] |= {"steps": 3, "micro_batch_size": 1}
        raw["optim"] |= {"lr": 1e-2}
        raw["log"] = {"every_steps": 3}
        run_processes(config_from_dict(raw), world_size=2, out_dir=tmp_path / f"{layout}-out")
        weights[layout] = torch.load(tmp_path / f"{layout}-out" / "model.pt", weights_only=True)
    assert all(bool(torch.isfinite(v).all()) for v in weights["fsdp"].values())
    assert max_difference(weights["fsdp"], weights["ddp"]) < FP64_BOUND
    start = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    assert max_difference({k: weights["ddp"][k] for k in start}, start) > MOVED


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("layout", ["zero3", "zero3_offload"])
def test_zero3_ranks_read_only_their_partitions_and_start_from_transformers_logits(
    layout: str, folder: Path, tmp_path: Path
) -> None:
    """ZeRO-3 (with and without offload) builds the model on the meta device, partitions
    it before DeepSpeed's engine is built, and each rank reads its partition of every
    saved tensor: the ranks' reads add up to the folder's bytes, each byte once, so each
    reads half of it; the logits equal transformers' (fp32), and the full weights gathered
    from the optimizer's fp32 master partitions equal the folder's."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    with torch.no_grad():
        theirs = reference.eval()(input_ids=tokens()).logits
    saved = saved_weights(folder)
    folder_bytes = sum(v.numel() * v.element_size() for v in saved.values())
    ranks = loaded(layout, folder, tmp_path)
    for rank, result in enumerate(ranks):
        diff = float((result["logits"] - theirs).abs().max())
        share = result["held"] / result["params"]
        print(
            f"{layout} rank {rank}: max |logit difference| {diff:.3g}; read "
            f"{result['bytes_read']} of the folder's {folder_bytes} bytes; holds "
            f"{result['held']} of {result['params']} parameters ({share:.2f})"
        )
        assert result["built_on_meta"] and result["whole_loads"] == 0
        assert diff < ZERO_BOUND
        assert result["bytes_read"] < 0.6 * folder_bytes and share < 0.6
    assert sum(r["bytes_read"] for r in ranks) == folder_bytes
    weights = ranks[0]["stages"]["model.pt"]  # gathered from the fp32 master partitions
    saved["lm_head.weight"] = saved["model.embed_tokens.weight"]
    assert weights.keys() == saved.keys()
    assert not [k for k, v in weights.items() if not torch.equal(v, saved[k])]


def test_zero2_ranks_read_the_whole_folder_into_a_model_built_on_meta(
    folder: Path, tmp_path: Path
) -> None:
    """Stages 1-2 keep every parameter whole on every rank: each rank reads the whole
    folder (once) into the model built on the meta device, and starts from transformers'
    logits."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    with torch.no_grad():
        theirs = reference.eval()(input_ids=tokens()).logits
    folder_bytes = sum(v.numel() * v.element_size() for v in saved_weights(folder).values())
    for result in loaded("zero2", folder, tmp_path):
        assert result["built_on_meta"] and result["whole_loads"] == 0
        assert result["bytes_read"] == folder_bytes
        assert float((result["logits"] - theirs).abs().max()) < ZERO_BOUND
