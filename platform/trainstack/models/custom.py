"""Your own model: `model.kind: custom` builds `target(**args)`.

`target` is `package.module:attribute`, an `nn.Module` class or a factory that returns
one. Everything the driver can check before Ray starts fails as one `ConfigError`
line: the import, the call, what it returned, and that it has parameters.
"""

from __future__ import annotations

from torch import nn

from trainstack.config import ConfigError, ModelConfig
from trainstack.user_code import call_target


def build_custom_model(cfg: ModelConfig, *, vocab_size: int = 0) -> nn.Module:
    """`cfg.target(**cfg.args)`, checked to be an `nn.Module` with parameters (`vocab_size`
    is not used: the user's args size their model)."""
    model = call_target(
        cfg.target, cfg.args, key="model.target", args_key="model.args", makes="an nn.Module"
    )
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.target={cfg.target!r} returned a {type(model).__name__}; allowed: an "
            "nn.Module (return the model from your factory)"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"model.target={cfg.target!r} built a {type(model).__name__} with no trainable "
            "parameters; there is nothing to train"
        )
    return model
