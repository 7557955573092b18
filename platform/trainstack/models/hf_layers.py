"""A Hugging Face causal LM as pipeline layers: the embedding, each decoder block and the
final norm with the LM head, each a module that only references the HF model's own
modules, called as the family's own forward calls them.

A family's layers are cut by its `base_model_pp_plan` and `_pp_plan` (`plan_layers`) and
checked once against its forward (`check_plan_layers`); llama and gpt2 (`FAMILIES`)
train through these layers under every layout, the others only under a pipeline (see
`models/hf.py`). Between layers go hidden states, or for packed chat rows (`data.pack`)
hidden states with the row's position ids, so that every decoder layer, on whichever
pipeline stage, gets the positions and the packed-sequence mask (`packed_mask`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainstack.config import ConfigError

if TYPE_CHECKING:
    from trainstack.models.hf import HFCausalLM

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


def split_packed(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        tokens, positions = split_packed(idx)
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
        tokens, positions = split_packed(idx)
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
