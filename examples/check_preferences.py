"""How often a model prefers the chosen answer of held-out preference pairs, before and
after DPO, and what it answers: the base (a Hugging Face folder) alone, then with the
DPO run's adapter loaded by peft, as you would load it outside trainstack.

    python check_preferences.py BASE_FOLDER ADAPTER_FOLDER PAIRS.jsonl

A pair counts as preferred when the model gives the chosen answer a higher
log-probability than the rejected one (the answers' tokens after the prompt, rendered
with the base folder's chat template).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch


def answer_logprob(model: Any, tokenizer: Any, prompt: str, answer: str) -> float:
    """log p(answer | prompt) under the chat template: the answer's tokens and its turn's end."""
    turn = [{"role": "user", "content": prompt}]
    before = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(
        [*turn, {"role": "assistant", "content": answer}], tokenize=False
    )
    start = len(tokenizer(before, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([tokenizer(whole, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
    targets = ids[0, 1:]
    picked = logprobs[torch.arange(len(targets)), targets]
    return float(picked[start - 1 :].sum())


def preferred(model: Any, tokenizer: Any, pairs: list[dict[str, str]]) -> float:
    """The share of `pairs` whose chosen answer `model` gives the higher log-probability."""
    wins = 0
    for pair in pairs:
        chosen = answer_logprob(model, tokenizer, pair["prompt"], pair["chosen"])
        rejected = answer_logprob(model, tokenizer, pair["prompt"], pair["rejected"])
        wins += chosen > rejected
    return wins / len(pairs)


def main(base_dir: str, adapter_dir: str, pairs_file: str) -> dict[str, Any]:
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    pairs = [json.loads(line) for line in Path(pairs_file).read_text().splitlines() if line]
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    before = preferred(base, tokenizer, pairs)
    tuned = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    after = preferred(tuned, tokenizer, pairs)
    question = [{"role": "user", "content": pairs[0]["prompt"]}]
    ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt")
    ids = getattr(ids, "input_ids", ids)
    out = tuned.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    said = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"held-out pairs preferred: {before:.1%} by the base, {after:.1%} with the DPO adapter")
    print(f"{pairs[0]['prompt']!r} -> {said!r} (chosen: {pairs[0]['chosen']!r})")
    return {"before": before, "after": after, "answer": said}


if __name__ == "__main__":
    main(*sys.argv[1:4])
