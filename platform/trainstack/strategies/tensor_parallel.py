"""Tensor parallelism: Megatron-style plans applied with torch.distributed.tensor.parallel.

Inside a block, the attention's query/key/value projections and the MLP's first layer
are column-parallel (each rank computes its own heads, its own slice of the hidden
width) and the output projections row-parallel, so a block costs one reduction in the
forward pass. With sequence parallelism the residual stream between blocks is split
along the sequence: the norms and dropouts run on each rank's share of the tokens, the
column-parallel layers all-gather their input and the row-parallel ones reduce-scatter
their output (an all-reduce split in two halves, nothing more on the wire).

The token and position embeddings are row-parallel (split by token id and by position)
and hand the first block a sequence shard; the LM head is column-parallel over the
vocabulary and stays tied to the token embedding (both hold rows of the same [V, C]
table, sharded the same way). With `loss_parallel` the logits stay vocabulary-sharded
and cross-entropy runs on the shards (`torch.distributed.tensor.parallel.loss_parallel`).

Plans exist for trainstack's GPT (`config_layout.TENSOR_PARALLEL_MODELS`); the spec's
checks refuse other models and sizes the degree does not divide before anything starts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainstack.models.gpt import GPT


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Shard `model`'s layers over `tp_mesh` in place (its parameters become DTensors)."""
    assert isinstance(model, GPT), "config_layout admits tensor parallelism for the GPT only"
    parallelize_module(model, tp_mesh, gpt_model_plan(loss_parallel=loss_parallel))
    for block in model.blocks:
        parallelize_module(block, tp_mesh, gpt_block_plan())
    model.lm_head.weight = model.tok_emb.weight  # each side was distributed apart: re-tie


def gpt_model_plan(*, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Embeddings in, LM head out: the residual stream leaves and enters split by sequence."""
    return {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        # positions [T] -> [T, C]: each rank gets the rows of its own share of the sequence
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def gpt_block_plan() -> dict[str, ParallelStyle]:
    """One transformer block: sequence-parallel norms, column- then row-parallel layers."""
    gather_sequence = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    return {
        "ln_1": SequenceParallel(),
        "attn": gather_sequence,
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp": gather_sequence,
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
