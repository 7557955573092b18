"""Hugging Face causal LMs (`model.kind: hf`), built from a config: nothing is downloaded.

Any `model_type` that transformers' `AutoModelForCausalLM` builds is a family (llama,
qwen2, qwen3, mistral, gemma3_text, phi3, olmo2, mixtral, qwen3_moe, ...). The HF config
is `model.hf` (any key of the family's config class, or an alias such as gpt2's
`hidden_size`) over these defaults: max positions = `model.block_size`, the family's
dropout keys = `model.dropout`, no special token ids outside the vocabulary, the
family's own `tie_word_embeddings`. `vocab_size` is `data.vocab_size`, weights are fp32
and attention is sdpa (eager for a family without sdpa). With `model.pretrained`, the
saved config.json and weights are the start; `model.dropout` and `model.hf` override
the saved config only where every saved weight still loads as it is (dropout or rope
may change, not layers or widths), and `model.hf.model_type`, if given, must be the
saved one. Every rank loads the whole model, except under a strategy that shards or cuts
it (fsdp, the torch pipelines, zero; `LoadsPretrainedParts`): there each rank builds it
with its parameters on the meta device and reads only its own part of each saved tensor
(`build_hf_model`'s `on_meta`; docs/model.md).

`HFCausalLM` holds the HF model's top-level modules under their own names (state_dict
keys are HF's). A family with pipeline layers here (`FAMILIES`: llama, gpt2) computes
logits by applying `pipeline_layers()` in order, the code a pipeline stage runs
(`models/hf_layers.py`): decoder layers get no attention mask, so sdpa runs causal
(`is_causal`, as HF's own forward on unpadded input) - hence sdpa only. Every other
family runs its own HF forward (its masks, sliding windows, rotary embeddings and
experts as transformers writes them) and trains under ddp, zero, fsdp (its
`_no_split_modules` blocks are the FSDP units and what activation checkpointing
recomputes) and the parameter server; its pipeline layers are cut by its own
`base_model_pp_plan` and `_pp_plan` and checked once against its forward: a family
whose forward does more than those modules is refused a pipeline in one line. Tensor
parallelism splits any family by its own `base_model_tp_plan`, the mixtures of experts'
packed experts included (`strategies/tensor_parallel.py`): one without a plan (gpt2,
falcon) or with a style trainstack does not apply is refused in one line. Ties: a tied
embedding stays one Parameter, in the first layer and the last. A mixture-of-experts
family trains on the cross-entropy alone, or with `output_router_logits` also on its
balance loss (see `HFCausalLM.forward`). Packed chat rows (`data.pack`: inputs
[B, 2, T], token ids and position ids restarting at each conversation) reach a family's
own forward, which keeps each conversation to itself; the pipeline layers do the same
(they hand the position ids on beside the hidden states, and each decoder layer builds
the packed-sequence mask from them).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainstack.checkpoint.pretrained import saved_shapes
from trainstack.config import ConfigError, ModelConfig
from trainstack.errors import show
from trainstack.models.hf_layers import (
    FAMILIES,
    HFFamily,
    check_plan_layers,
    plan_layers,
    split_packed,
)
from trainstack.models.moe import MoEOutput
from trainstack.models.on_meta import (
    has_meta_parameters,
    parameters_on_meta,
    saved_misfits,
    tensor_names,
)
from trainstack.models.sequence_shard import packed_documents

DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")
"""The dropout keys a family's config may have (`model.dropout` fills those it has)."""
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")
"""Where a family's config keeps the longest sequence it takes."""

_FP32 = "weights are fp32 and train.precision sets the compute precision"
OWNED_KEYS: dict[str, str] = {
    "vocab_size": "the vocabulary follows data.vocab_size, so set that instead",
    "dtype": _FP32,
    "torch_dtype": _FP32,
}
"""`model.hf` keys that trainstack sets itself, and why."""

SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as a trainstack model: token ids [B, T] -> logits [B, T, V].

    Its children are the HF model's own (`model` and `lm_head` for llama, `transformer`
    and `lm_head` for gpt2), so `state_dict()` has exactly HF's keys and tied weights
    stay one Parameter. `config` is the HF config, `family` its model_type.
    """

    def __init__(self, hf_model: nn.Module, *, family: str) -> None:
        super().__init__()
        own_state = [*hf_model.parameters(recurse=False), *hf_model.buffers(recurse=False)]
        assert not own_state, "HF keeps state in children"
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self.config: Any = getattr(hf_model, "config")  # noqa: B009
        self.family = family
        self._kept_layers: list[nn.Module] = []
        self.__dict__["_hf"] = hf_model  # its children are ours: not registered twice
        adapted = family in FAMILIES
        no_split = getattr(hf_model, "_no_split_modules", None) or ()
        self.block_classes: tuple[str, ...] = () if adapted else tuple(sorted(no_split))
        """The decoder block classes (FSDP units, what activation checkpointing and
        compilation take) of a family that runs its own forward; empty: the pipeline
        layers' repeated ones."""

    @property
    def hf(self) -> Any:
        """The Hugging Face model this wraps (its children are this module's)."""
        return self.__dict__["_hf"]

    @property
    def body(self) -> nn.Module:
        """The HF model's base model (`model` for llama-like families): embedding,
        decoder layers, final norm."""
        return self.hf.get_submodule(self.hf.base_model_prefix)

    def pipeline_layers(self) -> list[nn.Module]:
        """Embedding, one layer per decoder block (all of one class), head.

        The layers only reference this model's modules. A layer is kept between calls
        while it wraps the same modules, so what is set on its instance (the forward
        that activation checkpointing installs) lasts; one whose modules were replaced is
        built anew.
        """
        if self.family in FAMILIES:
            build = FAMILIES[self.family].layers
            assert build is not None
            fresh = build(self)
        else:
            fresh = plan_layers(self)
            if not self._kept_layers and not has_meta_parameters(self):
                check_plan_layers(self, fresh)  # once; weights on meta: pre-flight checked
        kept = self._kept_layers
        layers = [
            kept[i] if i < len(kept) and _wraps_same(kept[i], layer) else layer
            for i, layer in enumerate(fresh)
        ]
        self._kept_layers = layers
        return list(layers)

    def forward(self, idx: torch.Tensor) -> torch.Tensor | MoEOutput:
        """Logits; a mixture-of-experts family configured with `output_router_logits`
        also returns its load-balancing loss times its `router_aux_loss_coef`, the
        weight its own forward gives it (`MoEOutput`: the task adds it to the loss).

        `idx` is token ids [B, T], or packed rows [B, 2, T] (`data.pack`): token ids and
        position ids that restart at 0 at each packed sequence. The family's own forward
        gets the position ids and, seeing them restart, lets each sequence attend only to
        itself (transformers' packed-sequence mask); the pipeline layers (llama, gpt2) hand
        them from layer to layer and give each block that same mask. Under context
        parallelism the rows come as [B, 3, T_local], the third row each token's document
        id, which the ring's attention keeps apart (`models/sequence_shard.py`)."""
        if idx.dim() == 3 and idx.shape[1] == 3:
            with packed_documents(idx[:, 2]):
                return self.forward(idx[:, :2].contiguous())
        if self.family not in FAMILIES:
            hf = self.hf
            tokens, positions = split_packed(idx)
            # no cache: with one, transformers skips the packed-sequence mask
            out = hf(input_ids=tokens, position_ids=positions, use_cache=False)
            aux = getattr(out, "aux_loss", None)
            if isinstance(aux, torch.Tensor):
                weight = getattr(hf.config, "router_aux_loss_coef", 1.0)
                return MoEOutput(logits=out.logits, aux_loss=weight * aux)
            logits: torch.Tensor = out.logits
            return logits
        x = idx
        for layer in self.pipeline_layers():
            x = layer(x)
        return x


def _wraps_same(old: nn.Module, new: nn.Module) -> bool:
    same_children = [id(m) for m in old.children()] == [id(m) for m in new.children()]
    return type(old) is type(new) and same_children


def build_hf_model(cfg: ModelConfig, *, vocab_size: int, on_meta: bool = False) -> HFCausalLM:
    """The HF causal LM `cfg` describes (randomly initialised, or `cfg.pretrained`'s
    weights), wrapped; ConfigError with one line for any mistake in `cfg`.

    `on_meta` with `cfg.pretrained`: its parameters stay on the meta device, for a
    strategy to read rank by rank (`models/on_meta.py`), once the folder's saved names
    and shapes are checked to fit them. A folder whose names transformers converts while
    loading (a mixture of experts' per-expert tensors, keys without the base model's
    prefix) or whose files it picks itself loads whole, as without `on_meta`."""
    transformers = _import_transformers()
    config = hf_config(cfg, vocab_size=vocab_size)
    auto = transformers.AutoModelForCausalLM
    if not cfg.pretrained:
        return HFCausalLM(_from_config(auto, config), family=config.model_type)
    where = f"model.pretrained={show(cfg.pretrained)}"
    saved = saved_shapes(Path(cfg.pretrained).expanduser()) if on_meta else None
    if saved is not None:
        with parameters_on_meta():
            empty = HFCausalLM(_from_config(auto, config), family=config.model_type)
        if saved.keys() <= {key for keys in tensor_names(empty) for key in keys}:
            if problems := saved_misfits(empty, saved):
                raise ConfigError(_misfit_line(where, problems))
            return empty
    try:
        hf_model, info = auto.from_pretrained(
            Path(cfg.pretrained).expanduser(),
            config=config,
            local_files_only=True,
            dtype=torch.float32,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, with the shapes
        )
    except Exception as e:
        raise ConfigError(f"{where}: its weights do not load: {_one_line(e)}") from None
    problems = {
        # a mismatched key is (name, saved shape, model shape)
        kind.removesuffix("_keys"): sorted(
            k if isinstance(k, str) else f"{k[0]} saved {list(k[1])} vs {list(k[2])}" for k in keys
        )
        for kind, keys in info.items()
        if keys
    }
    if problems:
        raise ConfigError(_misfit_line(where, problems))
    return HFCausalLM(hf_model, family=config.model_type)


def _misfit_line(where: str, problems: dict[str, list[str]]) -> str:
    found = "; ".join(f"{kind}: {_few(keys)}" for kind, keys in problems.items())
    return (
        f"{where}: the saved weights do not fit the model ({found}); model.hf may change "
        "only settings that shape no weight (dropout, rope), not layers or widths"
    )


def hf_config(cfg: ModelConfig, *, vocab_size: int) -> Any:
    """The HF config `cfg` describes (see the module docstring for what fills it)."""
    transformers = _import_transformers()
    if cfg.pretrained:
        saved = _saved_config(cfg, vocab_size=vocab_size, transformers=transformers)
        config_class: Any = type(saved)
        family = _family(saved.model_type, key="model_type", transformers=transformers)
        start: dict[str, Any] = saved.to_dict()
    else:
        model_type = str(cfg.hf["model_type"])
        family = _family(model_type, key="model.hf.model_type", transformers=transformers)
        config_class = transformers.CONFIG_MAPPING[model_type]
        start = {family.positions_key: cfg.block_size, "vocab_size": vocab_size}
        for key in SPECIAL_TOKEN_KEYS:
            default = config_class.__dataclass_fields__[key].default
            if isinstance(default, int) and not 0 <= default < vocab_size:
                start[key] = None
    dropout = dict.fromkeys(family.dropout_keys, cfg.dropout)
    keys = _user_keys(cfg.hf, config_class, adapted=config_class.model_type in FAMILIES)
    attention = keys.pop("attn_implementation", _attention(config_class, transformers))
    kernels = {k: keys.pop(k) for k in ("experts_implementation",) if k in keys}
    try:
        config = config_class.from_dict(
            {**start, **dropout, **keys}, attn_implementation=attention, **kernels
        )
    except Exception as e:
        raise ConfigError(
            f"model.hf: {config_class.model_type} refused it: {_one_line(e)}"
        ) from None
    _check_fits(config, family, block_size=cfg.block_size)
    return config


def _import_transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ConfigError(
            f"model.kind=hf needs Hugging Face transformers ({e}); pip install 'trainstack[hf]'"
        ) from None


def _family(model_type: str, *, key: str, transformers: Any) -> HFFamily:
    """The family's entry in `FAMILIES`, or one read from its config class (a family
    that runs its own forward); ConfigError for a model_type that is not a causal LM."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if model_type not in causal or model_type not in transformers.CONFIG_MAPPING:
        hint = difflib.get_close_matches(model_type, sorted(causal), n=3)
        raise ConfigError(
            f"{key}={show(model_type)} is not a causal LM transformers builds; allowed: any "
            f"AutoModelForCausalLM model_type (e.g. llama, qwen2, mistral, mixtral)"
            + (f"; did you mean {', '.join(hint)}?" if hint else "")
        )
    fields = {f.name for f in dataclasses.fields(transformers.CONFIG_MAPPING[model_type])}
    positions = next((k for k in POSITION_KEYS if k in fields), None)
    if positions is None:
        raise ConfigError(
            f"{key}={show(model_type)}: its config names no maximum sequence length "
            f"({', '.join(POSITION_KEYS)}), which model.block_size is checked against"
        )
    dropout = tuple(k for k in DROPOUT_KEYS if k in fields)
    return HFFamily(positions_key=positions, dropout_keys=dropout, fixed={}, layers=None)


def _attention(config_class: Any, transformers: Any) -> str:
    """sdpa where the family's model has it, else eager (a family whose own forward
    builds its masks may run either; the pipeline-layer families need sdpa)."""
    if config_class.model_type in FAMILIES:
        return "sdpa"
    model_class = transformers.AutoModelForCausalLM._model_mapping[config_class]
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def _user_keys(hf: dict[str, Any], config_class: Any, *, adapted: bool) -> dict[str, Any]:
    """`model.hf` without model_type, under the config class's own names (aliases
    resolved); ConfigError for a key the class lacks or one trainstack sets. An
    `attn_implementation` is kept: sdpa for a family with pipeline layers here (`adapted`),
    sdpa or eager for one that runs its own forward."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    aliases: dict[str, str] = dict(config_class.attribute_map)
    family = config_class.model_type
    keys: dict[str, Any] = {}
    for key, value in hf.items():
        if key == "model_type":
            continue
        if key in OWNED_KEYS:
            raise ConfigError(f"model.hf.{key}={show(value)} is set; {OWNED_KEYS[key]}")
        if key == "attn_implementation":
            if value != "sdpa" and (adapted or value != "eager"):
                allowed = (
                    "sdpa (decoder layers rely on its causal mode, masked on packed rows)"
                    if adapted
                    else "sdpa or eager"
                )
                raise ConfigError(
                    f"model.hf.attn_implementation={show(value)} is not supported; "
                    f"allowed: {allowed}"
                )
            keys["attn_implementation"] = value
            continue
        if key == "experts_implementation":  # a mixture of experts' kernels
            kernels = ("eager", "batched_mm", "grouped_mm")
            if value not in kernels:
                raise ConfigError(
                    f"model.hf.experts_implementation={show(value)} is not supported; "
                    f"allowed: {', '.join(kernels)} (eager runs in float64 too)"
                )
            keys["experts_implementation"] = value
            continue
        name = key if key in fields else aliases.get(key, key)  # a field wins over a stale alias
        if name not in fields:
            declared = vars(config_class).get("__annotations__", {})  # not PreTrainedConfig's
            own = sorted((set(declared) | set(aliases)) - set(OWNED_KEYS))
            hint = difflib.get_close_matches(key, sorted(fields | set(aliases)), n=1)
            raise ConfigError(
                f"model.hf.{key} is not a {family} config key"
                + (f" (did you mean {hint[0]}?)" if hint else "")
                + f"; allowed: {', '.join(own)}, or a PreTrainedConfig key"
            )
        if name in keys:
            raise ConfigError(f"model.hf sets {name} twice (once as {key}); keep one of them")
        keys[name] = value
    return keys


def _check_fits(config: Any, family: HFFamily, *, block_size: int) -> None:
    positions = getattr(config, family.positions_key)
    if positions < block_size:
        raise ConfigError(
            f"model.block_size={block_size} exceeds the model's {family.positions_key}="
            f"{positions}; allowed: block_size <= {positions}, or a larger "
            f"model.hf.{family.positions_key}"
        )
    for key, value in family.fixed.items():
        if getattr(config, key) != value:
            raise ConfigError(
                f"model.hf.{key}={show(getattr(config, key))} is not supported for "
                f"{config.model_type}; allowed: {show(value)}"
            )


def _saved_config(cfg: ModelConfig, *, vocab_size: int, transformers: Any) -> Any:
    """`cfg.pretrained`'s config, checked to be a supported family with the data's vocabulary."""
    path = Path(cfg.pretrained).expanduser()
    where = f"model.pretrained={show(cfg.pretrained)}"
    allowed = "allowed: a local directory written by save_pretrained (or trainstack export)"
    if not path.exists():
        raise ConfigError(f"{where} does not exist; {allowed}")
    if not path.is_dir():
        raise ConfigError(f"{where} is not a directory; {allowed}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where} has no config.json; {allowed}")
    try:
        saved = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ConfigError(f"{where}: its config.json does not load: {_one_line(e)}") from None
    _family(saved.model_type, key=f"{where}: model_type", transformers=transformers)
    wanted = cfg.hf.get("model_type", saved.model_type)
    if wanted != saved.model_type:
        raise ConfigError(
            f"model.hf.model_type={show(wanted)} but {where} is a {saved.model_type}; "
            "drop model.hf.model_type or make it match"
        )
    if saved.vocab_size != vocab_size:
        raise ConfigError(
            f"{where} has vocab_size={saved.vocab_size} but data.vocab_size={vocab_size}; "
            f"set data.vocab_size={saved.vocab_size} (the vocabulary the model was trained on)"
        )
    return saved


def _from_config(auto: Any, config: Any) -> nn.Module:
    try:
        model: nn.Module = auto.from_config(config, dtype=torch.float32)
    except Exception as e:
        raise ConfigError(
            f"model.hf: building {config.model_type} failed: {_one_line(e)}"
        ) from None
    return model


def export_pretrained(
    cfg: ModelConfig, *, vocab_size: int, weights: dict[str, torch.Tensor], directory: Path
) -> None:
    """Write `weights` (a full state dict with HF's keys, as `HFCausalLM` has them) as a
    save_pretrained directory (safetensors) that `AutoModelForCausalLM.from_pretrained`
    loads. Written beside `directory` and renamed into place; ConfigError if
    `directory` exists and is not empty, or the weights do not fit `cfg`."""
    directory = Path(directory)
    if directory.exists() and not (directory.is_dir() and not any(directory.iterdir())):
        raise ConfigError(
            f"{directory} already exists and is not an empty directory; allowed: a new path "
            "or an empty directory"
        )
    transformers = _import_transformers()
    config = hf_config(cfg, vocab_size=vocab_size)
    hf_model = _from_config(transformers.AutoModelForCausalLM, config)
    _load_weights(hf_model, weights)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        getattr(hf_model, "save_pretrained")(tmp)  # noqa: B009
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_weights(hf_model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load `weights` exactly: every key (a tied alias may be left out), right shapes."""
    own = hf_model.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}
    for key, tensor in own.items():
        aliases.setdefault(id(tensor), []).append(key)
    missing = [k for k in own if not any(a in weights for a in aliases[id(own[k])])]
    unexpected = [k for k in weights if k not in own]
    if missing or unexpected:
        raise ConfigError(
            f"the weights do not fit model.hf ({len(missing)} missing: {_few(missing)}; "
            f"{len(unexpected)} unexpected: {_few(unexpected)}); export with the spec they "
            "were trained with"
        )
    try:
        hf_model.load_state_dict(weights, strict=False)
    except RuntimeError as e:
        raise ConfigError(f"the weights do not fit model.hf: {_one_line(e)}") from None


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "") if keys else "none"


def _one_line(e: BaseException) -> str:
    """The whole message on one line (HF's first line alone often just says 'error:')."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    text = text or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


__all__ = ["FAMILIES", "HFCausalLM", "HFFamily", "build_hf_model", "export_pretrained", "hf_config"]
