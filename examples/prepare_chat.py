"""Write a small chat fine-tuning set-up: a tiny "pretrained" Llama with a chat tokenizer,
and conversations to fine-tune it on, for `data.kind: chat`.

    cd examples
    python prepare_chat.py data/chat
    trainstack run specs/chat_finetune.yaml

`data/chat/model/` is a Hugging Face folder as `save_pretrained` writes it: a Llama of
two layers, width 64, randomly initialised with seed SEED (it stands for the checkpoint
you would fine-tune; nothing is downloaded), and a word-level tokenizer with ChatML's
turn markers and chat template. `train.jsonl` and `val.jsonl` hold arithmetic
conversations, some as `{"messages": [...]}` with a system prompt, some as
`{"prompt", "response"}`: "what is two plus three" answered "it equals five".
`pairs.jsonl` and `pairs_val.jsonl` hold preference pairs for `data.kind: preference`:
the same questions, the right sum chosen and a sum one off rejected. Needs transformers
(`pip install 'trainstack[hf]'`).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 0
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
WORDS = [
    *NUMBERS, "system", "user", "assistant", "you", "add", "small", "numbers", "what",
    "is", "plus", "and", "it", "equals", "sum", "of",
]  # fmt: skip
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
"""Ids 0 to 3; the words follow."""


def write_tokenizer(folder: Path, words: list[str], *, template: str | None = CHATML) -> None:
    """A word-level tokenizer over `words` (ids after `SPECIALS`), ChatML's turn markers
    and `template` (None: no chat template), saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate([*SPECIALS, *words])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)


def write_model(folder: Path) -> None:
    """The tokenizer and a randomly initialised tiny Llama, as one pretrained folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    write_tokenizer(folder, WORDS)
    vocab = {word: i for i, word in enumerate([*SPECIALS, *WORDS])}
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=vocab["<|im_end|>"],
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def conversation(rng: random.Random) -> dict[str, object]:
    a, b = rng.randrange(5), rng.randrange(5)
    answer = f"it equals {NUMBERS[a + b]}"
    if rng.random() < 0.5:
        return {"prompt": f"what is {NUMBERS[a]} plus {NUMBERS[b]}", "response": answer}
    return {
        "messages": [
            {"role": "system", "content": "you add small numbers"},
            {"role": "user", "content": f"what is the sum of {NUMBERS[a]} and {NUMBERS[b]}"},
            {"role": "assistant", "content": answer},
        ]
    }


def preference(rng: random.Random) -> dict[str, str]:
    """A sum whose chosen answer is right and whose rejected answer is one off."""
    a, b = rng.randrange(5), rng.randrange(5)
    wrong = a + b + rng.choice([-1, 1]) if a + b else 1
    return {
        "prompt": f"what is {NUMBERS[a]} plus {NUMBERS[b]}",
        "chosen": f"it equals {NUMBERS[a + b]}",
        "rejected": f"it equals {NUMBERS[wrong]}",
    }


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_model(out_dir / "model")
    rng = random.Random(SEED)
    for name, count in (("train.jsonl", 2000), ("val.jsonl", 200)):
        lines = [json.dumps(conversation(rng)) for _ in range(count)]
        (out_dir / name).write_text("\n".join(lines) + "\n")
    for name, count in (("pairs.jsonl", 1000), ("pairs_val.jsonl", 100)):
        lines = [json.dumps(preference(rng)) for _ in range(count)]
        (out_dir / name).write_text("\n".join(lines) + "\n")
    print(f"wrote {out_dir}/model, its conversations (train.jsonl, val.jsonl) and preference ")
    print("pairs (pairs.jsonl, pairs_val.jsonl)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "data/chat"))
