"""Models: the built-in ones (an explicit name -> class dict), your own module
(`custom`), Hugging Face causal LMs (`hf`), and a seeded builder for all of them.

A model is any `nn.Module`: for `task.kind: lm` it maps token ids `[B, T]` to logits
`[B, T, V]`, for `classify` inputs to `[B, C]`. Optional abilities, each a method the
model may have:

- `pipeline_layers() -> list[nn.Module]`: modules applied in order (the first takes
  the inputs, the last returns the outputs), where a pipeline may cut the model and
  whose repeated blocks activation checkpointing wraps. An `nn.Sequential` is its
  own layers.
- `flops_per_token() -> int`: training FLOPs per token (per sample for classify);
  without it they are counted once on one micro-batch (models/flops.py).
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainstack.config import ConfigError, ModelConfig
from trainstack.kinds import MODEL_KINDS
from trainstack.models.gpt import GPT
from trainstack.models.mlp import WindowMLP

Model = GPT | WindowMLP
"""The built-in models."""

MODELS: dict[str, type[Model]] = {k.name: k.builder() for k in MODEL_KINDS.values() if k.builtin}
"""The built-in models by `model.kind` (their parameters are counted by formula)."""


def build_model(
    cfg: ModelConfig, *, vocab_size: int, seed: int, pretrained_on_meta: bool = False
) -> nn.Module:
    """Build `cfg.kind` with weights that depend only on (cfg, vocab_size, seed).

    Every rank calling this with the same seed gets identical weights. The global
    torch RNG is left as it was: the CPU generator is seeded inside `fork_rng`. With
    `activation_checkpointing`, the model's repeated blocks recompute their
    activations in the backward pass. `pretrained_on_meta` (for a strategy that reads
    `model.pretrained` rank by rank): the pretrained model's parameters stay on the
    meta device where its folder allows (`on_meta.has_meta_parameters` says), for the
    strategy to fill. With `model.lora`, the adapters are added (seeded too) and every
    other weight is frozen (models/lora.py).
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        model = _construct(cfg, vocab_size=vocab_size, on_meta=pretrained_on_meta)
        if cfg.lora.rank:
            from trainstack.models.lora import add_lora

            add_lora(model, cfg)
    if cfg.activation_checkpointing:
        blocks = checkpoint_blocks(model, class_names=cfg.checkpoint_modules)
        if not blocks:
            raise ConfigError(_no_blocks_message(model, cfg))
    return model


def _construct(cfg: ModelConfig, *, vocab_size: int, on_meta: bool) -> nn.Module:
    if cfg.kind not in MODEL_KINDS:
        allowed = ", ".join(MODEL_KINDS)
        raise ConfigError(f"model.kind: unknown model {cfg.kind!r}; allowed: {allowed}")
    # model.pretrained is a key of model.kind hf alone, whose builder takes `on_meta`
    options = {"on_meta": True} if on_meta and cfg.pretrained else {}
    model: nn.Module = MODEL_KINDS[cfg.kind].builder()(cfg, vocab_size=vocab_size, **options)
    return model


def pipeline_layers(model: nn.Module) -> list[nn.Module] | None:
    """The model's layers in order (its `pipeline_layers()`, or an `nn.Sequential`'s
    children); None when it has neither."""
    method = getattr(model, "pipeline_layers", None)
    if callable(method):
        layers: list[nn.Module] = list(method())
        return layers
    if isinstance(model, nn.Sequential):
        return list(model)
    return None


def num_params(model: nn.Module) -> int:
    """Parameters, each shared tensor counted once."""
    return sum(p.numel() for p in model.parameters())


def checkpoint_blocks(model: nn.Module, *, class_names: tuple[str, ...] = ()) -> list[nn.Module]:
    """Make the model's blocks recompute their activations in the backward pass; return them.

    The blocks are the modules whose class is named in `class_names`, else the
    pipeline layers whose class repeats (a GPT's blocks, not its embedding or head).
    Each block's forward is replaced on the instance by a bound method, which a deep
    copy (a pipeline stage) rebinds to the copy.
    """
    blocks = repeated_blocks(model, class_names=class_names)
    for block in blocks:
        block.forward = types.MethodType(_checkpointed_forward, block)
    return blocks


def block_classes(model: nn.Module, *, class_names: tuple[str, ...] = ()) -> set[str]:
    """Class names of the model's repeated blocks (see `repeated_blocks`)."""
    return {type(block).__name__ for block in repeated_blocks(model, class_names=class_names)}


def compile_blocks(root: nn.Module, *, classes: set[str]) -> list[nn.Module]:
    """torch.compile every module under `root` whose class is in `classes`, in place
    (`nn.Module.compile`: names, parameters and hooks stay; hooks added later, such as
    FSDP's, are traced on the first call). Blocks of one class share their compiled
    code, as torchtitan's per-block compile does; return them."""
    blocks = [m for m in root.modules() if type(m).__name__ in classes]
    for block in blocks:
        block.compile()
    return blocks


def compiled_blocks(root: nn.Module) -> list[nn.Module]:
    """The modules under `root` that `compile_blocks` compiled."""
    return [m for m in root.modules() if getattr(m, "_compiled_call_impl", None) is not None]


def repeated_blocks(model: nn.Module, *, class_names: tuple[str, ...] = ()) -> list[nn.Module]:
    """The model's blocks: the modules whose class is named in `class_names` or in the
    model's own `block_classes` (a Hugging Face family that runs its own forward), else
    the pipeline layers whose class repeats (a GPT's blocks, not its embedding or head)."""
    class_names = class_names or tuple(getattr(model, "block_classes", ()))
    if class_names:
        return [m for m in model.modules() if type(m).__name__ in class_names]
    layers = pipeline_layers(model) or []
    counts = Counter(type(layer) for layer in layers)
    return [layer for layer in layers if counts[type(layer)] > 1]


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = type(self).forward.__get__(self)
    if self.training and torch.is_grad_enabled():
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return inner(*args, **kwargs)


def _no_blocks_message(model: nn.Module, cfg: ModelConfig) -> str:
    if cfg.checkpoint_modules:
        names = sorted({type(m).__name__ for m in model.modules()})
        return (
            f"model.checkpoint_modules={list(cfg.checkpoint_modules)} matches no module of "
            f"{type(model).__name__}; its module classes are: {', '.join(names[:20])}"
        )
    return (
        f"model.activation_checkpointing=true, but {type(model).__name__} has no repeated "
        "blocks to checkpoint; name their class in model.checkpoint_modules, or give the "
        "model a pipeline_layers() method"
    )


__all__ = [
    "GPT",
    "MODELS",
    "Model",
    "WindowMLP",
    "build_model",
    "checkpoint_blocks",
    "num_params",
    "pipeline_layers",
    "repeated_blocks",
]
