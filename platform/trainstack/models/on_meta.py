"""Models whose parameters are on the meta device: shapes without storage.

A pretrained model that a strategy reads rank by rank (each rank only the part of each
tensor it holds) is built inside `parameters_on_meta`: every parameter a module
registers moves to the meta device as it is registered, while buffers (a rotary
embedding's `inv_freq`, computed from the config) stay real, as accelerate's
`init_empty_weights(include_buffers=False)` does. A parameter assigned again (a tied
LM head taking the embedding's) stays the same tensor, so ties hold. `saved_names`
finds each tensor's name among a folder's saved ones (the readers go by it), and
`saved_misfits` compares the model with the folder's names and shapes before anything
is read.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager

from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, buffers as built."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def has_meta_parameters(model: nn.Module) -> bool:
    """Whether `model` was built with its parameters on the meta device."""
    return any(p.is_meta for p in model.parameters())


def tensor_names(model: nn.Module) -> list[list[str]]:
    """Every state-dict key of each tensor of `model`, grouped by tensor (a tied
    embedding and LM head: one group of two keys), in state-dict order."""
    groups: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(key)
    return list(groups.values())


def saved_names(
    model: nn.Module,
    saved: Collection[str],
    *,
    aliases: Mapping[str, tuple[str, ...]] | None = None,
) -> list[tuple[str, str | None]]:
    """Each tensor of `model` (its first state-dict key), with the first of its names
    that `saved` holds (None: none is); a tied LM head is found under its embedding's
    name. `aliases` gives a key's other names where the model does not know them (a
    pipeline stage holding only the head of a tied pair)."""
    found: list[tuple[str, str | None]] = []
    for keys in tensor_names(model):
        names = [n for key in keys for n in (key, *(aliases or {}).get(key, ()))]
        found.append((keys[0], next((n for n in names if n in saved), None)))
    return found


def saved_misfits(model: nn.Module, saved: dict[str, list[int]]) -> dict[str, list[str]]:
    """What keeps `saved` (names -> shapes) from filling `model`: `missing` (a tensor
    none of whose names is saved) and `mismatched` (`key saved [..] vs [..]`); empty
    when every tensor is saved under one of its names with its shape."""
    state = model.state_dict(keep_vars=True)
    missing: list[str] = []
    mismatched: list[str] = []
    for first, key in saved_names(model, saved):
        if key is None:
            missing.append(first)
        elif saved[key] != list(state[key].shape):
            mismatched.append(f"{key} saved {saved[key]} vs {list(state[key].shape)}")
    return {k: sorted(v) for k, v in (("missing", missing), ("mismatched", mismatched)) if v}
