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

With `data.pack: true` (a Hugging Face model) a sample is two packed rows instead: the
chosen answers of several pairs, in file order, then the rejected answers of the same
pairs in the same order, each conversation with its own position ids (restarting at 0)
as `data.kind: chat` packs them (`PackedPreferenceSamples`). Pairs join the current
sample while both sides still fit T positions. A micro-batch of b samples is inputs
[2b, 2, T] and targets [2b, T]; each answer is one run of scored targets, so the task
finds the pairs again row by row (`tasks._answer_logprobs`). The held-out set is packed
the same way, so `data.eval_samples` counts packed samples.
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
    fill_packed_row,
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


def pack_pairs(pairs: Sequence[Pair], *, seq_len: int) -> list[tuple[int, ...]]:
    """The pairs (by index) in each packed sample: in order, each joining the current
    sample if both its answers' inputs still fit seq_len positions on their rows."""
    if not pairs:
        return []
    samples: list[tuple[int, ...]] = []
    sample: list[int] = []
    used = [0, 0]
    for i, pair in enumerate(pairs):
        widths = [len(pair.chosen.ids) - 1, len(pair.rejected.ids) - 1]
        if sample and any(u + w > seq_len for u, w in zip(used, widths, strict=True)):
            samples.append(tuple(sample))
            sample, used = [], [0, 0]
        sample.append(i)
        used = [u + w for u, w in zip(used, widths, strict=True)]
    samples.append(tuple(sample))
    return samples


class PackedPreferenceSamples:
    """A `SampleSet` of packed pairs (`pack_pairs`): each sample two rows of seq_len, its
    pairs' chosen answers then their rejected ones, in the same order; inputs [2b, 2, T]
    (token ids, position ids restarting at 0 at each conversation and at the padding)."""

    def __init__(self, pairs: Sequence[Pair], *, pad_id: int, seq_len: int) -> None:
        self.pairs = tuple(pairs)
        self.pad_id = pad_id
        self.samples = pack_pairs(self.pairs, seq_len=seq_len)

    def __len__(self) -> int:
        return len(self.samples)

    def take(self, ids: np.ndarray, *, seq_len: int) -> Batch:
        rows = 2 * len(ids)
        x = torch.full((rows, 2, seq_len), self.pad_id, dtype=torch.int64)
        y = torch.full((rows, seq_len), IGNORED_TARGET, dtype=torch.int64)
        for n, i in enumerate(np.asarray(ids).tolist()):
            members = [self.pairs[p] for p in self.samples[i]]
            fill_packed_row(x[2 * n], y[2 * n], [p.chosen for p in members])
            fill_packed_row(x[2 * n + 1], y[2 * n + 1], [p.rejected for p in members])
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
        if self.cfg.pack:
            return lambda pairs: PackedPreferenceSamples(pairs, pad_id=pad_id, seq_len=seq_len)
        return lambda pairs: PreferenceSamples(pairs, pad_id=pad_id)
