"""A tiny chat tokenizer and conversations, made in the test (no downloads): the
example's word-level Hugging Face tokenizer (examples/prepare_chat.py) over a few
words, with ChatML's turn markers and template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prepare_chat import CHATML, SPECIALS, write_tokenizer

WORDS = [
    "system", "user", "assistant", "you", "are", "kind", "hi", "hello", "how", "is", "it",
    "fine", "thanks", "what", "two", "plus", "three", "five", "four", "one", "and", "the",
    "sum", "of", "equals", "please", "add",
]  # fmt: skip


def make_tokenizer(folder: Path, *, template: str | None = CHATML) -> Path:
    """The tokenizer over `WORDS` (ids: the 4 specials, then the words), with the ChatML
    template unless `template` is None."""
    write_tokenizer(folder, WORDS, template=template)
    return folder


def ids(text: str) -> list[int]:
    """The ids of space-separated words and specials, as `make_tokenizer`'s vocabulary has them."""
    table = {word: i for i, word in enumerate([*SPECIALS, *WORDS])}
    return [table[w] for w in text.split()]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sums(count: int) -> list[dict[str, Any]]:
    """`count` short arithmetic conversations (a learnable mapping, varied in length)."""
    names = ["one", "two", "three", "four", "five"]
    out: list[dict[str, Any]] = []
    for i in range(count):
        a, b = names[i % 3], names[(i // 3) % 2]
        total = names[min(4, (i % 3) + (i // 3) % 2 + 1)]
        if i % 2:
            out.append({"prompt": f"add {a} and {b}", "response": f"{total}"})
        else:
            out.append(
                {
                    "messages": [
                        {"role": "system", "content": "you are kind"},
                        {"role": "user", "content": f"what is {a} plus {b}"},
                        {"role": "assistant", "content": f"it equals {total}"},
                    ]
                }
            )
    return out
