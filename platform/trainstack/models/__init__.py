"""Models: an explicit name -> class dict and a seeded builder.

Every model maps `idx[B, T]` (token ids) to `logits[B, T, vocab]`, is causal, and
reports its parameter count and training FLOPs per token (for MFU).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from trainstack.config import ConfigError, ModelConfig
from trainstack.models.gpt import GPT
from trainstack.models.mlp import WindowMLP


@runtime_checkable
class TrainableModel(Protocol):
    """What the training loop and the metrics need from a model."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> logits [B, T, vocab]; position t sees tokens <= t."""
        ...

    def num_params(self) -> int:
        """Parameters, each shared tensor counted once."""
        ...

    def flops_per_token(self) -> int:
        """Training FLOPs (forward + backward) per token."""
        ...


Model = GPT | WindowMLP
"""Every model trainstack builds: an `nn.Module` that is also a `TrainableModel`."""

MODELS: dict[str, type[Model]] = {"gpt": GPT, "mlp": WindowMLP}


def build_model(cfg: ModelConfig, *, vocab_size: int, seed: int) -> Model:
    """Build `cfg.kind` with weights that depend only on (cfg, vocab_size, seed).

    Every rank calling this with the same seed gets identical weights. The global
    torch RNG is left as it was: the CPU generator is seeded inside `fork_rng`.
    """
    if cfg.kind not in MODELS:
        allowed = ", ".join(sorted(MODELS))
        raise ConfigError(f"model.kind: unknown model {cfg.kind!r}; allowed: {allowed}")
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return MODELS[cfg.kind](cfg, vocab_size=vocab_size)


__all__ = ["GPT", "MODELS", "Model", "TrainableModel", "WindowMLP", "build_model"]
