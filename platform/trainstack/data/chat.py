"""`data.kind: chat`: conversations in jsonl, loss on the assistant's tokens only.

Each line of a `data.train` / `data.val` file is one conversation, either
`{"messages": [{"role": ..., "content": ...}, ...]}` (roles system, user, assistant;
at least one assistant message) or `{"prompt": ..., "response": ...}` (a user message
and the assistant's answer). It is rendered with the tokenizer's chat template
(`data.tokenizer`: a Hugging Face tokenizer folder, usually the pretrained model's;
`data.chat_template`: a Jinja file to use instead of, or where the folder has none)
and tokenized. The tokens an assistant message adds to the rendered conversation are
the ones trained on: for each assistant message, the conversation rendered up to
the message before it with the generation prompt, and up to the message itself;
the tokens between are the message (its end-of-turn token included). The template
must render each shorter conversation as a prefix of the longer one, else the
conversation is refused naming its line.

One conversation is one sample: inputs are its first T tokens (T = model.block_size),
targets the next token at each position, -100 (ignored by the loss) where the next
token is not an assistant's and over the padding that fills a short conversation to
T. Position ids start at 0 in every sample and no sample attends to another, so the
model sees each conversation exactly as alone (padding costs compute). A conversation
longer than T + 1 tokens is refused naming file:line, or with `data.truncate: true` cut
to its first T + 1 (refused if no assistant token is left).

With `data.pack: true` a sample is a row of T positions that holds whole conversations
instead (`pack_rows`): a conversation of L tokens takes L - 1 positions (its inputs;
targets as above), conversations go into rows in file order, each into the current row
if it fits, else into a new one, and the row's rest is padding; a conversation is never
split over rows (`data.truncate` first cuts one to T + 1 tokens, T positions: a row of
its own). A packed sample's inputs are [2, T]: the token ids and position ids that
restart at 0 at each conversation (and at the padding). Given position ids, a Hugging
Face model's own forward makes each conversation attend only to itself (transformers'
packed-sequence mask), so every conversation is computed exactly as alone
(`models/hf.py`; tests/unit/test_chat_packing.py). The packing is in the fingerprint.

Samples are read in seeded epochs like the other file sources (`indexed`), so the
global batch is the same at any world size and a cursor resumes exactly. Each process
tokenizes the files once when the corpus is first used (pre-flight does it first and
reports every problem it finds as one line).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from trainstack.config import ConfigError, DataConfig
from trainstack.data.indexed import ByLength, EpochOrder, IndexedCorpus, SampleSet
from trainstack.data.sharding import IGNORED_TARGET, Batch
from trainstack.data.tokens import files_fingerprint, held_out_size

ROLES = ("system", "user", "assistant")
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Conversation:
    """One tokenized conversation: its ids, and which of them an assistant wrote."""

    ids: tuple[int, ...]
    trained: tuple[bool, ...]
    where: str
    """`file:line`, for errors."""

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Its token ids [L], and the targets of its first L - 1 positions: the next
        token where an assistant wrote it, else `IGNORED_TARGET`."""
        tokens = torch.tensor(self.ids, dtype=torch.int64)
        keep = torch.tensor(self.trained[1:], dtype=torch.bool)
        return tokens, torch.where(keep, tokens[1:], IGNORED_TARGET)


def messages_of(record: object, *, where: str) -> list[dict[str, str]]:
    """The messages of one jsonl record, checked (a ConfigError naming `where`)."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{where}: messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ConfigError(f"{where}: messages[{i}] needs a text content")
            if m.get("role") not in ROLES:
                raise ConfigError(
                    f"{where}: messages[{i}] has role {m.get('role')!r}; allowed: "
                    + ", ".join(ROLES)
                )
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{where}: no assistant message: nothing to train on")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if isinstance(record, dict) and {"prompt", "response"} <= set(record):
        prompt, response = record["prompt"], record["response"]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise ConfigError(f"{where}: prompt and response must be text")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ConfigError(
        f'{where}: expected {{"messages": [...]}} or {{"prompt", "response"}}; got {keys}'
    )


@dataclass(kw_only=True)
class ChatTokenizer:
    """A Hugging Face tokenizer and the chat template conversations are rendered with."""

    tokenizer: Any
    template: str | None
    """None: the tokenizer's own."""

    @classmethod
    def load(cls, cfg: DataConfig) -> ChatTokenizer:
        from transformers import AutoTokenizer

        folder = cfg.tokenizer
        if folder in ("", "bytes"):
            raise ConfigError(
                f"data.kind={cfg.kind} needs data.tokenizer: a Hugging Face tokenizer folder "
                "(the pretrained model's, usually)"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"data.tokenizer={folder}: not a tokenizer folder ({first})"
            ) from None
        template = None
        if cfg.chat_template:
            try:
                template = Path(cfg.chat_template).read_text()
            except OSError as e:
                raise ConfigError(
                    f"data.chat_template={cfg.chat_template}: cannot be read ({e.strerror or e})"
                ) from None
        elif not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"data.tokenizer={folder} has no chat template; name a Jinja file in "
                "data.chat_template"
            )
        return cls(tokenizer=tokenizer, template=template)

    def render(self, messages: list[dict[str, str]], *, prompt: bool = False) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt, chat_template=self.template
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def pad_id(self) -> int:
        t = self.tokenizer
        pad = t.pad_token_id if t.pad_token_id is not None else t.eos_token_id
        return int(pad) if pad is not None else 0

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode_answer(
        self, prompt: list[dict[str, str]], answer: str, *, where: str
    ) -> Conversation:
        """`prompt` and the assistant's `answer` to it: the ids, the answer's alone marked
        (an assistant message inside the prompt is context, not trained on)."""
        before = self.render(prompt, prompt=True)
        ids = self.render([*prompt, {"role": "assistant", "content": answer}])
        if ids[: len(before)] != before:
            raise ConfigError(
                f"{where}: the chat template does not render the prompt as a prefix of the "
                "prompt and its answer; the answer's tokens cannot be told apart (use a "
                "template whose turns only append)"
            )
        trained = [i >= len(before) for i in range(len(ids))]
        return Conversation(ids=tuple(ids), trained=tuple(trained), where=where)

    def encode(self, messages: list[dict[str, str]], *, where: str) -> Conversation:
        """The conversation's ids and which of them are the assistant's."""
        ids = self.render(messages)
        trained = [False] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], prompt=True) if i else []
            upto = self.render(messages[: i + 1])
            if upto[: len(before)] != before or ids[: len(upto)] != upto:
                raise ConfigError(
                    f"{where}: the chat template does not render the conversation up to "
                    f"message {i} as a prefix of the whole; the assistant's tokens cannot be "
                    "told apart (use a template whose turns only append)"
                )
            for j in range(len(before), len(upto)):
                trained[j] = True
        return Conversation(ids=tuple(ids), trained=tuple(trained), where=where)


def read_jsonl(
    paths: Sequence[str], *, key: str, parse: Callable[[object, str], T], what: str
) -> list[T]:
    """`parse(record, "file:line")` of every non-empty line of the files, in order; the
    first problem as a ConfigError naming file:line (`what`: the records, for an empty set)."""
    out: list[T] = []
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{key} file {path}: cannot be read ({e})") from None
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            out.append(parse(record, where))
    if not out:
        raise ConfigError(f"{key}: no {what} in {', '.join(paths) or 'no files'}")
    return out


def read_conversations(
    paths: Sequence[str], tokenizer: ChatTokenizer, *, key: str, block_size: int, truncate: bool
) -> list[Conversation]:
    """Every conversation of the files, in order; the first problem as a ConfigError
    naming file:line."""

    def parse(record: object, where: str) -> Conversation:
        chat = tokenizer.encode(messages_of(record, where=where), where=where)
        return fitted(chat, block_size=block_size, truncate=truncate)

    return read_jsonl(paths, key=key, parse=parse, what="conversations")


def fitted(chat: Conversation, *, block_size: int, truncate: bool) -> Conversation:
    """`chat` if it fits a sample of block_size + 1 tokens; cut to it with `truncate`."""
    most = block_size + 1
    if len(chat.ids) <= most:
        return chat
    if not truncate:
        raise ConfigError(
            f"{chat.where}: {len(chat.ids)} tokens, longer than model.block_size + 1 = {most}; "
            "allowed: raise model.block_size, shorten it, or data.truncate=true"
        )
    cut = Conversation(ids=chat.ids[:most], trained=chat.trained[:most], where=chat.where)
    if not any(cut.trained[1:]):
        raise ConfigError(
            f"{chat.where}: cut to model.block_size + 1 = {most} tokens (data.truncate) it "
            "keeps no assistant token: nothing to train on"
        )
    return cut


def pack_rows(chats: Sequence[Conversation], *, seq_len: int) -> list[tuple[int, ...]]:
    """The conversations (by index) in each packed row of seq_len positions: in order,
    each into the current row if its inputs (all its tokens but the last) fit, else into
    a new row. Each conversation must fit a row (`fitted`)."""
    rows: list[tuple[int, ...]] = []
    row: list[int] = []
    used = 0
    for i, chat in enumerate(chats):
        width = len(chat.ids) - 1
        assert width <= seq_len, f"{chat.where}: not fitted to {seq_len}"
        if row and used + width > seq_len:
            rows.append(tuple(row))
            row, used = [], 0
        row.append(i)
        used += width
    if row:
        rows.append(tuple(row))
    return rows


class ChatSamples:
    """A `SampleSet` of conversations, each padded to one sample of seq_len."""

    def __init__(self, chats: Sequence[Conversation], *, pad_id: int) -> None:
        self.chats = tuple(chats)
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.chats)

    def take(self, ids: np.ndarray, *, seq_len: int) -> Batch:
        x = torch.full((len(ids), seq_len), self.pad_id, dtype=torch.int64)
        y = torch.full((len(ids), seq_len), IGNORED_TARGET, dtype=torch.int64)
        for row, i in enumerate(np.asarray(ids).tolist()):
            tokens, targets = self.chats[i].tensors()
            shown = min(len(tokens), seq_len)
            x[row, :shown] = tokens[:shown]
            scored = min(len(targets), seq_len)  # positions that have a next token
            y[row, :scored] = targets[:scored]
        return x, y


class PackedChatSamples:
    """A `SampleSet` of packed rows (`pack_rows`): inputs [b, 2, seq_len] (token ids,
    position ids restarting at 0 at each conversation and at the padding), targets
    [b, seq_len]."""

    def __init__(self, chats: Sequence[Conversation], *, pad_id: int, seq_len: int) -> None:
        self.chats = tuple(chats)
        self.pad_id = pad_id
        self.rows = pack_rows(self.chats, seq_len=seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, ids: np.ndarray, *, seq_len: int) -> Batch:
        x = torch.full((len(ids), 2, seq_len), self.pad_id, dtype=torch.int64)
        y = torch.full((len(ids), seq_len), IGNORED_TARGET, dtype=torch.int64)
        for row, i in enumerate(np.asarray(ids).tolist()):
            fill_packed_row(x[row], y[row], [self.chats[c] for c in self.rows[i]])
        return x, y


def fill_packed_row(x: torch.Tensor, y: torch.Tensor, chats: Sequence[Conversation]) -> None:
    """Write `chats` one after another into a packed row: inputs `x` [2, T] (token ids,
    position ids restarting at 0 at each conversation and at the padding) and targets
    `y` [T], both already filled with padding."""
    at = 0
    for chat in chats:
        tokens, targets = chat.tensors()
        width = len(targets)
        x[0, at : at + width] = tokens[:-1]
        x[1, at : at + width] = torch.arange(width)
        y[at : at + width] = targets
        at += width
    x[1, at:] = torch.arange(x.shape[-1] - at)  # padding: a sequence of its own


@dataclass(kw_only=True)
class ChatCorpus(ByLength):
    """A `sharding.Corpus` over chat files: one `IndexedCorpus` per sequence length."""

    cfg: DataConfig
    _by_length: dict[int, IndexedCorpus] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg: DataConfig) -> ChatCorpus:
        return cls(cfg=cfg)

    @functools.cached_property
    def tokenizer(self) -> ChatTokenizer:
        return ChatTokenizer.load(self.cfg)

    @functools.cached_property
    def fingerprint(self) -> str:
        d = self.cfg
        files = {"train": list(d.train), "val": list(d.val)}
        return files_fingerprint(
            files,
            kind=d.kind,
            val_fraction=d.val_fraction,
            truncate=d.truncate,
            **({"pack": True} if d.pack else {}),  # unpacked: the fingerprint as before
            template=self.tokenizer.template or self.tokenizer.tokenizer.chat_template,
            vocab=self.tokenizer.vocab_size,
        )

    def at(self, seq_len: int) -> IndexedCorpus:
        """The training and held-out conversations as samples of seq_len (read once)."""
        if seq_len not in self._by_length:
            d = self.cfg
            read = functools.partial(self.read, seq_len=seq_len)
            train = read(d.train, key="data.train")
            if d.val:
                held = read(d.val, key="data.val")
            else:
                n_held = held_out_size(len(train), d.val_fraction)
                train, held = train[: len(train) - n_held], train[len(train) - n_held :]
            if not train:
                raise ConfigError(
                    f"data.train: every conversation is held out (data.val_fraction="
                    f"{d.val_fraction}); add data or lower the fraction"
                )
            samples = self.samples(seq_len)
            train_set = samples(train)
            self._by_length[seq_len] = IndexedCorpus(
                train=train_set,
                held_out=samples(held) if held else None,
                order=EpochOrder(size=len(train_set), seed=d.seed, shuffle=d.shuffle),
                fingerprint=self.fingerprint,
            )
        return self._by_length[seq_len]

    def read(self, paths: Sequence[str], *, key: str, seq_len: int) -> list[Any]:
        """The samples' sources in `paths` (conversations), each fitted to seq_len."""
        return read_conversations(
            paths, self.tokenizer, key=key, block_size=seq_len, truncate=self.cfg.truncate
        )

    def samples(self, seq_len: int) -> Callable[[Sequence[Any]], SampleSet]:
        """How conversations become samples: packed rows (`data.pack`) or one each."""
        pad_id = self.tokenizer.pad_id
        if self.cfg.pack:
            return functools.partial(PackedChatSamples, pad_id=pad_id, seq_len=seq_len)
        return functools.partial(ChatSamples, pad_id=pad_id)
