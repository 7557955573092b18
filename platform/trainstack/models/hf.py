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
logits by applying `pipeline_layers()` in order, the code a pipeline stage runs:
decoder layers get no attention mask, so sdpa runs causal (`is_causal`, as HF's own
forward on unpadded input) - hence sdpa only; on packed rows they get the mask HF's own
forward builds (below). Every other family runs its own HF
forward (its masks, sliding windows, rotary embeddings and experts as transformers
writes them) and trains under ddp, zero, fsdp (its `_no_split_modules` blocks are the
FSDP units and what activation checkpointing recomputes) and the parameter server; its
pipeline layers are cut by its own `base_model_pp_plan` and `_pp_plan` (`plan_layers`)
and checked once against its forward (`check_plan_layers`): a family whose forward
does more than those modules is refused a pipeline in one line. Tensor parallelism
splits any family by its own `base_model_tp_plan` (`strategies/tensor_parallel.py`):
one without a plan (gpt2, falcon) or whose plan splits its experts inside (mixtral,
qwen3_moe) is refused in one line. Ties: a tied embedding stays one Parameter, in the
first layer and the last. A mixture-of-experts family trains on the cross-entropy
alone, or with `output_router_logits` also on its balance loss (see
`HFCausalLM.forward`). Packed chat rows (`data.pack`: inputs [B, 2, T], token ids and
position ids restarting at each conversation) reach a family's own forward, which keeps
each conversation to itself; the pipeline layers (llama's and gpt2's forward, and every
family's under a pipeline) do the same: the embedding hands on (hidden states, position
ids; gpt2's adds its position embedding at them), so a pipeline stage sends the
position ids beside its activations, and each decoder layer takes them (its rotary
angles) with the packed-sequence mask transformers builds from them (`packed_mask`). Unpacked rows
pass hidden states alone, as before.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from trainstack.checkpoint.pretrained import saved_shapes
from trainstack.config import ConfigError, ModelConfig
from trainstack.errors import show
from trainstack.models.moe import MoEOutput
from trainstack.models.on_meta import (
    has_meta_parameters,
    parameters_on_meta,
    saved_misfits,
    tensor_names,
)

# ---- the families' pipeline layers: each only references the HF model's modules ---------

Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""What one pipeline layer hands the next: hidden states [B, T, C], or for packed rows
(hidden states, position ids [B, T]), so that every decoder layer, on whichever stage,
gets the row's positions."""

MASKS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
}
"""A decoder layer's attention type -> the transformers mask builder its family's own
forward calls for it (`masking_utils`)."""


def _positions(x: torch.Tensor) -> torch.Tensor:
    """Position ids [1, T] of a [B, T, ...] input."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def _split_packed(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids and position ids of a packed row [B, 2, T] (the position ids contiguous:
    a pipeline stage sends them on); token ids [B, T] and None."""
    return (idx[:, 0], idx[:, 1].contiguous()) if idx.dim() == 3 else (idx, None)


def packed_mask(
    config: Any, hidden: torch.Tensor, positions: torch.Tensor, *, layer_type: str | None
) -> Any:
    """The attention mask the family's own forward builds for `positions` (transformers
    finds the packed sequences where the ids restart and keeps each to itself), for a
    layer of `layer_type`; ConfigError for an attention type without a mask here."""
    name = MASKS.get(layer_type or "full_attention")
    if name is None:
        raise ConfigError(
            f"data.pack=true: {config.model_type}'s {layer_type} layers have no packed-sequence "
            f"mask in trainstack's pipeline layers; allowed: layers of types {', '.join(MASKS)}, "
            "or data.pack=false"
        )
    build = getattr(importlib.import_module("transformers.masking_utils"), name)
    return build(
        config=config,
        inputs_embeds=hidden,
        attention_mask=None,
        past_key_values=None,
        position_ids=positions,
    )


class PlanEmbedding(nn.Module):
    """The token embedding as a pipeline layer: token ids [B, T] -> hidden states; a
    packed row [B, 2, T] -> (hidden states, its position ids)."""

    def __init__(self, *, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, idx: torch.Tensor) -> Hidden:
        tokens, positions = _split_packed(idx)
        hidden = self.embed(tokens)
        return hidden if positions is None else (hidden, positions)


class PlanLayer(nn.Module):
    """One decoder block as `base_model_pp_plan`'s `layers` entry names it (or a GPT2Block),
    called as the family's own forward calls it. Hidden states alone: positions 0..T-1
    and no attention mask (causal sdpa). A packed row's (hidden states, position ids):
    those positions and the mask the family's forward builds from them (`packed_mask`),
    and the positions handed on. The body's rotary embedding (for the block's attention
    type, where the family has several) turns the positions into the block's angles."""

    def __init__(
        self,
        *,
        layer: nn.Module,
        rotary_emb: nn.Module | None,
        layer_type: str | None,
        attention_type: str | None,
        config: Any,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.layer_type = layer_type
        """The type the rotary embedding takes (None: it takes none)."""
        self.attention_type = attention_type
        """The block's entry in its config's `layer_types` (None: full attention)."""
        self.__dict__["config"] = config  # the HF config, not a module

    def forward(self, x: Hidden) -> Hidden:
        packed = isinstance(x, tuple)
        hidden, positions = x if isinstance(x, tuple) else (x, _positions(x))
        mask = None
        if packed:
            mask = packed_mask(self.config, hidden, positions, layer_type=self.attention_type)
        kwargs: dict[str, Any] = {"position_ids": positions}
        if self.rotary_emb is not None:
            typed = (self.layer_type,) if self.layer_type is not None else ()
            kwargs["position_embeddings"] = self.rotary_emb(hidden, positions, *typed)
        out = self.layer(hidden, attention_mask=mask, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return (out, positions) if packed else out


class GPT2Embedding(nn.Module):
    """Token ids [B, T] -> token + position embeddings, then embedding dropout; a packed
    row [B, 2, T] -> (those at its position ids, the position ids)."""

    def __init__(self, *, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop

    def forward(self, idx: torch.Tensor) -> Hidden:
        tokens, positions = _split_packed(idx)
        at = _positions(tokens) if positions is None else positions
        hidden = self.drop(self.wte(tokens) + self.wpe(at))
        return hidden if positions is None else (hidden, positions)


class NormHead(nn.Module):
    """The final norm and the LM head: hidden states (and a packed row's position ids,
    dropped) -> logits [B, T, V]."""

    def __init__(self, *, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, x: Hidden) -> torch.Tensor:
        hidden = x[0] if isinstance(x, tuple) else x
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits


# ---- the supported families -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class HFFamily:
    """What trainstack needs to know about one Hugging Face architecture."""

    positions_key: str
    """The config key of the longest sequence the model takes."""
    dropout_keys: tuple[str, ...]
    """The config keys that `model.dropout` fills."""
    fixed: dict[str, Any]
    """Config keys with the one value the pipeline layers support."""
    layers: Callable[[HFCausalLM], list[nn.Module]] | None
    """The wrapper's pipeline layers, built from references to its modules; None: the
    family runs its own HF forward (no pipeline)."""


PLAN = ["embed_tokens", "layers", "norm"]
"""The `base_model_pp_plan` trainstack cuts a family by (every decoder family declares it)."""


def plan_layers(model: HFCausalLM) -> list[nn.Module]:
    """Pipeline layers read from the family's own plans: `base_model_pp_plan` (embedding,
    decoder blocks, final norm) and `_pp_plan` (the LM head); ConfigError naming the
    attribute a family lacks, or what its forward does that the plan does not."""
    hf = model.hf
    plan = list(getattr(model.config, "base_model_pp_plan", None) or {})
    if plan != PLAN or "lm_head" not in (getattr(hf, "_pp_plan", None) or {}):
        raise ConfigError(
            f"model.hf.model_type={model.family}: its config's base_model_pp_plan "
            f"({plan or 'none'}) and the model's _pp_plan are not {PLAN} + lm_head, which a "
            "pipeline is cut by; use strategy.kind ddp, zero, fsdp or ps for it"
        )
    if getattr(model.config, "output_router_logits", False):
        raise ConfigError(
            f"model.hf.output_router_logits=true with a pipeline: {model.family}'s balance "
            "loss is gathered by its whole forward, which a pipeline's stages do not run; set "
            "it false, or use strategy.kind ddp, zero, fsdp or ps"
        )
    body = model.body
    rotary = getattr(body, "rotary_emb", None)
    typed = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    types = list(getattr(model.config, "layer_types", None) or [])
    blocks = cast(nn.ModuleList, body.get_submodule("layers"))
    return [
        PlanEmbedding(embed=body.get_submodule("embed_tokens")),
        *(
            PlanLayer(
                layer=block,
                rotary_emb=rotary,
                layer_type=types[i] if typed else None,
                attention_type=types[i] if types else None,
                config=model.config,
            )
            for i, block in enumerate(blocks)
        ),
        NormHead(norm=body.get_submodule("norm"), lm_head=hf.get_submodule("lm_head")),
    ]


@torch.no_grad()
def check_plan_layers(model: HFCausalLM, layers: list[nn.Module]) -> None:
    """The plan's layers in order compute what the family's own forward computes, on one
    probe sequence of the full length; else ConfigError (a family whose forward scales,
    caps or masks what its modules do not)."""
    positions = getattr(model.config, "max_position_embeddings", 16)
    vocab = model.config.vocab_size
    probe = torch.randint(vocab, (1, positions), generator=torch.Generator().manual_seed(0))
    probe = probe.to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        own = model.hf(input_ids=probe, use_cache=False).logits
        x = probe
        for layer in layers:
            x = layer(x)
    finally:
        model.train(was_training)
    scale = float(own.abs().max()) or 1.0
    diff = float((x - own).abs().max())
    if not diff <= 1e-5 * scale:
        raise ConfigError(
            f"model.hf.model_type={model.family}: its base_model_pp_plan's layers in order "
            f"differ from its own forward by {diff:.3g} (logits up to {scale:.3g}): its forward "
            "does more than the plan says (scaling, soft-capping, a sliding window shorter "
            "than model.block_size); use strategy.kind ddp, zero, fsdp or ps for it"
        )


def _gpt2_layers(model: HFCausalLM) -> list[nn.Module]:
    config = model.config
    body = model.get_submodule("transformer")
    embedding = GPT2Embedding(
        wte=body.get_submodule("wte"),
        wpe=body.get_submodule("wpe"),
        drop=body.get_submodule("drop"),
    )
    blocks = [
        PlanLayer(layer=block, rotary_emb=None, layer_type=None, attention_type=None, config=config)
        for block in cast(nn.ModuleList, body.get_submodule("h"))
    ]
    head = NormHead(norm=body.get_submodule("ln_f"), lm_head=model.get_submodule("lm_head"))
    return [embedding, *blocks, head]


FAMILIES: dict[str, HFFamily] = {
    "llama": HFFamily(
        positions_key="max_position_embeddings",
        dropout_keys=("attention_dropout",),
        fixed={},
        layers=plan_layers,  # its own plan, trusted: its forward is these layers
    ),
    "gpt2": HFFamily(
        positions_key="n_positions",
        dropout_keys=("resid_pdrop", "embd_pdrop", "attn_pdrop"),
        fixed={"add_cross_attention": False},
        layers=_gpt2_layers,
    ),
}
"""The families with pipeline layers here (any other causal LM runs its own forward)."""

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
        assert not hf_model._parameters and not hf_model._buffers, "HF keeps state in children"
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
        them from layer to layer and give each block that same mask."""
        if self.family not in FAMILIES:
            hf = self.hf
            tokens, positions = _split_packed(idx)
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
