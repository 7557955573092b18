"""`data.kind: preference`: pairs of answers to one prompt, the chosen and the rejected,
for `task.kind: dpo`.

Each line of a `data.train` / `data.val` file is one pair:
`{"prompt": ..., "chosen": ..., "rejected": ...}`. The prompt is a user's text or a list
of messages as in `data.kind: chat` (roles system, user, assistant; it may not end
with the assistant); each answer is the assistant's text. Prompt and answer are
rendered with the tokenizer's chat template (`data.tokenizer`, `data.chat_template`),
and the answer's tokens are the ones scored (`ChatTokenizer.encode_answer`): an
assistant turn inside the prompt is context.

One pair is one sample: two rows of T = model.block_size positions, the chosen answer's
then the rejected one's, each padded (targets -100 outside the answer and over the
padding; position ids from 0). A micro-batch of b pairs is inputs [2b, T] and targets
[2b, T], pairs interleaved. A row longer than T + 1 tokens is refused naming
file:line, or cut with `data.truncate` (refused if no answer token is left). Pairs are
read in seeded epochs like the other file sources, so the global batch is the same at
any world size and a cursor resumes exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainstack.config import ConfigError
from trainstack.data.chat import (
    ROLES,
    ChatCorpus,
    ChatTokenizer,
    Conversation,
    fitted,
    read_jsonl,
)
from trainstack.data.indexed import SampleSet
from trainstack.data.sharding import IGNORED_TARGET, Batch


@dataclass(frozen=True, kw_only=True)
class Pair:
    """One prompt's chosen and rejected answers, tokenized."""

    chosen: Conversation
    rejected: Conversation


def prompt_of(record: dict[str, Any], *, where: str) -> list[dict[str, str]]:
    """The pair's prompt as messages, checked (a ConfigError naming `where`)."""
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"{where}: prompt must be text or a non-empty list of messages")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: prompt[{i}] needs a text content")
        if m.get("role") not in ROLES:
            raise ConfigError(
                f"{where}: prompt[{i}] has role {m.get('role')!r}; allowed: " + ", ".join(ROLES)
            )
    if prompt[-1]["role"] == "assistant":
        raise ConfigError(f"{where}: the prompt ends with the assistant; the answers follow it")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def pair_of(
    record: object, tokenizer: ChatTokenizer, *, where: str, block_size: int, truncate: bool
) -> Pair:
    if not isinstance(record, dict) or not {"prompt", "chosen", "rejected"} <= set(record):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f'{where}: expected {{"prompt", "chosen", "rejected"}}; got {keys}')
    prompt = prompt_of(record, where=where)
    answers = {}
    for side in ("chosen", "rejected"):
        answer = record[side]
        if not isinstance(answer, str) or not answer:
            raise ConfigError(f"{where}: {side} must be the assistant's answer, as text")
        chat = tokenizer.encode_answer(prompt, answer, where=f"{where} ({side})")
        answers[side] = fitted(chat, block_size=block_size, truncate=truncate)
    return Pair(chosen=answers["chosen"], rejected=answers["rejected"])


def read_pairs(
    paths: Sequence[str], tokenizer: ChatTokenizer, *, key: str, block_size: int, truncate: bool
) -> list[Pair]:
    """Every pair of the files, in order; the first problem as a ConfigError naming
    file:line."""

    def parse(record: object, where: str) -> Pair:
        return pair_of(record, tokenizer, where=where, block_size=block_size, truncate=truncate)

    return read_jsonl(paths, key=key, parse=parse, what="preference pairs")


class PreferenceSamples:
    """A `SampleSet` of pairs: each two padded rows, the chosen answer's then the rejected."""

    def __init__(self, pairs: Sequence[Pair], *, pad_id: int) -> None:
        self.pairs = tuple(pairs)
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.pairs)

    def take(self, ids: np.ndarray, *, seq_len: int) -> Batch:
        rows = 2 * len(ids)
        x = torch.full((rows, seq_len), self.pad_id, dtype=torch.int64)
        y = torch.full((rows, seq_len), IGNORED_TARGET, dtype=torch.int64)
        for n, i in enumerate(np.asarray(ids).tolist()):
            pair = self.pairs[i]
            for row, chat in ((2 * n, pair.chosen), (2 * n + 1, pair.rejected)):
                tokens, targets = chat.tensors()
                x[row, : min(len(tokens), seq_len)] = tokens[:seq_len]
                y[row, : min(len(targets), seq_len)] = targets[:seq_len]
        return x, y


class PreferenceCorpus(ChatCorpus):
    """A `sharding.Corpus` over preference files (`ChatCorpus`'s reading, split and
    fingerprint; pairs for samples)."""

    def read(self, paths: Sequence[str], *, key: str, seq_len: int) -> list[Any]:
        return read_pairs(
            paths, self.tokenizer, key=key, block_size=seq_len, truncate=self.cfg.truncate
        )

    def samples(self, seq_len: int) -> Callable[[Sequence[Any]], SampleSet]:
        pad_id = self.tokenizer.pad_id
        return lambda pairs: PreferenceSamples(pairs, pad_id=pad_id)
