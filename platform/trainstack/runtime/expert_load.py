"""How a model's MoE layers route: counted on each rank, summed over the group each step.

Each step the layers' per-expert assignments and dropped ones (`models/moe.py`) are
summed over every rank (a collective), the `balance: bias` layers' routing bias moves by
that load, and the load adds up until the next log record, which gets the period's drop
rate, balance (coefficient of variation) and per-expert shares, and the all-to-all bytes
this rank sent per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainstack.models.moe import load_metrics, moe_layers, take_load, update_balance_bias


class ExpertLoad:
    def __init__(self, model: nn.Module, *, device: torch.device) -> None:
        self.model, self.device = model, device
        take_load(model)  # what the model's probe forwards counted is not training
        self.period: torch.Tensor | None = None
        self.run: torch.Tensor | None = None
        self.steps = self.run_steps = 0
        self.sent = self.run_sent = self._sent()

    @classmethod
    def of(cls, model: nn.Module, *, device: torch.device) -> ExpertLoad | None:
        return cls(model, device=device) if moe_layers(model) else None

    def _sent(self) -> int:
        return sum(layer.a2a_bytes for layer in moe_layers(self.model))

    def after_step(self) -> None:
        """Sum the step's load over the group (every rank calls it) and move the biases."""
        load = take_load(self.model)
        assert load is not None
        if dist.is_initialized() and dist.get_world_size() > 1:
            load = load.to(self.device)
            dist.all_reduce(load)
            load = load.cpu()
        update_balance_bias(self.model, load)
        self.period = load if self.period is None else self.period + load
        self.run = load if self.run is None else self.run + load
        self.steps += 1
        self.run_steps += 1

    def metrics(self) -> dict[str, float]:
        """The figures since the last call."""
        if self.period is None:
            return {}
        figures = load_metrics(self.period)
        sent = self._sent()
        figures["moe_a2a_bytes_per_step"] = (sent - self.sent) / max(self.steps, 1)
        self.period, self.sent, self.steps = None, sent, 0
        return figures

    def run_metrics(self) -> dict[str, float]:
        """The whole run's drop rate, balance and all-to-all bytes per step."""
        if self.run is None:
            return {}
        figures = load_metrics(self.run)
        sent = (self._sent() - self.run_sent) / max(self.run_steps, 1)
        return {
            "moe_drop_rate": figures["moe_drop_rate"],
            "moe_load_cv": figures["moe_load_cv"],
            "moe_a2a_bytes_per_step_run": sent,
        }
