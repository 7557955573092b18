"""Mixture of experts: a top-k routed layer of expert MLPs, with expert parallelism.

`MoE(dim, experts=E, top_k=k)` takes the place of a dense MLP (`x [..., d] -> [..., d]`).
A linear router scores each token, the token goes to its k best-scored experts, and
the experts' outputs come back weighted by the router's probabilities (renormalised
over the k chosen when k > 1). A token an expert has no room for is dropped by that
expert (its output there is zero; the residual stream carries the token on).

- **Grouped experts.** The experts' weights are two stacked tensors, `w_in [E, d, h]`
  and `w_out [E, h, d]` (a GELU MLP each). The tokens routed to each expert are gathered
  into one padded `[E, C, d]` batch and run through two batched matmuls: no Python loop
  over tokens or experts.
- **Capacity.** With `capacity_factor` f > 0, each expert takes at most
  `ceil(f · N · k / E)` of the N tokens a rank routes in one forward, first choices
  before second choices, earlier tokens first (GShard); the rest are dropped and
  counted. f = 0 drops nothing.
- **Balance.** `aux_loss`: the Switch/GShard auxiliary loss `E · Σ_i f_i · P_i` (f_i the
  share of routed assignments expert i got, P_i its mean router probability), times
  `aux_weight`, added to the training loss (the model returns it as `.aux_loss`).
  `bias`: auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, used only
  to choose the experts and never in the weights, moves by `bias_rate` each step
  toward the under-loaded experts (`update_balance_bias`). `none`: neither.
- **Expert parallelism.** `shard_experts(model, ExpertGroup)` keeps E / P experts on
  each of the P ranks of an expert-parallel group; each forward sends every rank's
  tokens to the ranks holding their experts and the outputs back, with two variable-
  split all-to-alls (differentiable: the backward pass sends the gradients the same
  way in reverse). Routing and capacity are decided on the sending rank, so a rank's
  tokens meet the same experts, and the same tokens are dropped, as in one process.

A user's own model uses the layer as it is: build `MoE` where its MLP was, and return
an object whose `.logits` are the logits and `.aux_loss` the sum of the layers'
`aux_loss` (`total_aux_loss(model)`); trainstack adds `.aux_loss` to the training loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

BALANCE_MODES = ("aux_loss", "bias", "none")


class MoEOutput(NamedTuple):
    """What a model with MoE layers returns: the logits and its weighted aux loss."""

    logits: torch.Tensor
    aux_loss: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class ExpertGroup:
    """The P ranks that split the experts between them, and this rank's place there."""

    group: Any
    """The process group of the P ranks (`dist.new_group`)."""
    rank: int
    """This rank's index in the group: it holds experts [rank · E/P, (rank + 1) · E/P)."""
    size: int


class MoE(nn.Module):
    """Top-k routed expert MLPs in place of one dense MLP: `x [..., d] -> [..., d]`."""

    def __init__(
        self,
        dim: int,
        *,
        experts: int,
        top_k: int = 2,
        hidden: int = 0,
        capacity_factor: float = 0.0,
        balance: str = "aux_loss",
        aux_weight: float = 0.01,
        bias_rate: float = 1e-3,
    ) -> None:
        super().__init__()
        assert 1 <= top_k <= experts and balance in BALANCE_MODES
        hidden = hidden or 4 * dim
        self.num_experts, self.top_k = experts, top_k
        self.capacity_factor, self.balance = capacity_factor, balance
        self.aux_weight, self.bias_rate = aux_weight, bias_rate
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) * 0.02)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) * 0.02)
        # Chooses experts (never weighs them); saved with the model, moved by the loop.
        self.balance_bias: torch.Tensor
        self.register_buffer("balance_bias", torch.zeros(experts))
        self.aux_loss: torch.Tensor | None = None
        """The last forward's weighted aux loss (zero unless balance is aux_loss)."""
        self.expert_group: ExpertGroup | None = None
        self.local_experts = range(experts)
        """The experts this rank holds (all of them without expert parallelism)."""
        self._load: torch.Tensor | None = None  # [E + 1]: assignments per expert, dropped
        self.a2a_bytes = 0
        """Bytes this rank sent to other ranks by all-to-all (forward and backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n, e, k = tokens.shape[0], self.num_experts, self.top_k
        logits = self.router(tokens)
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
        scores = probs + self.balance_bias.to(probs.dtype) if self.balance == "bias" else probs
        chosen = scores.topk(k, dim=-1).indices  # [N, k]
        gates = probs.gather(-1, chosen)
        if k > 1:
            gates = gates / gates.sum(-1, keepdim=True)

        # Assignments, first choices before second ones, each in token order.
        expert_of = chosen.t().reshape(-1)
        token_of = torch.arange(n, device=x.device).repeat(k)
        gate_of = gates.t().reshape(-1)
        order = torch.sort(expert_of, stable=True).indices
        counts = torch.bincount(expert_of, minlength=e)
        keep = order
        if self.capacity_factor > 0:
            room = math.ceil(self.capacity_factor * n * k / e)
            starts = counts.cumsum(0) - counts
            place = torch.arange(n * k, device=x.device) - starts[expert_of[order]]
            keep = order[place < room]
        kept_counts = torch.bincount(expert_of[keep], minlength=e)
        if self.training:
            self._count(counts, dropped=n * k - keep.numel())
        self.aux_loss = self._aux_loss(probs, counts)

        rows = self._run_experts(tokens[token_of[keep]], kept_counts)
        return sum_per_token(tokens, token_of[keep], rows, gate_of[keep]).reshape(shape)

    def _aux_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.balance != "aux_loss" or probs.shape[0] == 0:
            return probs.new_zeros(())
        share = counts.to(probs.dtype) / counts.sum()  # f_i: of all k·N assignments
        return self.aux_weight * self.num_experts * (share * probs.mean(0)).sum()

    def _count(self, counts: torch.Tensor, *, dropped: int) -> None:
        if self._load is None or self._load.device != counts.device:
            self._load = torch.zeros(self.num_experts + 1, dtype=torch.long, device=counts.device)
        self._load[:-1] += counts
        self._load[-1] += dropped

    def take_load(self) -> torch.Tensor:
        """Assignments per expert and dropped assignments `[E + 1]` since the last take."""
        load = self._load
        self._load = None
        if load is None:
            return torch.zeros(self.num_experts + 1, dtype=torch.long)
        return load

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's MLP on its rows (`rows` grouped by expert, `counts` [E] each), on
        this rank or, with expert parallelism, on the ranks that hold the experts."""

        def compute(grouped: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
            return grouped_mlp(grouped, per_expert, self.w_in, self.w_out)

        if self.expert_group is None:
            return compute(rows, counts)
        return run_on_owners(rows, counts, self.expert_group, compute, counter=self)

    def hold_experts(self, ep: ExpertGroup) -> None:
        """Keep only this rank's E / P experts (call before the optimizer is built)."""
        assert self.num_experts % ep.size == 0, "the group size must divide the experts"
        self.local_experts = held_experts(self.num_experts, ep)
        keep_held(self, EXPERT_PARAMETERS, self.local_experts)
        self.expert_group = ep


EXPERT_PARAMETERS = ("w_in", "w_out")
"""The `MoE` parameters with one slice per expert along dim 0."""


def held_experts(total: int, ep: ExpertGroup) -> range:
    """The experts of `total` that rank `ep.rank` of the group holds: its E / P in a row."""
    per_rank = total // ep.size
    return range(ep.rank * per_rank, (ep.rank + 1) * per_rank)


def keep_held(module: nn.Module, names: tuple[str, ...], held: range) -> None:
    """Replace each of `module`'s stacked expert parameters by its `held` slices."""
    for name in names:
        whole = getattr(module, name).detach()
        setattr(module, name, nn.Parameter(whole[held.start : held.stop].clone()))


def sum_per_token(
    tokens: torch.Tensor, token_index: torch.Tensor, rows: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    """Each token's expert outputs `rows` (one per routed pair, `token_index` its token)
    weighted by `gates` and summed, in the tokens' dtype; zero for a token with none."""
    weighted = rows * gates.unsqueeze(-1).to(rows.dtype)
    return torch.zeros_like(tokens).index_add(0, token_index, weighted.to(tokens.dtype))


class SendsRows(Protocol):
    a2a_bytes: int


def run_on_owners(
    rows: torch.Tensor,
    counts: torch.Tensor,
    ep: ExpertGroup,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    counter: SendsRows,
) -> torch.Tensor:
    """Send `rows` (grouped by expert, `counts` [E] each) to the ranks that hold their
    experts, have `compute(rows, per-local-expert counts)` run the ones that came here
    (grouped by this rank's experts), and bring the results back in `rows`' order."""
    per_rank = counts.shape[0] // ep.size
    send = counts.view(ep.size, per_rank)  # rows for each rank's each expert
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    arrived = _AllToAll.apply(rows, recv_splits, send_splits, ep, counter)
    # Arrived by sender, then expert: regroup by expert, run, restore the order.
    expert_ids = torch.arange(per_rank, device=rows.device).repeat(ep.size)
    regroup = torch.sort(torch.repeat_interleave(expert_ids, recv.flatten()), stable=True)
    done = compute(arrived[regroup.indices], recv.sum(0))
    back = done[torch.argsort(regroup.indices)]
    result: torch.Tensor = _AllToAll.apply(back, send_splits, recv_splits, ep, counter)
    return result


class StackedExperts:
    """Expert parallelism for a module that holds its E experts as stacked `[E, ...]`
    parameters and is called as `experts(hidden [N, h], top_k_index [N, k],
    top_k_weights [N, k]) -> [N, h]` (the Hugging Face MoE families' `...Experts`).

    Keeps this rank's E / P slices of those parameters, and replaces the module's
    forward: each routed (token, expert) pair goes to the expert's rank, which runs the
    module's own forward on the pairs that came to it (weights 1, local expert ids); the
    results come back, are weighted by the router's weights here, and summed per token.
    """

    def __init__(self, module: nn.Module, ep: ExpertGroup) -> None:
        total = int(vars(module)["num_experts"])
        if total % ep.size:
            raise RuntimeError(
                f"strategy.expert_parallel={ep.size} must divide {type(module).__name__}'s "
                f"{total} experts"
            )
        per_rank = total // ep.size
        self.num_experts, self.expert_group = total, ep
        self.local_experts = held_experts(total, ep)
        self.parameters = stacked_parameters(module)
        keep_held(module, tuple(self.parameters), self.local_experts)
        self.a2a_bytes = 0
        self._own_forward = module.forward
        # An instance's attributes (not nn.Module state): the module now holds per_rank
        # experts, runs this forward, and says it was split.
        object.__setattr__(module, "num_experts", per_rank)
        object.__setattr__(module, "forward", self.forward)
        object.__setattr__(module, "trainstack_split", self)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        n, k = top_k_index.shape
        expert_of = top_k_index.t().reshape(-1)
        token_of = torch.arange(n, device=hidden.device).repeat(k)
        order = torch.sort(expert_of, stable=True).indices
        counts = torch.bincount(expert_of, minlength=self.num_experts)
        per_rank = len(self.local_experts)

        def compute(rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
            if rows.shape[0] == 0:  # none here; kept in the graph for the backward all-to-alls
                return rows * 0
            experts = torch.arange(per_rank, device=rows.device)
            local = torch.repeat_interleave(experts, local_counts).unsqueeze(1)
            out: torch.Tensor = self._own_forward(rows, local, rows.new_ones(rows.shape[0], 1))
            return out

        rows = run_on_owners(
            hidden[token_of[order]], counts, self.expert_group, compute, counter=self
        )
        return sum_per_token(hidden, token_of[order], rows, top_k_weights.t().reshape(-1)[order])


def stacked_parameters(module: nn.Module) -> list[str]:
    """The names of `module`'s own parameters stacked one slice per expert (dim 0)."""
    total = getattr(module, "num_experts", None)
    return [
        name
        for name, p in module.named_parameters(recurse=False)
        if isinstance(total, int) and p.dim() >= 2 and p.shape[0] == total
    ]


def stacked_experts_modules(model: nn.Module) -> list[nn.Module]:
    """`model`'s modules that hold stacked experts (a Hugging Face `...Experts`)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Experts") and not isinstance(m, MoE) and stacked_parameters(m)
    ]


def grouped_mlp(
    rows: torch.Tensor, counts: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor
) -> torch.Tensor:
    """`gelu(rows_e @ w_in[e]) @ w_out[e]` for each expert e's rows, as two batched
    matmuls over the rows padded to `[E, max count, d]`."""
    experts = counts.shape[0]
    if rows.shape[0] == 0:  # none here; kept in the graph, so the backward all-to-alls run
        return rows * 0
    expert = torch.repeat_interleave(torch.arange(experts, device=rows.device), counts)
    starts = counts.cumsum(0) - counts
    slot = torch.arange(rows.shape[0], device=rows.device) - starts[expert]
    padded = rows.new_zeros(experts, int(counts.max()), rows.shape[-1])
    padded = padded.index_put((expert, slot), rows)
    hidden = F.gelu(torch.bmm(padded, w_in.to(rows.dtype)))
    out = torch.bmm(hidden, w_out.to(rows.dtype))
    return out[expert, slot]


class _AllToAll(torch.autograd.Function):
    """Rows split among the group's ranks, exchanged; the backward sends gradients back."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        recv_splits: list[int],
        send_splits: list[int],
        ep: ExpertGroup,
        layer: SendsRows,
    ) -> torch.Tensor:
        ctx.splits, ctx.ep, ctx.layer = (recv_splits, send_splits), ep, layer
        return _exchange(rows, recv_splits, send_splits, ep, layer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recv_splits, send_splits = ctx.splits
        back = _exchange(grad.contiguous(), send_splits, recv_splits, ctx.ep, ctx.layer)
        return back, None, None, None, None


def _exchange(
    rows: torch.Tensor,
    recv_splits: list[int],
    send_splits: list[int],
    ep: ExpertGroup,
    layer: SendsRows,
) -> torch.Tensor:
    out = rows.new_empty(sum(recv_splits), *rows.shape[1:])
    dist.all_to_all_single(out, rows, recv_splits, send_splits, group=ep.group)
    row_bytes = rows.shape[1] * rows.element_size()
    layer.a2a_bytes += (sum(send_splits) - send_splits[ep.rank]) * row_bytes
    return out


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def total_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the last forward's aux losses of `model`'s MoE layers (None: none)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack([loss.reshape(()) for loss in losses]).sum() if losses else None


def expert_slices(model: nn.Module) -> dict[str, tuple[range, int]]:
    """State-dict key -> (the experts this rank holds, all experts) of every expert
    parameter in `model`."""
    found: dict[str, tuple[range, int]] = {}
    for name, module in model.named_modules():
        split = getattr(module, "trainstack_split", None)
        params: tuple[str, ...]
        if isinstance(module, MoE):
            params, held, total = EXPERT_PARAMETERS, module.local_experts, module.num_experts
        elif isinstance(split, StackedExperts):
            params, held, total = tuple(split.parameters), split.local_experts, split.num_experts
        else:
            continue
        for param in params:
            found[f"{name}.{param}" if name else param] = (held, total)
    return found


def take_load(model: nn.Module) -> torch.Tensor | None:
    """`[layers, E + 1]` assignments per expert and dropped since the last take (this
    rank's tokens; sum over the data-parallel ranks for the step's), or None."""
    layers = moe_layers(model)
    if not layers:
        return None
    return torch.stack([layer.take_load().cpu() for layer in layers])


def update_balance_bias(model: nn.Module, load: torch.Tensor) -> None:
    """Aux-free balancing: each `balance: bias` layer's bias moves by its `bias_rate`
    toward the experts below the mean load (`load` from `take_load`, summed over ranks)."""
    for layer, row in zip(moe_layers(model), load, strict=True):
        if layer.balance != "bias":
            continue
        counts = row[:-1].to(torch.float64)
        step = torch.sign(counts.mean() - counts) * layer.bias_rate
        layer.balance_bias.add_(step.to(layer.balance_bias))


def load_metrics(load: torch.Tensor) -> dict[str, float]:
    """Figures of a step's (or a log period's) routing, from `take_load` summed over ranks:
    the drop rate, the balance (coefficient of variation of the per-expert load, 0 when
    even), and each expert's share of the assignments (over all layers)."""
    counts = load[:, :-1].to(torch.float64)
    routed = float(counts.sum())
    if routed == 0:
        return {}
    per_layer_cv = counts.std(dim=1, unbiased=False) / counts.mean(dim=1).clamp_min(1e-12)
    metrics = {
        "moe_drop_rate": float(load[:, -1].sum()) / routed,
        "moe_load_cv": float(per_layer_cv.mean()),
    }
    shares = counts.sum(0) / routed
    metrics.update({f"moe_load_e{i}": float(share) for i, share in enumerate(shares)})
    return metrics
