"""Tasks: what a batch is, how its loss is computed, and one held-out evaluation loop.

A batch is `(inputs, targets)`:

- `lm`: token ids `[B, T]` and the next tokens `[B, T]`; the model returns logits
  `[B, T, V]`; the loss is the mean next-token cross-entropy; held-out metrics are
  the loss, perplexity and bits per token. Packed chat rows (`data.pack`) have inputs
  `[B, 2, T]` (token ids, position ids), which the model (`HFCausalLM`) takes as they are.
- `classify`: inputs `[B, ...]` and labels `[B]`; the model returns logits `[B, C]`;
  the loss is the mean cross-entropy; held-out metrics are the loss and accuracy.
- `dpo`: preference pairs (`data.kind: preference`) as token ids `[2B, T]`, each pair's
  chosen answer then its rejected one, targets -100 outside the answers. The reference
  runs without gradient (the model with its LoRA adapters off, or without `model.lora`
  a frozen copy of the model as it started, `attach_reference`), then the policy (the
  model as it is). With h the chosen answer's log-ratio of policy to reference minus the
  rejected one's, the loss is −log σ(β·h) (`dpo.loss: sigmoid`) or (h − 1/(2β))² (`ipo`,
  from mean log-probabilities per token), averaged over the pairs; held-out metrics are
  that loss, the share of pairs with h > 0 (`eval_accuracy`) and the mean rewards β ×
  log-ratio of the chosen and rejected answers and their margin.

`task.loss: "pkg.mod:fn"` replaces the cross-entropy by `fn(outputs, batch)` (a
scalar; under a pipeline the last stage calls it with `batch = (None, targets)`).
Model outputs may be a tensor or anything with a `.logits` tensor (Hugging Face). An
output with an `.aux_loss` tensor (a mixture of experts' balance loss, already
weighted) has it added to the training loss; held-out figures leave it out.

Every strategy and the parameter server evaluate through `evaluate`: each rank sums
(loss × count, count, correct) over its share of the held-out batches, the strategy
adds the sums over its group, and `EvalSums.metrics` turns them into figures.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainstack.config import ConfigError, JobConfig
from trainstack.data.sharding import IGNORED_TARGET, Batch

UserLoss = Callable[[Any, tuple[torch.Tensor | None, torch.Tensor]], torch.Tensor]


class TaskOutputError(RuntimeError):
    """A model output that does not fit the task; the message is one line."""


@dataclass(frozen=True, kw_only=True)
class PreferenceOutputs:
    """`dpo`: what the policy and the reference computed for a batch of pairs."""

    logits: torch.Tensor
    """The policy's logits [2B, T, V] (pairs interleaved: chosen, rejected)."""
    reference: torch.Tensor
    """The reference's logits [2B, T, V], without gradient."""


@dataclass(frozen=True, kw_only=True)
class Preferences:
    """`dpo`: each pair's loss, h (chosen log-ratio minus rejected), and rewards."""

    losses: torch.Tensor
    margins: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class Task:
    kind: str
    """`lm` or `classify`."""
    num_outputs: int
    """The logits' last dimension: the vocabulary (lm) or the classes (classify)."""
    user_loss: UserLoss | None = None
    """`task.loss`, imported; None: cross-entropy."""
    input_dtype: torch.dtype | None = None
    """What floating-point inputs are cast to (the weights' dtype under `train.precision:
    fp64`); None: as the data gives them."""
    fused_loss: bool = False
    """The model computes its own loss from the targets (`model.fused_loss`): training
    forwards pass them (`outputs`) and the loss is the outputs' `.loss`."""
    dpo_beta: float = 0.1
    """`dpo`: β (`dpo.beta`)."""
    dpo_loss: str = "sigmoid"
    """`dpo`: `sigmoid` or `ipo` (`dpo.loss`)."""

    @property
    def sums_size(self) -> int:
        """Length of `batch_sums`: loss × count, count, correct (and, for `dpo`, the
        chosen and rejected answers' reward sums)."""
        return 5 if self.kind == "dpo" else 3

    def outputs(self, model: Any, inputs: torch.Tensor, targets: torch.Tensor) -> Any:
        """The model's outputs for a training micro-batch (given the targets too when it
        computes its own loss; `dpo`: the reference's beside the policy's)."""
        if self.kind == "dpo":
            return self.eval_outputs(model, inputs)
        return model(inputs, targets=targets) if self.fused_loss else model(inputs)

    def eval_outputs(self, model: Any, inputs: torch.Tensor) -> Any:
        """The model's outputs for a held-out micro-batch (`dpo`: the reference's, with the
        model's adapters off, beside the policy's)."""
        if self.kind != "dpo":
            return model(inputs)
        with torch.no_grad():
            frozen = attached_reference(model)
            if frozen is not None:
                frozen.train(model.training)  # dropout as the policy's
                reference = frozen(inputs)
            else:
                with adapters_off(model):
                    reference = model(inputs)
        policy = model(inputs)
        return PreferenceOutputs(
            logits=getattr(policy, "logits", policy),
            reference=getattr(reference, "logits", reference),
        )

    def logits(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The logits in `outputs`, checked against the task's shape."""
        logits = getattr(outputs, "logits", outputs)
        if not isinstance(logits, torch.Tensor):
            raise TaskOutputError(
                f"the model returned {type(outputs).__name__}; task.kind={self.kind} needs a "
                "logits tensor (or an object with a .logits tensor)"
            )
        wanted = (*targets.shape, self.num_outputs)
        if tuple(logits.shape) != wanted:
            what = "[B, T, V]" if self.kind == "lm" else "[B, C]"
            size = "data.vocab_size" if self.kind == "lm" else "data.num_classes"
            raise TaskOutputError(
                f"the model's output has shape {_shape(logits.shape)}; task.kind={self.kind} "
                f"needs {what} = {_shape(wanted)} (batch and sequence from the inputs, "
                f"the last from {size}={self.num_outputs})"
            )
        return logits

    def loss(
        self, outputs: Any, targets: torch.Tensor, *, inputs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean loss of one micro-batch, the scalar whose gradient is trained on: the
        task's loss plus the outputs' `.aux_loss`, if they carry one."""
        loss = self.task_loss(outputs, targets, inputs=inputs)
        aux = getattr(outputs, "aux_loss", None)
        if not isinstance(aux, torch.Tensor):
            return loss
        # Here, not at the top: DTensor costs every process that imports trainstack most
        # of a second, and only a sharded model's loss can be one.
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(loss, DTensor) and not isinstance(aux, DTensor):
            # a cross-entropy on vocabulary-sharded logits (loss_parallel) is a DTensor; a
            # balance loss every tensor-parallel rank computed whole joins it as one
            aux = DTensor.from_local(aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim)
        return loss + aux.to(loss.dtype)

    def task_loss(
        self, outputs: Any, targets: torch.Tensor, *, inputs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mean cross-entropy (or `task.loss`, or `dpo`'s loss) of one micro-batch."""
        if self.kind == "dpo":
            return self.preferences(outputs, targets).losses.mean()
        own = getattr(outputs, "loss", None)
        if self.fused_loss and isinstance(own, torch.Tensor):  # computed by the model
            return own
        if self.user_loss is not None:
            value = self.user_loss(outputs, (inputs, targets))
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise TaskOutputError(
                    f"task.loss returned {type(value).__name__}"
                    f"{_shape(value.shape) if isinstance(value, torch.Tensor) else ''}; "
                    "allowed: a scalar tensor"
                )
            return value.reshape(())
        logits = self.logits(outputs, targets).flatten(0, -2)
        if logits.dtype not in (torch.float32, torch.float64):  # bf16 logits: fp32 loss
            logits = logits.float()
        return nn.functional.cross_entropy(logits, targets.flatten())

    def preferences(self, outputs: Any, targets: torch.Tensor) -> Preferences:
        """`dpo`: each pair's loss, margin h and rewards, from the answers' summed (`ipo`:
        mean) log-probabilities under the policy and the reference."""
        if not isinstance(outputs, PreferenceOutputs):
            raise TaskOutputError(
                f"task.kind=dpo needs the policy's and the reference's outputs; got "
                f"{type(outputs).__name__}"
            )
        policy, count = _answer_logprobs(self.logits(outputs.logits, targets), targets)
        reference, _ = _answer_logprobs(outputs.reference.detach(), targets)
        if self.dpo_loss == "ipo":
            policy, reference = policy / count.clamp(min=1), reference / count.clamp(min=1)
        answered = count[0::2] > 0  # [b, K]: the pairs of each sample (packed: several)
        if not torch.equal(answered, count[1::2] > 0):
            raise TaskOutputError(
                "task.kind=dpo: a sample's chosen and rejected rows hold different numbers "
                "of answers"
            )
        ratios = policy - reference
        chosen, rejected = ratios[0::2][answered], ratios[1::2][answered]
        ratio = torch.stack([chosen, rejected], dim=1).flatten()
        margins = ratio[0::2] - ratio[1::2]
        beta = self.dpo_beta
        if self.dpo_loss == "ipo":
            losses = (margins - 1 / (2 * beta)) ** 2
        else:
            losses = -nn.functional.logsigmoid(beta * margins)
        rewards = beta * ratio.detach()
        return Preferences(
            losses=losses,
            margins=margins.detach(),
            chosen_rewards=rewards[0::2],
            rejected_rewards=rewards[1::2],
        )

    def pipeline_loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """`loss` as a pipeline schedule calls it on the last stage: (outputs, targets)."""
        return self.loss(outputs, targets)

    def batch_sums(
        self, outputs: Any, targets: torch.Tensor, *, inputs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float64 [loss × count, count, correct] of one held-out micro-batch; targets of
        -100 (chat: tokens no assistant wrote, padding) are not counted. `dpo`: over
        pairs, correct where h > 0, then the chosen and rejected rewards' sums."""
        if self.kind == "dpo":
            p = self.preferences(outputs, targets)
            values = [
                p.losses.sum(),
                torch.tensor(len(p.losses)),
                (p.margins > 0).sum(),
                p.chosen_rewards.sum(),
                p.rejected_rewards.sum(),
            ]
            return torch.stack([v.detach().double().cpu() for v in values])
        scored = targets != IGNORED_TARGET
        count = int(scored.sum())
        loss = self.task_loss(outputs, targets, inputs=inputs).detach().double()
        if count == 0:  # nothing scored: cross-entropy's mean is 0 / 0
            return torch.zeros(3, dtype=torch.float64)
        logits = getattr(outputs, "logits", outputs)
        correct = 0  # a user loss may take outputs that are not logits: no accuracy then
        if isinstance(logits, torch.Tensor) and logits.shape == (*targets.shape, self.num_outputs):
            correct = int(((logits.argmax(dim=-1) == targets) & scored).sum())
        return torch.tensor([float(loss) * count, count, correct], dtype=torch.float64)


@dataclass(frozen=True, kw_only=True)
class EvalSums:
    """Held-out sums over a group: loss × count, count (tokens or samples), correct."""

    loss_sum: float
    count: int
    correct: int
    extra: tuple[float, ...] = ()
    """`dpo`: the chosen and rejected answers' reward sums."""

    @classmethod
    def of(cls, sums: torch.Tensor) -> EvalSums:
        return cls(
            loss_sum=float(sums[0]),
            count=int(sums[1]),
            correct=int(sums[2]),
            extra=tuple(float(v) for v in sums[3:]),
        )

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else math.nan

    def metrics(self, task: Task) -> dict[str, float]:
        """`eval_loss` and the task's other held-out figures."""
        loss = self.loss
        accuracy = self.correct / self.count if self.count else math.nan
        if task.kind == "classify":
            return {"eval_loss": loss, "eval_accuracy": accuracy}
        if task.kind == "dpo":
            chosen, rejected = (s / self.count if self.count else math.nan for s in self.extra)
            return {
                "eval_loss": loss,
                "eval_accuracy": accuracy,
                "eval_reward_chosen": chosen,
                "eval_reward_rejected": rejected,
                "eval_reward_margin": chosen - rejected,
            }
        return {
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 700.0)),
            "eval_bits_per_token": loss / math.log(2),
            "eval_accuracy": accuracy,
        }


def build_task(cfg: JobConfig) -> Task:
    """The job's task, with `task.loss` imported (ConfigError if it cannot be)."""
    from trainstack.user_code import import_target

    user_loss = import_target(cfg.task.loss, key="task.loss") if cfg.task.loss else None
    if user_loss is not None and not callable(user_loss):
        raise ConfigError(
            f"task.loss={cfg.task.loss!r} is a {type(user_loss).__name__}; "
            "allowed: a function fn(outputs, batch) -> scalar tensor"
        )
    num_outputs = cfg.data.vocab_size if cfg.task.kind in ("lm", "dpo") else cfg.data.num_classes
    return Task(
        kind=cfg.task.kind,
        num_outputs=num_outputs,
        user_loss=user_loss,
        input_dtype=torch.float64 if cfg.train.precision == "fp64" else None,
        fused_loss=cfg.model.fused_loss,
        dpo_beta=cfg.dpo.beta,
        dpo_loss=cfg.dpo.loss,
    )


@torch.no_grad()
def evaluate(
    task: Task,
    forward: Callable[[torch.Tensor], Any | None],
    batches: Iterable[Batch],
    *,
    device: torch.device,
) -> torch.Tensor:
    """float64 [loss × count, count, correct] over `batches` on this rank.

    `forward(inputs)` returns the model's outputs, or None on a rank that does not hold
    them (a pipeline's earlier stages), which adds nothing. Sum the result over the
    group and read it with `EvalSums.of`.
    """
    sums = torch.zeros(task.sums_size, dtype=torch.float64)
    for x, y in batches:
        if task.input_dtype is not None and x.is_floating_point():
            x = x.to(task.input_dtype)
        x, y = x.to(device), y.to(device)
        outputs = forward(x)
        if outputs is not None:
            sums += task.batch_sums(outputs, y, inputs=x).cpu()
    return sums.to(device)


def _answer_logprobs(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's summed log-probability of its scored targets (not -100), and how
    many there are, as [rows, K]: an answer is a run of scored targets, K the most a row
    holds (1 padded; a packed row's answers in order, 0 tokens past its last)."""
    if logits.dtype not in (torch.float32, torch.float64):  # bf16 logits: fp32 sums
        logits = logits.float()
    scored = targets != IGNORED_TARGET
    picked = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
    before = torch.nn.functional.pad(scored[:, :-1], (1, 0))  # the position before each
    answer = torch.cumsum(scored & ~before, dim=-1) - 1  # each scored target's answer
    k = max(int(answer.max()) + 1, 1)
    slot = answer.clamp(min=0)
    sums = torch.zeros(scored.shape[0], k, dtype=picked.dtype, device=picked.device)
    sums = sums.scatter_add(1, slot, picked.squeeze(-1) * scored)
    counts = torch.zeros(scored.shape[0], k, dtype=torch.long, device=scored.device)
    return sums, counts.scatter_add(1, slot, scored.long())


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """`model` (or a wrapper of it: DDP, FSDP, DeepSpeed's engine) computing without its
    adapters inside: each LoRA layer's scale set to 0 (peft's `scale_layer`), so it adds
    exactly nothing to its base layer's output, and restored to alpha / rank after. What
    DPO's reference is, with no second copy of the model held."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.scale_layer(0.0)
    try:
        yield
    finally:
        for layer in layers:
            layer.unscale_layer()


REFERENCE_ATTRIBUTE = "trainstack_dpo_reference"


def attach_reference(policy: nn.Module, reference: nn.Module) -> None:
    """DPO without `model.lora`: `reference`, a frozen copy of `policy` as it started and
    placed as the strategy places the policy, becomes the one `Task.outputs` runs. It is
    held as a plain attribute, not a submodule, so it stays out of the policy's
    parameters, state dict, gradients, optimizer and checkpoints (it is rebuilt from
    the base at every start)."""
    reference.requires_grad_(False)
    object.__setattr__(policy, REFERENCE_ATTRIBUTE, reference)


def attached_reference(model: nn.Module) -> nn.Module | None:
    """The reference `attach_reference` gave `model` or the module a wrapper of it holds
    (DDP's, DeepSpeed's engine), else None."""
    for module in model.modules():
        reference = module.__dict__.get(REFERENCE_ATTRIBUTE)
        if reference is not None:
            return reference
    return None


def held_parameters(model: nn.Module) -> list[nn.Parameter]:
    """`model`'s parameters and its attached reference's: what a rank holds, for memory
    meters (the reference is no submodule, so `model.parameters()` misses it)."""
    reference = attached_reference(model)
    return [*model.parameters(), *(reference.parameters() if reference is not None else ())]


def eval_mode(modules: Iterable[nn.Module]) -> Callable[[], None]:
    """Put `modules` in eval mode; the returned function restores their training modes."""
    saved = [(m, m.training) for m in modules]
    for m, _ in saved:
        m.eval()

    def restore() -> None:
        for m, training in saved:
            m.train(training)

    return restore


def _shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"
