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

A Hugging Face causal LM (`model.kind: hf`) is split by its own plan: the decoder
layers by the family's `base_model_tp_plan` (`colwise`, `rowwise`, and the
`colwise_gather_output` / `rowwise_split_input` pairs of fused projections, as torch's
column- and row-parallel styles; `replicated_with_grad_allreduce`, the norms over each
head that qwen3 and gemma3_text put on queries and keys, as `HeadShardedNorm`), the LM
head by its `_tp_plan` (column-parallel over the vocabulary), the token embedding
row-parallel, and every other parameter (the norms over the whole width) replicated:
its rotary embeddings are computed from the sequence a layer sees, so there is no
sequence parallelism and the residual stream stays whole on every rank (one all-reduce
after each row-parallel layer). A plan style not listed here (experts split inside,
`packed_colwise`, `moe_tp_experts`: mixtral, qwen3_moe) is refused in one line naming it.

The spec's checks (`config.layout`) refuse other models and GPT sizes the degree does
not divide before anything starts; pre-flight checks a Hugging Face model's plan and
sizes on the built model (`check_tensor_parallel`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainstack.config import ConfigError, JobConfig
from trainstack.models.gpt import GPT, Block, GPTEmbedding, GPTHead
from trainstack.models.hf import HFCausalLM


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Shard `model`'s layers over `tp_mesh` in place (its parameters become DTensors)."""
    if isinstance(model, HFCausalLM):
        _parallelize_hf(model, tp_mesh, loss_parallel=loss_parallel)
        return
    assert isinstance(model, GPT), "config.layout admits tensor parallelism for GPT and hf"
    # The GPT's pipeline layers hold its own modules: sharding them shards the model.
    apply_tensor_parallel_to_layers(model.pipeline_layers(), tp_mesh, loss_parallel=loss_parallel)


def apply_tensor_parallel_to_layers(
    layers: list[nn.Module], tp_mesh: DeviceMesh, *, loss_parallel: bool = False
) -> None:
    """Shard GPT layers (embedding, blocks, head: the whole model, or a pipeline stage's
    share) over `tp_mesh` in place. Between layers the residual stream is a sequence
    shard (a stage passes its shard to the next: each tensor-parallel rank runs its own
    pipeline); the head gathers whole logits unless `loss_parallel`. Parameters the
    layers shared before (the tied embedding and head) stay shared."""
    shared = _shared_parameters(layers)
    ends = gpt_model_plan(loss_parallel=loss_parallel)
    for layer in layers:
        if isinstance(layer, GPTEmbedding):
            plan = {key: ends[key] for key in ("tok_emb", "pos_emb")}
        elif isinstance(layer, GPTHead):
            plan = {key: ends[key] for key in ("ln_f", "lm_head")}
        else:
            assert isinstance(layer, Block), f"no tensor-parallel plan for {type(layer).__name__}"
            plan = gpt_block_plan()
        parallelize_module(layer, tp_mesh, plan)
    for uses in shared:  # each side was distributed apart: tie them again
        first = uses[0][0].get_parameter(uses[0][1])
        for module, name in uses[1:]:
            setattr(module, name, first)


def _shared_parameters(layers: list[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """Each parameter used under more than one name: its (owning module, attribute) pairs."""
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for layer in layers:
        for module in layer.modules():
            for name, param in module.named_parameters(recurse=False):
                uses.setdefault(id(param), []).append((module, name))
    return [pairs for pairs in uses.values() if len(pairs) > 1]


def check_model_splits(cfg: JobConfig, model: nn.Module) -> None:
    """Pre-flight for `strategy.kind: fsdp`: `strategy.tensor_parallel` divides every size
    the model's plan splits."""
    check_tensor_parallel(model, cfg.strategy.tensor_parallel)


class HeadShardedNorm(ParallelStyle):
    """A norm over each head's features that sees only this rank's heads (what a
    column-parallel projection leaves, viewed as heads): its weight a replicated DTensor,
    its input a DTensor sharded by heads, its output local again. Each rank's share of
    the weight's gradient covers its own heads, so the gradient is a pending sum over
    `tp` (`Partial`), which its consumers finish over the ranks: FSDP2's reduction under
    FSDP × TP; with tensor parallelism alone, `squared_norm` and the optimizer's DTensor
    ops (an all-reduce each time one reads it). The sum is over every head, as in one
    process; the parameter itself stays replicated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_head_shards(_: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
            # Heads sit second to last in qwen3's [B, T, heads, head_dim]; gemma3's
            # [B, heads, T, head_dim] is labelled split by T instead, which changes
            # nothing: the norm works row by row along the last dimension, so its local
            # math and its weight's pending sum are the same whichever other one is split.
            return tuple(
                DTensor.from_local(x, mesh, [Shard(x.ndim - 2)])
                if isinstance(x, torch.Tensor)
                else x
                for x in inputs
            )

        return distribute_module(module, device_mesh, input_fn=to_head_shards, output_fn=_local)


HF_STYLES: dict[str, Any] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": HeadShardedNorm,
}
"""The `base_model_tp_plan` styles trainstack applies, as torch's parallel styles."""
SPLITS = {
    "colwise": "out_features",
    "colwise_gather_output": "out_features",
    "rowwise": "in_features",
    "rowwise_split_input": "in_features",
}
"""Which size of a Linear each style splits (a head-sharded norm splits none)."""


def hf_layer_plan(model: HFCausalLM) -> dict[str, str]:
    """The family's `base_model_tp_plan` for one decoder layer (`layers.*.` dropped);
    ConfigError for a family without one or a style trainstack does not apply yet."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ConfigError(
            f"strategy.tensor_parallel needs the model's base_model_tp_plan, and "
            f"model.hf.model_type={model.family} declares none; use strategy.tensor_parallel=1"
        )
    layer: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in HF_STYLES:
            raise ConfigError(
                f"model.hf.model_type={model.family}: its base_model_tp_plan splits {pattern} "
                f"as {style}, which trainstack does not apply yet (it does: "
                f"{', '.join(HF_STYLES)}); use strategy.tensor_parallel=1"
            )
        if not pattern.startswith("layers.*."):
            raise ConfigError(
                f"model.hf.model_type={model.family}: its base_model_tp_plan names {pattern}, "
                "outside the decoder layers; use strategy.tensor_parallel=1"
            )
        layer[pattern.removeprefix("layers.*.")] = style
    return layer


def check_tensor_parallel(model: nn.Module, degree: int) -> None:
    """Raise ConfigError unless a Hugging Face model's plan applies and `degree` divides
    every size it splits (a GPT's sizes are checked with the spec): with column-parallel
    attention projections, the heads too (each rank views its slice as whole heads)."""
    if degree == 1 or not isinstance(model, HFCausalLM):
        return
    plan = hf_layer_plan(model)
    first = cast(nn.ModuleList, model.body.get_submodule("layers"))[0]
    sizes = {"vocab_size": model.config.vocab_size}
    if any(style == "colwise" and name.startswith("self_attn.") for name, style in plan.items()):
        for key in ("num_attention_heads", "num_key_value_heads"):
            if heads := getattr(model.config, key, None):
                sizes[key] = heads
    for name, style in plan.items():
        if style in SPLITS:
            sizes[f"{name}.{SPLITS[style]}"] = getattr(first.get_submodule(name), SPLITS[style])
    for what, value in sizes.items():
        if value % degree:
            raise ConfigError(
                f"strategy.tensor_parallel={degree} does not divide {model.family}'s {what} = "
                f"{value}, which its plan splits; allowed: a tensor_parallel that divides {value}"
            )


def _parallelize_hf(model: HFCausalLM, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    plan = {name: HF_STYLES[style]() for name, style in hf_layer_plan(model).items()}
    body = model.body
    parallelize_module(
        body,
        tp_mesh,
        {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())},
    )
    for layer in cast(nn.ModuleList, body.get_submodule("layers")):
        parallelize_module(layer, tp_mesh, plan)
    parallelize_module(model, tp_mesh, {"lm_head": _vocabulary_head(loss_parallel, Replicate())})
    if model.config.tie_word_embeddings:
        model.get_submodule("lm_head").weight = body.get_submodule("embed_tokens").weight
    for module in list(model.modules()):  # the rest (norms): whole on every rank
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            _replicate(module, tp_mesh)


def _replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """`module`'s parameters as replicated DTensors over `tp_mesh`, taking and returning
    plain tensors (every rank holds the whole activation)."""

    def to_replicated(_: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()]) if isinstance(x, torch.Tensor) else x
            for x in inputs
        )

    distribute_module(module, tp_mesh, input_fn=to_replicated, output_fn=_local)


def _local(_: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


def _vocabulary_head(loss_parallel: bool, input_layout: Replicate | Shard) -> ColwiseParallel:
    """The LM head split by vocabulary: logits stay sharded for `loss_parallel`."""
    return ColwiseParallel(
        input_layouts=input_layout,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )


def gpt_model_plan(*, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Embeddings in, LM head out: the residual stream leaves and enters split by sequence."""
    return {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        # positions [T] -> [T, C]: each rank gets the rows of its own share of the sequence
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "ln_f": SequenceParallel(),
        "lm_head": _vocabulary_head(loss_parallel, Shard(1)),
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
