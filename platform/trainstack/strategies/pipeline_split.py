"""Cutting any model into pipeline stages, and where each stage runs.

A model is cut along its pipeline layers (`trainstack.models.pipeline_layers`: its
`pipeline_layers()`, or an `nn.Sequential`'s children), which apply in order.
`split_stages` cuts them into S contiguous stages of at least one layer each, so that
the largest stage has as few parameters as possible (a parameter several stages use,
such as a GPT's tied embedding and LM head, counts on each). `StageModule` is one
stage: deep copies of its layers, whose state-dict keys are the full model's names,
so stage state dicts merge back into the model's. A parameter the layers of several
stages use is a `TiedParameter`: each of those stages holds a copy, and the strategy
sums their gradients so the copies stay equal, as the one tensor of the model would.

Placement: with v stages per rank, `loop` puts stage s on rank s % p (GPipe, 1F1B,
the interleaved schedules) and `v` folds the chain back, rank r holding stages r and
2p-1-r (ZBV and DualPipeV), so the first and last stage share rank 0. Evaluation passes
activations between ranks with `send_activation` / `recv_activation`, which send
their shapes first: any tensor (or tuple of tensors) a layer returns can cross.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainstack.compat import torch as torch_compat
from trainstack.config import ConfigError, JobConfig
from trainstack.models import pipeline_layers

Activation = torch.Tensor | tuple[torch.Tensor, ...]
"""What one stage passes to the next."""


def last_stage_mean(value: torch.Tensor, *, holds_last: bool, replicas: int) -> float:
    """Mean over the replicas of a value only the last stage knows (the loss). A collective."""
    value = value.detach().to(torch.float64).clone()
    if not holds_last:
        value.zero_()
    dist.all_reduce(value)
    return float(value) / replicas


# ---- the model's layers and their names ---------------------------------------------------


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The model's pipeline layers; ConfigError if it has none."""
    layers = pipeline_layers(model)
    if layers is None:
        raise ConfigError(
            f"strategy.kind=pipeline: the model ({type(model).__name__}) has neither "
            "pipeline_layers() nor is an nn.Sequential; add a pipeline_layers() method "
            "returning its layers in order"
        )
    return layers


@dataclass(frozen=True, kw_only=True)
class ModelNames:
    """The model's names of its modules and state tensors, found by object identity, so
    that whatever a layer holds can be named as the model names it."""

    model_class: str
    modules: dict[int, list[str]]
    """id(module) -> every qualified name of it in the model ('' for the model itself)."""
    tensors: dict[int, list[str]]
    """id(parameter or buffer) -> every state-dict key of it in the model."""
    keys: tuple[str, ...]
    """The model's state-dict keys, in order."""

    @classmethod
    def of(cls, model: nn.Module) -> ModelNames:
        modules: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            modules.setdefault(id(module), []).append(name)
        tensors: dict[int, list[str]] = {}
        state = model.state_dict(keep_vars=True)
        for key, tensor in state.items():
            tensors.setdefault(id(tensor), []).append(key)
        return cls(
            model_class=type(model).__name__, modules=modules, tensors=tensors, keys=tuple(state)
        )

    def of_layer(self, layer: nn.Module, *, index: int) -> dict[str, tuple[str, ...]]:
        """Each key of `layer.state_dict()` -> the model's keys of that tensor.

        A tensor of a module the model holds is named through that module (a GPT's LM
        head weight is `lm_head.weight`, though it is the token embedding's tensor);
        one held directly by a layer of its own, by the model's keys of the tensor.
        """
        known = set(self.keys)
        names: dict[str, tuple[str, ...]] = {}
        for key, tensor in layer.state_dict(keep_vars=True).items():
            path, _, leaf = key.rpartition(".")
            owner = layer.get_submodule(path)
            found = [f"{q}.{leaf}" if q else leaf for q in self.modules.get(id(owner), [])]
            found = [k for k in found if k in known] or self.tensors.get(id(tensor), [])
            if not found:
                raise ConfigError(
                    f"pipeline layer {index} ({type(layer).__name__}) holds {key!r}, which is "
                    f"not in the state_dict of {self.model_class}; pipeline layers may use only "
                    "the model's own modules, parameters and buffers"
                )
            names[key] = tuple(found)
        return names


def check_schedule_runs_here(cfg: JobConfig) -> None:
    """ConfigError (one line) for a torch schedule the installed torch cannot run on the
    job's workers: dualpipev before torch 2.9, zbv on CPU (gloo) before 2.10."""
    s = cfg.strategy
    if s.engine != "torch":
        return
    dualpipev = torch_compat.feature("dualpipev")
    if s.schedule == "dualpipev" and not dualpipev.available:
        raise ConfigError(
            dualpipev.refusal("strategy.schedule=dualpipev", instead="strategy.schedule=zbv")
        )
    zbv = torch_compat.feature("zbv_on_gloo")
    if s.schedule == "zbv" and not cfg.scaling.use_gpu and not zbv.available:
        sibling = "dualpipev" if dualpipev.available else "zb_interleaved"
        raise ConfigError(
            zbv.refusal(
                "strategy.schedule=zbv on CPU workers (gloo)",
                instead=f"strategy.schedule={sibling}",
            )
        )


def check_pipeline_model(cfg: JobConfig, model: nn.Module) -> None:
    """Pre-flight for `strategy.kind: pipeline`: the model has pipeline layers, at least
    one per stage, and together they hold (and name) everything in its state_dict, so
    that stage files merge into the model's weights. ConfigError with one line if not.

    Both engines can run any parameter tie between stages (DeepSpeed's as one
    `TiedLayerSpec` per tied parameter), so ties refuse nothing here.
    """
    check_schedule_runs_here(cfg)
    layers = model_layers(model)
    p, v = cfg.strategy.stages, cfg.pipeline_virtual_stages
    if len(layers) < p * v:
        raise ConfigError(
            f"strategy.stages × virtual_stages = {p} × {v} = {p * v} pipeline stages need a "
            f"layer each, but {type(model).__name__} has {len(layers)} pipeline layers; use "
            f"at most {len(layers)} stages or split the model into more layers"
        )
    names = ModelNames.of(model)
    held = {
        k
        for i, layer in enumerate(layers)
        for ks in names.of_layer(layer, index=i).values()
        for k in ks
    }
    missing = [key for key in names.keys if key not in held]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ConfigError(
            f"{type(model).__name__} has state that none of its {len(layers)} pipeline layers "
            f"holds ({len(missing)} keys: {shown}); pipeline_layers() must use every "
            "parameter and buffer of the model"
        )


# ---- the split ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StageSplit:
    """Which layers each of the S stages holds, and its parameter count."""

    layers: tuple[range, ...]
    params: tuple[int, ...]
    classes: tuple[str, ...]
    """Every layer's class name, for `describe`."""

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def describe(self) -> str:
        parts = []
        for s, (held, params) in enumerate(zip(self.layers, self.params, strict=True)):
            where = f"layer {held.start}" if len(held) == 1 else f"layers {held.start}-{held[-1]}"
            what = _runs([self.classes[i] for i in held])
            parts.append(f"stage {s}: {where} = {what} ({params:,} params)")
        return "; ".join(parts)


def _runs(names: list[str]) -> str:
    """`GPTEmbedding + 4 × Block`: consecutive repeats counted."""
    runs: list[list[Any]] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return " + ".join(name if count == 1 else f"{count} × {name}" for name, count in runs)


def split_stages(layers: Sequence[nn.Module], num_stages: int) -> StageSplit:
    """Contiguous stages of >= 1 layer each, minimising the largest stage's parameters
    (a parameter counted once per stage whose layers use it)."""
    n = len(layers)
    assert 1 <= num_stages <= n, (num_stages, n, "check_pipeline_model bounds the stages")
    held = [{id(p): p.numel() for p in layer.parameters()} for layer in layers]
    # cost[lo][hi]: parameters of a stage holding layers lo..hi-1.
    cost = [[0] * (n + 1) for _ in range(n + 1)]
    for lo in range(n):
        seen: set[int] = set()
        total = 0
        for hi in range(lo + 1, n + 1):
            for key, numel in held[hi - 1].items():
                if key not in seen:
                    seen.add(key)
                    total += numel
            cost[lo][hi] = total

    # best[s][i]: the smallest possible largest stage when stages 0..s-1 hold layers 0..i-1.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                candidate = max(best[s - 1][j], cost[j][i])
                if candidate < best[s][i]:
                    best[s][i], cut[s][i] = candidate, j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    ranges = tuple(range(bounds[s], bounds[s + 1]) for s in range(num_stages))
    return StageSplit(
        layers=ranges,
        params=tuple(cost[r.start][r.stop] for r in ranges),
        classes=tuple(type(layer).__name__ for layer in layers),
    )


@dataclass(frozen=True, kw_only=True)
class TiedParameter:
    """A trainable parameter that the layers of several stages use; each of those stages
    holds a copy, and their gradients are summed (what the model's backward does for its
    one tensor) so that the copies take the same update."""

    name: str
    """The model's name of it."""
    numel: int
    stages: tuple[int, ...]
    """The stages holding a copy, ascending; the first one's copy counts in the grad norm."""
    uses: tuple[tuple[int, str], ...]
    """For each of `stages`: (layer index, the parameter's name in that layer)."""


def tied_parameters(
    model: nn.Module, layers: Sequence[nn.Module], split: StageSplit
) -> list[TiedParameter]:
    """The parameters shared between stages, by the model's name (the same on every rank)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    uses: dict[int, dict[int, tuple[int, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for s, held in enumerate(split.layers):
        for i in held:
            for name, p in layers[i].named_parameters():
                if p.requires_grad:
                    uses.setdefault(id(p), {}).setdefault(s, (i, name))
                    params[id(p)] = p
    ties = [
        TiedParameter(
            name=names[key],  # check_pipeline_model: every layer tensor is the model's
            numel=params[key].numel(),
            stages=tuple(sorted(by_stage)),
            uses=tuple(by_stage[s] for s in sorted(by_stage)),
        )
        for key, by_stage in uses.items()
        if len(by_stage) > 1
    ]
    return sorted(ties, key=lambda tie: tie.name)


def stage_ranks(*, pp_size: int, num_stages: int, style: str) -> list[int]:
    """The pipeline rank of each stage under `loop` or `v` placement."""
    if style == "loop":
        return [s % pp_size for s in range(num_stages)]
    assert style == "v" and num_stages == 2 * pp_size, (style, num_stages, pp_size)
    return [s if s < pp_size else 2 * pp_size - 1 - s for s in range(num_stages)]


# ---- one stage --------------------------------------------------------------------------


class StageModule(nn.Module):
    """One pipeline stage: deep copies of the model's layers `held`, sharing no tensors
    with the model (a tensor two of its layers share stays one tensor in the stage).

    `forward` applies them in order; it takes the previous stage's output as one
    argument, or a tuple's items as several (as torch's PipelineStage passes them).
    `state_dict()` and `load_state_dict()` use the full model's keys
    (`blocks.3.attn.q_proj.weight`), so stage state dicts merge into the model's.
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], held: range) -> None:
        super().__init__()
        names = ModelNames.of(model)
        originals = [layers[i] for i in held]
        copies = copy.deepcopy(originals)  # one memo: what layers share stays shared
        self.layers = nn.ModuleDict({str(i): c for i, c in zip(held, copies, strict=True)})
        self.model_names: dict[str, tuple[str, ...]] = {
            f"layers.{i}.{key}": keys
            for i, layer in zip(held, originals, strict=True)
            for key, keys in names.of_layer(layer, index=i).items()
        }
        """This module's own state-dict key -> the model's keys of the same tensor."""
        self.register_state_dict_post_hook(_to_model_names)
        self.register_load_state_dict_pre_hook(_from_model_names)

    def parameter(self, *, layer: int, name: str) -> nn.Parameter:
        """This stage's copy of parameter `name` of the model's layer `layer`."""
        return self.layers[str(layer)].get_parameter(name)

    def forward(self, *args: Any) -> Any:
        x: Any = args[0] if len(args) == 1 else args
        for layer in self.layers.values():
            x = layer(x)
        return x


def _to_model_names(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post-hook: this stage's keys become the model's."""
    names: dict[str, tuple[str, ...]] = getattr(module, "model_names")  # noqa: B009
    own = {key: state_dict.pop(prefix + key) for key in names if prefix + key in state_dict}
    for key, value in own.items():
        for name in names[key]:
            state_dict[prefix + name] = value


def _from_model_names(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load pre-hook: the model's keys become this stage's (any one of a tensor's keys)."""
    names: dict[str, tuple[str, ...]] = getattr(module, "model_names")  # noqa: B009
    found = {}
    for key, keys in names.items():
        present = [prefix + k for k in keys if prefix + k in state_dict]
        if present:
            found[prefix + key] = state_dict[present[0]]
    for keys in names.values():
        for k in keys:
            state_dict.pop(prefix + k, None)
    state_dict.update(found)


# ---- activations between ranks --------------------------------------------------------

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def send_activation(value: Activation, *, dst: int) -> None:
    """Send a tensor or a tuple of tensors to global rank `dst`: a header (tuple or not,
    then each tensor's dtype and shape) ahead of the data, so the receiver needs to know
    nothing in advance."""
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    header = [int(not isinstance(value, torch.Tensor)), len(tensors)]
    for t in tensors:
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    device = tensors[0].device
    dist.send(torch.tensor([len(header)], device=device), dst=dst)
    dist.send(torch.tensor(header, device=device), dst=dst)
    for t in tensors:
        dist.send(t.contiguous(), dst=dst)


def recv_activation(*, src: int, device: torch.device) -> Activation:
    """Receive what `send_activation` sent from global rank `src`."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=src)
    encoded = torch.zeros(int(size), dtype=torch.int64, device=device)
    dist.recv(encoded, src=src)
    header = encoded.tolist()
    is_tuple, count, pos = header[0], header[1], 2
    tensors = []
    for _ in range(count):
        dtype, ndim = _DTYPES[header[pos]], header[pos + 1]
        shape = header[pos + 2 : pos + 2 + ndim]
        pos += 2 + ndim
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=src)
        tensors.append(tensor)
    return tuple(tensors) if is_tuple else tensors[0]
