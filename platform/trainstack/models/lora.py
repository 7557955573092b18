"""Low-rank adapters (`model.lora`), by `peft`: its LoRA layers injected into the model in
place, every other weight frozen.

`peft.inject_adapter_in_model` swaps each targeted `nn.Linear` for peft's `lora.Linear`
(the original under `base_layer`, the adapters under `lora_A.default` and
`lora_B.default`) and leaves only the adapters trainable; the model keeps its class, its
forward and its other state-dict keys. B starts at zero, so the adapted model computes
what the model did. The optimizer takes the parameters that train
(`optim.build_optimizer`), so it holds the adapters' state alone; the strategies shard
or replicate the model as it is, frozen weights and all.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainstack.config import ConfigError, ModelConfig

ADAPTER = "default"
"""The adapter's name inside peft's layers (its state-dict keys hold it)."""

GPT_TARGETS = ("q_proj", "v_proj")
"""trainstack's GPT: the attention's query and value projections (what peft picks for
llama-like families)."""


def lora_targets(model: nn.Module, cfg: ModelConfig) -> tuple[str, ...]:
    """The module names `model.lora.target_modules` gives, else the model's defaults: a
    Hugging Face family's as peft lists them, the GPT's `GPT_TARGETS`; ConfigError for a
    model with no default."""
    if cfg.lora.target_modules:
        return tuple(cfg.lora.target_modules)
    family = getattr(model, "family", None)
    if family is not None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        found = DEFAULTS.get(family)
        if found:
            return tuple(found)
        raise ConfigError(
            f"model.lora: peft has no default target modules for model_type {family!r}; "
            f"name them in model.lora.target_modules (its linear layers: {_linear_names(model)})"
        )
    if cfg.kind == "gpt":
        return GPT_TARGETS
    raise ConfigError(
        f"model.lora.target_modules is empty and model.kind={cfg.kind} has no default; name "
        f"the linear layers to adapt (this model's: {_linear_names(model)})"
    )


def add_lora(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Inject `cfg.lora`'s adapters into `model` in place (their initial values drawn from
    torch's global generator: seed it for ranks to agree); every other parameter frozen.
    ConfigError, naming the model's linear layers, when a target matches none."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ConfigError(f"model.lora needs peft ({e}); pip install 'trainstack[hf]'") from None

    targets = lora_targets(model, cfg)
    matched = [name for name, module in model.named_modules() if _matches(name, targets)]
    if not matched:
        raise ConfigError(
            f"model.lora.target_modules={list(targets)} matches no module of "
            f"{type(model).__name__}; its linear layers: {_linear_names(model)}"
        )
    not_linear = sorted(
        {type(m).__name__ for n, m in model.named_modules() if n in matched} - {"Linear", "Conv1D"}
    )
    if not_linear:
        raise ConfigError(
            f"model.lora.target_modules={list(targets)} names {', '.join(not_linear)} "
            f"modules; allowed: linear layers ({_linear_names(model)})"
        )
    inject_adapter_in_model(_lora_config(LoraConfig, cfg, targets), model, adapter_name=ADAPTER)
    return model


def peft_config(cfg: ModelConfig, model: nn.Module, *, base: str = "") -> Any:
    """`cfg.lora` as peft's `LoraConfig` of a causal LM (what an adapter folder records;
    `base`: the base model's folder)."""
    from peft import LoraConfig

    return _lora_config(
        LoraConfig,
        cfg,
        lora_targets(model, cfg),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base or None,
    )


def _lora_config(
    config_class: Any, cfg: ModelConfig, targets: tuple[str, ...], **extra: Any
) -> Any:
    """peft's `LoraConfig` of `cfg.lora` over `targets` (and `extra` keys)."""
    return config_class(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=list(targets),
        bias="none",
        **extra,
    )


def _structure(cfg: ModelConfig, *, vocab_size: int) -> nn.Module:
    """`cfg`'s model, adapters included, on the meta device: its names and shapes, no
    weight allocated or read."""
    import torch

    from trainstack.models import build_model

    with torch.device("meta"):
        return build_model(cfg, vocab_size=vocab_size, seed=0, pretrained_on_meta=True)


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key is an adapter's (`...lora_A.default.weight`)."""
    return ".lora_A." in key or ".lora_B." in key


def adapter_state(weights: dict[str, Any]) -> dict[str, Any]:
    """The adapters of a LoRA model's state dict, under peft's saved names (the adapter
    name dropped: `...q_proj.lora_A.weight`)."""
    return {
        key.replace(f".{ADAPTER}.", "."): value
        for key, value in weights.items()
        if is_adapter_key(key)
    }


def base_state(weights: dict[str, Any]) -> dict[str, Any]:
    """The frozen weights of a LoRA model's state dict under the model's own names
    (`base_layer.` dropped): what the model without adapters loads."""
    return {
        key.replace(".base_layer.", "."): value
        for key, value in weights.items()
        if not is_adapter_key(key)
    }


def trainable_parameters(model: nn.Module) -> int:
    """Parameters the optimizer holds (each shared tensor counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith(f".{t}") for t in targets)


def _linear_names(model: nn.Module) -> str:
    names = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    )
    return ", ".join(names[:20]) or "none"


def merged_weights(cfg: ModelConfig, *, vocab_size: int, weights: dict[str, Any]) -> dict[str, Any]:
    """A LoRA model's state dict with each adapter folded into its weight by peft
    (`W + (alpha / rank) · B·A`): the state dict of the model without adapters."""
    import torch
    from peft.tuners.lora import LoraLayer

    model = _structure(cfg, vocab_size=vocab_size)
    model.load_state_dict(weights, strict=True, assign=True)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.merge(adapter_names=[ADAPTER])
    return base_state(model.state_dict())


def write_adapter_folder(
    cfg: ModelConfig, *, vocab_size: int, weights: dict[str, Any], directory: Any
) -> None:
    """The run's adapters as a peft adapter folder (`adapter_config.json` and
    `adapter_model.safetensors`, the keys as `PeftModel.save_pretrained` writes them),
    which `peft.PeftModel.from_pretrained(base, directory)` loads over the base model
    (for a Hugging Face family, `AutoModelForCausalLM` of the base folder). Written
    beside `directory` and renamed into place."""
    import os
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    model = _structure(cfg, vocab_size=vocab_size)
    config = peft_config(cfg, model, base=cfg.pretrained)
    if getattr(model, "family", None) is None:
        config.task_type = None  # a module of the user's own: PeftModel's generic wrapper
    tensors = {
        f"base_model.model.{key}": value.detach().contiguous()
        for key, value in adapter_state(weights).items()
    }
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def kept_weights(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """The weights a checkpoint keeps: with `model.lora` the adapters alone (the frozen
    base is rebuilt from `model.pretrained` or the seed, and the manifest names it),
    else all of them."""
    if not cfg.lora.rank:
        return weights
    return {key: value for key, value in weights.items() if is_adapter_key(key)}


def load_weights(model: nn.Module, weights: dict[str, Any], *, cfg: ModelConfig) -> None:
    """A checkpoint's weights into `model`: every tensor, or with `model.lora` the
    adapters over the base the model was built with (every adapter present, nothing
    else missing but frozen weights)."""
    if not cfg.lora.rank:
        model.load_state_dict(weights)
        return
    check_adapters_loaded(model.load_state_dict(weights, strict=False))


def check_adapters_loaded(loaded: Any) -> None:
    """Raise unless a non-strict `load_state_dict` of a LoRA checkpoint (its result,
    `loaded`) found every adapter and nothing unknown: only frozen weights may be missing."""
    missing = [key for key in loaded.missing_keys if is_adapter_key(key)]
    if missing or loaded.unexpected_keys:
        raise RuntimeError(
            f"the checkpoint's adapters do not fit model.lora: missing {missing[:3]}, "
            f"unexpected {loaded.unexpected_keys[:3]}"
        )


def whole_weights(checkpoint: Any) -> dict[str, Any]:
    """The whole state dict of a checkpoint's model: its files' weights, or for a LoRA
    run's (whose files hold the adapters) the base rebuilt as the run built it (from
    `model.pretrained`, whose fingerprint must still be the manifest's, or the seed)
    with the adapters loaded over it."""
    from trainstack.checkpoint import check_same_base
    from trainstack.config import config_from_dict
    from trainstack.models import build_model

    weights: dict[str, Any] = checkpoint.full_weights()
    if "lora" not in checkpoint.manifest:
        return weights
    cfg = config_from_dict(checkpoint.manifest["spec"])
    check_same_base(checkpoint, cfg)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    load_weights(model, weights, cfg=cfg.model)
    dtype = next(iter(weights.values())).dtype if weights else None
    return {k: v.to(dtype) if dtype is not None else v for k, v in model.state_dict().items()}
