"""`data.kind: chat`: conversations rendered with the tokenizer's chat template, the loss
on the assistant's tokens only (checked token by token), one conversation a sample
(padding ignored), the same global batch at any world size, and every bad file, line
or setting refused in one line naming file:line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from trainstack.config import ConfigError, config_from_dict
from trainstack.data import build_corpus
from trainstack.data.checks import check_data
from trainstack.data.paths import resolve_data
from trainstack.data.sharding import ShardedBatches
from trainstack.tasks import build_task

from chat_data import ids, make_tokenizer, sums, write_jsonl

IGNORE = -100
TWO_TURNS = {
    "messages": [
        {"role": "system", "content": "you are kind"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello how are you"},
        {"role": "user", "content": "fine thanks"},
        {"role": "assistant", "content": "kind"},
    ]
}


def spec(tmp_path: Path, records: list[Any], **data: Any) -> dict[str, Any]:
    tokenizer = tmp_path / "tok"
    if not tokenizer.exists():
        make_tokenizer(tokenizer)
    train = write_jsonl(tmp_path / "chat.jsonl", records)
    return {
        "model": {"block_size": 24},
        "data": {
            "kind": "chat",
            "train": [str(train)],
            "tokenizer": str(tokenizer),
            "vocab_size": 32,
            "eval_samples": 0,
            **data,
        },
    }


def corpus_of(raw: dict[str, Any]) -> Any:
    return build_corpus(resolve_data(config_from_dict(raw)).data)


def test_the_loss_falls_on_the_assistants_tokens_only_token_by_token(tmp_path: Path) -> None:
    raw = spec(tmp_path, [TWO_TURNS])
    raw["model"]["block_size"] = 32
    x, y = corpus_of(raw).train_batch(0, 1, seq_len=32)
    rendered = ids(
        "<|im_start|> system you are kind <|im_end|> <|im_start|> user hi <|im_end|> "
        "<|im_start|> assistant hello how are you <|im_end|> "
        "<|im_start|> user fine thanks <|im_end|> <|im_start|> assistant kind <|im_end|>"
    )
    n = len(rendered)  # 26 tokens, then padding (<pad> = 0)
    assert x[0, :n].tolist() == rendered and x[0, n:].tolist() == [0] * (32 - n)
    # Trained: the tokens after an "<|im_start|> assistant" header up to and with its
    # <|im_end|>; targets are the next token, so position i is scored when token i + 1 is.
    start, end, header = ids("<|im_start|>")[0], ids("<|im_end|>")[0], ids("assistant")[0]
    scored, inside = [False] * n, False
    for i in range(2, n):
        if rendered[i - 2] == start and rendered[i - 1] == header:
            inside = True
        scored[i] = inside
        inside = inside and rendered[i] != end
    expected = [rendered[i + 1] if scored[i + 1] else IGNORE for i in range(n - 1)]
    assert y[0].tolist() == expected + [IGNORE] * (32 - (n - 1))
    assert [t for t in expected if t != IGNORE] == ids(
        "hello how are you <|im_end|> kind <|im_end|>"
    )


def test_prompt_response_and_messages_records_read_alike(tmp_path: Path) -> None:
    records = [
        {"prompt": "hi", "response": "hello"},
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ]
        },
    ]
    corpus = corpus_of(spec(tmp_path, records, shuffle=False))
    x, y = corpus.train_batch(0, 2, seq_len=24)
    assert torch.equal(x[0], x[1]) and torch.equal(y[0], y[1])
    assert [t for t in y[0].tolist() if t != IGNORE] == ids("hello <|im_end|>")


def test_one_global_batch_at_any_world_size_and_held_out_tokens_counted_alone(
    tmp_path: Path,
) -> None:
    raw = spec(tmp_path, sums(24), val_fraction=0.25, eval_samples=6)
    cfg = resolve_data(config_from_dict(raw))
    corpus = build_corpus(cfg.data)
    one = ShardedBatches(
        corpus=corpus, seq_len=24, global_batch_size=8, micro_batch_size=8, rank=0, world_size=1
    )
    whole = torch.cat([x for x, _ in one.next_step()])
    parts = []
    for rank in range(2):
        two = ShardedBatches(
            corpus=corpus, seq_len=24, global_batch_size=8, micro_batch_size=4,
            rank=rank, world_size=2,
        )  # fmt: skip
        parts += [x for x, _ in two.next_step()]
    assert torch.equal(whole, torch.cat(parts))
    # held-out sums count the scored targets only
    _, y = corpus.held_out_batch(6, seq_len=24)
    task = build_task(cfg)
    logits = torch.zeros(*y.shape, 32)
    sums_ = task.batch_sums(logits, y)
    assert int(sums_[1]) == int((y != IGNORE).sum()) > 0
    assert float(sums_[0]) / int(sums_[1]) == pytest.approx(torch.log(torch.tensor(32.0)).item())


def test_a_long_conversation_is_cut_with_truncate(tmp_path: Path) -> None:
    raw = spec(tmp_path, [TWO_TURNS], truncate=True)
    raw["model"]["block_size"] = 16
    _, y = corpus_of(raw).train_batch(0, 1, seq_len=16)  # 17 of its 26 tokens
    assert [t for t in y[0].tolist() if t != IGNORE] == ids("hello how are you <|im_end|>")


def bad(tmp_path: Path, lines: list[str], **data: Any) -> str:
    raw = spec(tmp_path, [], **data)
    (tmp_path / "chat.jsonl").write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ConfigError) as e:
        check_data(resolve_data(config_from_dict(raw)))
    message = str(e.value)
    assert "\n" not in message, message
    return message


GOOD = '{"prompt": "hi", "response": "hello"}'


@pytest.mark.parametrize(
    ("lines", "data", "pattern"),
    [
        ([GOOD, "{oops"], {}, r"chat\.jsonl:2: not JSON \(Expecting property name"),
        ([GOOD, '{"text": "hi"}'], {}, r"chat\.jsonl:2: expected \{\"messages\""),
        (
            ['{"messages": [{"role": "robot", "content": "hi"}]}'],
            {},
            r"chat\.jsonl:1: messages\[0\] has role 'robot'; allowed: system, user, assistant",
        ),
        (
            ['{"messages": [{"role": "user", "content": "hi"}]}'],
            {},
            r"chat\.jsonl:1: no assistant message: nothing to train on",
        ),
        (['{"messages": [{"role": "user"}]}'], {}, r"chat\.jsonl:1: messages\[0\] needs a text"),
        (
            [GOOD, GOOD, '{"prompt": "hi", "response": "' + "hello " * 30 + '"}'],
            {},
            r"chat\.jsonl:3: 37 tokens, longer than model\.block_size \+ 1 = 25; allowed: "
            r"raise model\.block_size, shorten it, or data\.truncate=true",
        ),
        (
            ['{"prompt": "' + "hi " * 30 + '", "response": "hello"}'],
            {"truncate": True},
            r"chat\.jsonl:1: cut to model\.block_size \+ 1 = 25 tokens \(data\.truncate\) it "
            r"keeps no assistant token",
        ),
        ([GOOD], {"vocab_size": 16}, r"has 31 tokens but data\.vocab_size=16; allowed: "),
        ([GOOD], {"tokenizer": "bytes"}, r"data\.kind=chat needs data\.tokenizer"),
        (
            [GOOD] * 3,
            {"eval_samples": 3, "val_fraction": 0.4},
            r"data\.eval_samples=3 but data\.val_fraction=0\.4 holds out 2 conversations",
        ),
    ],
)
def test_bad_chat_data_is_one_line_naming_file_and_line(
    tmp_path: Path, lines: list[str], data: dict[str, Any], pattern: str
) -> None:
    message = bad(tmp_path, lines, **data)
    assert re.search(pattern, message), message


def test_a_tokenizer_without_a_template_takes_one_from_a_file(tmp_path: Path) -> None:
    from chat_data import CHATML

    make_tokenizer(tmp_path / "tok", template=None)
    message = bad(tmp_path, [GOOD])
    assert "has no chat template; name a Jinja file in data.chat_template" in message
    (tmp_path / "chatml.jinja").write_text(CHATML)
    raw = spec(tmp_path, [{"prompt": "hi", "response": "hello"}])
    raw["data"]["chat_template"] = str(tmp_path / "chatml.jinja")
    check_data(resolve_data(config_from_dict(raw)))
    _, y = corpus_of(raw).train_batch(0, 1, seq_len=24)
    assert [t for t in y[0].tolist() if t != IGNORE] == ids("hello <|im_end|>")


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path: Path) -> None:
    numbered = (
        "{% for m in messages %}{{ loop.length }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    (tmp_path / "n.jinja").write_text(numbered)
    message = bad(tmp_path, [GOOD], chat_template=str(tmp_path / "n.jinja"))
    assert "chat.jsonl:1: the chat template does not render the conversation up to" in message


def test_export_copies_the_runs_tokenizer_beside_the_model(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from trainstack.cli.export import copy_tokenizer

    raw = spec(tmp_path, [GOOD])
    cfg = resolve_data(config_from_dict(raw))
    assert copy_tokenizer(cfg, tmp_path / "hf") == str(tmp_path / "tok")
    copied = AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = copied.apply_chat_template(messages, tokenize=False)
    assert copied(text, add_special_tokens=False)["input_ids"] == ids(
        "<|im_start|> user hi <|im_end|> <|im_start|> assistant hello <|im_end|>"
    )
    assert copy_tokenizer(config_from_dict({}), tmp_path / "none") == ""  # markov, no folder


def packing(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with data.pack=true, for the Hugging Face model packing is for."""
    model = {**raw["model"], "kind": "hf", "hf": {"model_type": "qwen2"}}
    return {**raw, "model": model, "data": {**raw["data"], "pack": True}}


def test_packed_rows_hold_whole_conversations_each_as_its_unpacked_sample(
    tmp_path: Path,
) -> None:
    records = [TWO_TURNS, *sums(9)]
    raw = spec(tmp_path, records, shuffle=False)
    raw["model"]["block_size"] = 32
    alone, packed = corpus_of(raw), corpus_of(packing(raw))
    chats = alone.at(32).train.chats
    rows = packed.at(32).train.rows
    assert [i for row in rows for i in row] == list(range(len(records)))  # in order, each once
    assert len(rows) < len(records)  # several conversations share a row
    x, y = packed.train_batch(0, len(rows), seq_len=32)
    ax, ay = alone.train_batch(0, len(records), seq_len=32)
    assert x.shape == (len(rows), 2, 32) and y.shape == (len(rows), 32)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            width = len(chats[i].ids) - 1  # its inputs: every token but the last
            # token by token: the ids, targets (-100 but the assistants') and positions
            # of the conversation alone, positions restarting at 0
            assert x[r, 0, at : at + width].tolist() == ax[i, :width].tolist()
            assert y[r, at : at + width].tolist() == ay[i, :width].tolist()
            assert x[r, 1, at : at + width].tolist() == list(range(width))
            at += width
        assert at <= 32 and (r == len(rows) - 1 or at + len(chats[row[-1] + 1].ids) - 1 > 32)
        assert y[r, at:].tolist() == [IGNORE] * (32 - at)  # padding: never scored
        assert x[r, 1, at:].tolist() == list(range(32 - at))  # ... and a sequence of its own
    for r in range(len(rows)):  # a row depends on its index alone
        assert torch.equal(packed.train_batch(r, 1, seq_len=32)[0][0], x[r])
    again = corpus_of(packing(raw))
    again_x, again_y = again.train_batch(0, len(rows), seq_len=32)
    assert torch.equal(again_x, x) and torch.equal(again_y, y)
    assert packed.fingerprint != alone.fingerprint


def test_packed_rows_resume_mid_run_at_another_world_size_as_one_process_reads_them(
    tmp_path: Path,
) -> None:
    raw = packing(spec(tmp_path, sums(30)))  # shuffled epochs of its packed rows
    raw["model"]["block_size"] = 48
    raw["train"] = {"global_batch_size": 4, "micro_batch_size": 2}
    cfg = resolve_data(config_from_dict(raw))
    corpus = build_corpus(cfg.data)
    rows = len(corpus.at(48).train)
    assert 4 < rows < 30  # conversations share rows
    steps = 2 * rows // 4 + 1  # past the end of the second epoch

    def step_inputs(world: int, *, start: int, count: int) -> list[torch.Tensor]:
        """Each step's global batch, rank after rank, from sample `start` on."""
        ranks = [
            ShardedBatches.for_job(cfg, corpus, rank=r, world_size=world, samples_seen=start)
            for r in range(world)
        ]
        return [torch.cat([x for b in ranks for x, _ in b.next_step()]) for _ in range(count)]

    one = step_inputs(1, start=0, count=steps)
    resumed = step_inputs(2, start=4 * 3, count=steps - 3)  # resumed after step 3 on 2 ranks
    assert all(torch.equal(a, b) for a, b in zip(one[3:], resumed, strict=True))
    samples = torch.cat(one)  # [sample, 2, T]: the stream, epoch after epoch
    first, second = samples[:rows], samples[rows : 2 * rows]
    assert not torch.equal(first, second)  # each epoch in its own order ...
    assert sorted(map(str, first.tolist())) == sorted(map(str, second.tolist()))  # same rows


def test_packing_keeps_a_truncated_conversation_whole_in_a_row_of_its_own(tmp_path: Path) -> None:
    raw = spec(tmp_path, [sums(1)[0], TWO_TURNS, sums(2)[1]], truncate=True)
    raw["model"]["block_size"] = 16  # TWO_TURNS' 26 tokens cut to 17: 16 inputs, one row
    corpus = corpus_of(packing(raw))
    assert corpus.at(16).train.rows == [(0,), (1,), (2,)]
    x, y = corpus.train_batch(1, 1, seq_len=16)
    assert x[0, 1].tolist() == list(range(16))
    assert [t for t in y[0].tolist() if t != IGNORE] == ids("hello how are you <|im_end|>")


@pytest.mark.parametrize(
    ("changes", "wanted"),
    [
        ({"data.kind": "markov"}, "data.pack=true packs conversations: it is for data.kind chat"),
        ({"model.kind": "mlp", "model.hf": {}}, "it is for model.kind hf or gpt; got mlp"),
        (
            {"model.kind": "gpt", "model.hf": {}, "model.activation_checkpointing": True},
            "gives trainstack's GPT documents to keep apart in its forward, which activation "
            "checkpointing's recompute",
        ),
        (
            {"strategy.kind": "pipeline", "strategy.engine": "deepspeed"},
            "only the torch engine passes on; got strategy.engine=deepspeed, allowed: torch",
        ),
    ],
)
def test_pack_is_refused_in_one_line_where_it_cannot_work(
    tmp_path: Path, changes: dict[str, Any], wanted: str
) -> None:
    raw = packing(spec(tmp_path, sums(4)))
    for key, value in changes.items():
        section, name = key.split(".")
        raw[section] = {**raw.get(section, {}), name: value}
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert wanted in str(e.value) and "\n" not in str(e.value)
