"""Your own model: `model.kind: custom` builds `target(**args)`.

`target` is `package.module:attribute`, an `nn.Module` class or a factory that returns
one. Everything the driver can check before Ray starts fails as one `ConfigError`
line: the import, the call, what it returned, and that it has parameters.
"""

from __future__ import annotations

from torch import nn

from trainstack.config import ConfigError, ModelConfig
from trainstack.user_code import describe_exception, import_target


def build_custom_model(cfg: ModelConfig) -> nn.Module:
    """`cfg.target(**cfg.args)`, checked to be an `nn.Module` with parameters."""
    target = import_target(cfg.target, key="model.target")
    if not callable(target):
        raise ConfigError(
            f"model.target={cfg.target!r} is a {type(target).__name__}, not callable; "
            "allowed: an nn.Module class or a function returning an nn.Module"
        )
    try:
        model = target(**cfg.args)
    except Exception as e:
        raise ConfigError(
            f"model.target={cfg.target!r} raised {describe_exception(e)} when called with "
            f"model.args={cfg.args!r}"
        ) from None
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
