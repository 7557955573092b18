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
after each row-parallel layer). A mixture of experts' stacked experts (`moe_tp_experts`,
its `gate_up_proj` `packed_colwise` and its `down_proj` `rowwise`: mixtral, qwen2_moe,
qwen3_moe) are split inside, each rank keeping every expert's slice of the intermediate
size (`ExpertsParallel`); the router stays whole. Whole again (a checkpoint's weights,
`full_tensor()`), `gate_up_proj` is transformers' packed layout; each rank's part of it
is two blocks of that tensor, which checkpoints write and read as such
(checkpoint/blocks.py). A plan style not listed here is refused in one line naming it.

The spec's checks (`config.layout`) refuse other models and GPT sizes the degree does
not divide before anything starts; pre-flight checks a Hugging Face model's plan and
sizes on the built model (`check_tensor_parallel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainstack.compat import torch as torch_compat
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


@contextlib.contextmanager
def frozen_kept_frozen(model: nn.Module) -> Iterator[None]:
    """Parameters frozen before (LoRA's base) frozen again after: torch's parallel styles
    register new parameters, which require a gradient whatever the old ones did (a
    replicated norm would then train, and the optimizer take it)."""
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    try:
        yield
    finally:
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)


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
        with frozen_kept_frozen(layer):
            parallelize_module(layer, tp_mesh, with_adapters(layer, plan))
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


def with_adapters(layer: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` for a layer whose planned linear layers may carry LoRA adapters (peft's
    `lora.Linear`: `base_layer`, and per adapter `lora_A` then `lora_B`), so that each
    rank adds its part of the adapters' output to its part of the base layer's:
    - the base layer is split as planned;
    - under a column-parallel one, A is column-parallel too, its rank-r output gathered
      whole (model.lora.rank divisible by the degree), and B column-parallel as the base
      (each rank adds its slice of the output features);
    - under a row-parallel one, A is row-parallel (each rank's share of the input
      features, summed to the whole rank-r output) and B replicated, its output laid out
      as the base's (the whole of it, or this rank's share of the sequence).
    A planned module without adapters keeps its entry."""
    out: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        adapters = getattr(module, "lora_A", None)
        if not isinstance(adapters, nn.ModuleDict) or not hasattr(module, "base_layer"):
            out[name] = style
            continue
        out[f"{name}.base_layer"] = style
        for adapter in adapters:
            a, b = f"{name}.lora_A.{adapter}", f"{name}.lora_B.{adapter}"
            if isinstance(style, ColwiseParallel):
                out[a] = ColwiseParallel(
                    input_layouts=style.input_layouts[0],
                    output_layouts=Replicate(),
                    use_local_output=False,
                )
                out[b] = ColwiseParallel(
                    input_layouts=Replicate(),
                    output_layouts=style.output_layouts[0],
                    use_local_output=style.use_local_output,
                )
            else:
                assert isinstance(style, RowwiseParallel), f"LoRA on {name} under {style}"
                out[a] = RowwiseParallel(
                    input_layouts=style.input_layouts[0],
                    output_layouts=Replicate(),
                    use_local_output=False,
                )
                out[b] = ReplicatedAdapter(
                    output_layout=style.output_layouts[0], use_local_output=style.use_local_output
                )
    return out


class ReplicatedAdapter(ParallelStyle):
    """LoRA's B under a row-parallel base layer: its weight replicated over `tp`, its
    input the whole rank-r activation (a replicated DTensor), its output redistributed to
    the base layer's output layout (a slice of the sequence costs no communication; its
    gradient is gathered whole) and made local as the base's is."""

    def __init__(self, *, output_layout: Any, use_local_output: bool) -> None:
        super().__init__()
        self.output_layout = output_layout
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicated(_: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()])
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def laid_out(_: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
            output = output.redistribute(placements=[self.output_layout])
            return output.to_local() if self.use_local_output else output

        return distribute_module(module, device_mesh, input_fn=replicated, output_fn=laid_out)


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


class ExpertsParallel(ParallelStyle):
    """A mixture of experts' stacked experts (transformers' `...Experts` module:
    `gate_up_proj` [E, 2·I, H], its gate and up halves packed along dim 1, and
    `down_proj` [E, H, I]) split over the intermediate size I: each rank keeps, for
    every expert, its slice of the gate half and of the up half (`_StridedShard(1,
    split_factor=2)`: locally [E, 2·I/tp, H], gate slice then up slice, as the experts'
    forward chunks it; whole, transformers' packed layout) and of `down_proj`
    (`Shard(2)`: [E, H, I/tp]). The experts' own forward runs on these local slices:
    every rank routes every token as one process does (the router is replicated) and
    computes its share of each expert's output, which is a sum over the ranks, taken in
    the forward pass (its gradient is whole on every rank). The gradients each rank's
    slices give the hidden states and the routing weights are likewise shares of a sum,
    so those two inputs pass through an all-reduce of their gradient: the router and
    the layers before get a whole one."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in experts_placements().items():
            param = module.get_parameter(name)
            shards = distribute_tensor(
                param, device_mesh, [placement], src_data_rank=self.src_data_rank
            )
            module.register_parameter(name, nn.Parameter(shards, param.requires_grad))
        group = device_mesh.get_group()
        forward = module.forward

        def on_local_slices(
            hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
        ) -> torch.Tensor:
            hidden_states = _SumGradient.apply(hidden_states, group)
            # routing weights come in float32 (the router's softmax), and the experts
            # multiply them into wider activations: their gradient's shares are summed at
            # that width, as one process sums them, and rounded to float32 once after
            wider = torch.promote_types(top_k_weights.dtype, hidden_states.dtype)
            top_k_weights = _SumGradient.apply(top_k_weights.to(wider), group)
            with _local_parameters(module):
                share = forward(hidden_states, top_k_index, top_k_weights)
            return cast(torch.Tensor, _SumOutput.apply(share, group))

        module.forward = on_local_slices
        return module


def experts_placements() -> dict[str, Any]:
    """How `ExpertsParallel` places the stacked experts' parameters over `tp` (a strided
    shard: `torch_compat.strided_shard`, which pre-flight checks torch has)."""
    return {
        "gate_up_proj": torch_compat.strided_shard(1, split_factor=2),
        "down_proj": Shard(2),
    }


EXPERTS_PARAMETER_STYLES = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
"""What a `moe_tp_experts` plan says of the experts' two parameters: the split above."""


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward, the gradient summed over `group` (each rank's is its
    share of the sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOutput(torch.autograd.Function):
    """Forward, the ranks' shares summed over `group`; backward, identity (the sum's
    gradient is every share's)."""

    @staticmethod
    def forward(ctx: Any, share: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = share.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _local_parameters(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Inside, `module`'s DTensor parameters read as their local parts (through
    `to_local`, so their gradients reach the DTensors)."""
    local = {
        name: param.to_local()
        for name, param in module.named_parameters(recurse=False)
        if isinstance(param, DTensor)
    }
    return torch_compat.parameters_replaced(module, local)


HF_STYLES: dict[str, Any] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": HeadShardedNorm,
    "moe_tp_experts": ExpertsParallel,
}
"""The `base_model_tp_plan` styles trainstack applies to a module, as parallel styles
(and `packed_colwise`, on the parameter a `moe_tp_experts` module splits itself)."""
SPLITS = {
    "colwise": "out_features",
    "colwise_gather_output": "out_features",
    "rowwise": "in_features",
    "rowwise_split_input": "in_features",
}
"""Which size of a Linear each style splits (a head-sharded norm splits none)."""


def hf_layer_plan(model: HFCausalLM) -> dict[str, str]:
    """The family's `base_model_tp_plan` for one decoder layer (`layers.*.` dropped), a
    module's name to its style: a `moe_tp_experts` module's entries for its two
    parameters are folded into it (`ExpertsParallel` splits them as they say). ConfigError
    for a family without one or a style trainstack does not apply yet."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ConfigError(
            f"strategy.tensor_parallel needs the model's base_model_tp_plan, and "
            f"model.hf.model_type={model.family} declares none; use strategy.tensor_parallel=1"
        )
    layer: dict[str, str] = {}
    for pattern, style in plan.items():
        if not pattern.startswith("layers.*."):
            raise ConfigError(
                f"model.hf.model_type={model.family}: its base_model_tp_plan names {pattern}, "
                "outside the decoder layers; use strategy.tensor_parallel=1"
            )
        layer[pattern.removeprefix("layers.*.")] = style
    folded = _experts_parameters(model.family, layer)
    for name, style in layer.items():
        if name not in folded and style not in HF_STYLES:
            raise ConfigError(
                f"model.hf.model_type={model.family}: its base_model_tp_plan splits "
                f"layers.*.{name} as {style}, which trainstack does not apply yet (it does: "
                f"{', '.join(HF_STYLES)} with its gate_up_proj packed_colwise and its "
                "down_proj rowwise); use strategy.tensor_parallel=1"
            )
    return {name: style for name, style in layer.items() if name not in folded}


def _experts_parameters(family: str, layer: dict[str, str]) -> set[str]:
    """The entries of `layer` that name a `moe_tp_experts` module's parameters;
    ConfigError where they split them otherwise than `ExpertsParallel` does."""
    folded: set[str] = set()
    for module, style in layer.items():
        if style != "moe_tp_experts":
            continue
        entries = {f"{module}.{p}": s for p, s in EXPERTS_PARAMETER_STYLES.items()}
        if any(layer.get(name) != s for name, s in entries.items()):
            found = ", ".join(f"{name}: {layer.get(name)}" for name in entries)
            wanted = ", ".join(f"{name}: {s}" for name, s in entries.items())
            raise ConfigError(
                f"model.hf.model_type={family}: its base_model_tp_plan splits the experts "
                f"layers.*.{module} as moe_tp_experts with {found}; trainstack applies "
                f"moe_tp_experts with {wanted} only; use strategy.tensor_parallel=1"
            )
        folded |= set(entries)
    return folded


def check_tensor_parallel(model: nn.Module, degree: int) -> None:
    """Raise ConfigError unless a Hugging Face model's plan applies and `degree` divides
    every size it splits (a GPT's sizes are checked with the spec): with column-parallel
    attention projections, the heads too (each rank views its slice as whole heads)."""
    if degree == 1 or not isinstance(model, HFCausalLM):
        return
    plan = hf_layer_plan(model)
    sizes = {"vocab_size": model.config.vocab_size}
    if any(style == "colwise" and name.startswith("self_attn.") for name, style in plan.items()):
        for key in ("num_attention_heads", "num_key_value_heads"):
            if heads := getattr(model.config, key, None):
                sizes[key] = heads
    strided = torch_compat.feature("strided_shard")
    if not strided.available and "moe_tp_experts" in plan.values():
        raise ConfigError(
            strided.refusal(
                f"strategy.tensor_parallel={degree} of {model.family}'s experts",
                instead="strategy.tensor_parallel=1",
            )
        )
    for layer in cast(nn.ModuleList, model.body.get_submodule("layers")):
        for name, style in _present(layer, plan).items():
            module = layer.get_submodule(name)
            if style in SPLITS:
                sizes[f"{name}.{SPLITS[style]}"] = getattr(module, SPLITS[style])
            elif style == "moe_tp_experts":  # down_proj [E, H, I]
                sizes[f"{name} intermediate size"] = module.get_parameter("down_proj").shape[-1]
    for what, value in sizes.items():
        if value % degree:
            raise ConfigError(
                f"strategy.tensor_parallel={degree} does not divide {model.family}'s {what} = "
                f"{value}, which its plan splits; allowed: a tensor_parallel that divides {value}"
            )


def _present(layer: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The entries of `plan` naming a module `layer` has (a family's plan covers its
    dense and its mixture-of-experts layers: qwen2_moe and qwen3_moe may have both)."""
    names = {name for name, _ in layer.named_modules()}
    return {name: style for name, style in plan.items() if name in names}


def _parallelize_hf(model: HFCausalLM, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    with frozen_kept_frozen(model):
        _parallelize_hf_layers(model, tp_mesh, loss_parallel=loss_parallel)


def _parallelize_hf_layers(model: HFCausalLM, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    styles = hf_layer_plan(model)
    body = model.body
    parallelize_module(
        body,
        tp_mesh,
        {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())},
    )
    for layer in cast(nn.ModuleList, body.get_submodule("layers")):
        plan = {name: HF_STYLES[style]() for name, style in _present(layer, styles).items()}
        parallelize_module(layer, tp_mesh, with_adapters(layer, plan))
    parallelize_module(model, tp_mesh, {"lm_head": _vocabulary_head(loss_parallel, Replicate())})
    if model.config.tie_word_embeddings:
        model.get_submodule("lm_head").weight = body.get_submodule("embed_tokens").weight
    for module in list(model.modules()):  # the rest (norms): whole on every rank
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            _replicate(module, tp_mesh)


def _replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """`module`'s parameters as replicated DTensors over `tp_mesh`, its forward run on
    their local copies: every rank holds the whole activation, so each computes the
    whole gradient, the same on every rank. Whatever the forward returns is plain where
    it is made (a router's logits, which transformers records inside its forward for
    the balance loss, too)."""
    distribute_module(module, tp_mesh)
    forward = module.forward

    def on_local_parameters(*args: Any, **kwargs: Any) -> Any:
        with _local_parameters(module):
            return forward(*args, **kwargs)

    module.forward = on_local_parameters


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
