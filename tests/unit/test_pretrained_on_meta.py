"""A pretrained model built for a strategy that reads it rank by rank: parameters on the
meta device (buffers real, ties kept), the folder's names and shapes checked first (one
ConfigError line naming the key and folder), its FLOPs counted without storage, and a
folder whose names transformers converts while loading loaded whole as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from trainstack import checkpoint as ckpt
from trainstack.config import ConfigError, ModelConfig
from trainstack.models import build_model
from trainstack.models.flops import count_training_flops
from trainstack.models.hf import HFCausalLM
from trainstack.models.on_meta import has_meta_parameters
from trainstack.tasks import Task

from user_model_specs import HF_WIDTHS

VOCAB, T = 16, 8
WIDTHS = HF_WIDTHS


def save(path: Path, model_type: str = "qwen2", **extra: object) -> Path:
    config = transformers.CONFIG_MAPPING[model_type](vocab_size=VOCAB, **WIDTHS, **extra)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("saved") / "qwen2", tie_word_embeddings=True)


def build(folder: Path, *, on_meta: bool) -> HFCausalLM:
    cfg = ModelConfig(kind="hf", pretrained=str(folder), block_size=T)
    model = build_model(cfg, vocab_size=VOCAB, seed=0, pretrained_on_meta=on_meta)
    assert isinstance(model, HFCausalLM)
    return model


def test_parameters_are_on_meta_and_buffers_and_ties_are_real(tied: Path) -> None:
    empty, whole = build(tied, on_meta=True), build(tied, on_meta=False)
    assert has_meta_parameters(empty) and not has_meta_parameters(whole)
    assert all(p.is_meta for p in empty.parameters())
    assert ckpt.parameter_shapes(empty) == ckpt.parameter_shapes(whole)
    assert empty.get_submodule("lm_head").weight is empty.body.get_submodule("embed_tokens").weight
    buffers = dict(whole.named_buffers())
    for name, buffer in empty.named_buffers():  # the rotary inv_freq, computed from the config
        assert not buffer.is_meta and torch.equal(buffer, buffers[name]), name


def test_flops_of_a_model_on_meta_are_counted_on_fake_tensors(tied: Path) -> None:
    task = Task(kind="lm", num_outputs=VOCAB)
    batch = (torch.randint(VOCAB, (2, T)), torch.randint(VOCAB, (2, T)))
    empty = build(tied, on_meta=True)
    counted = count_training_flops(empty, batch, task=task)
    assert counted == count_training_flops(build(tied, on_meta=False), batch, task=task) > 0
    assert all(p.is_meta for p in empty.parameters())  # counted on a copy


def test_a_saved_tensor_of_another_shape_is_one_line_naming_it_and_the_folder(
    tied: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "narrower"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((tied / "model.safetensors").read_bytes())
    config = json.loads((tied / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ConfigError) as err:
        build(folder, on_meta=True)
    message = str(err.value)
    assert message.startswith(f"model.pretrained='{str(folder)[:40]}") and "\n" not in message
    assert "mismatched: model.layers.0.mlp.down_proj.weight saved [32, 64] vs [32, 48]" in message


def test_a_missing_tensor_is_one_line_naming_it_and_the_folder(tied: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-norm"
    folder.mkdir()
    (folder / "config.json").write_text((tied / "config.json").read_text())
    weights = load_file(tied / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError) as err:
        build(folder, on_meta=True)
    message = str(err.value)
    assert message.startswith(f"model.pretrained='{str(folder)[:40]}") and "\n" not in message
    assert "missing: model.norm.weight" in message


def test_names_transformers_converts_while_loading_load_the_model_whole(tmp_path: Path) -> None:
    """Mixtral's files keep one tensor per expert, its model one stacked tensor."""
    folder = save(tmp_path / "mixtral", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert not has_meta_parameters(build(folder, on_meta=True))


PARTS = [
    ("rows", (6, 4), (slice(2, 5), slice(0, 4))),
    ("columns", (6, 4), (slice(0, 6), slice(1, 3))),
    ("a block", (6, 4), (slice(3, 6), slice(2, 4))),
    ("the middle of 3 dims", (3, 4, 5), (slice(0, 3), slice(1, 3), slice(0, 5))),
    ("the last of 3 dims", (3, 4, 5), (slice(1, 2), slice(0, 4), slice(2, 5))),
    ("whole", (3, 4), (slice(0, 3), slice(0, 4))),
    ("a vector's half", (8,), (slice(4, 8),)),
]


@pytest.mark.parametrize(("what", "shape", "part"), PARTS, ids=[p[0] for p in PARTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_part_of_a_saved_tensor_reads_as_that_slice_of_it(
    what: str, shape: tuple[int, ...], part: tuple[slice, ...], dtype: torch.dtype, tmp_path: Path
) -> None:
    """Read run by run from the file (float32 weights from bfloat16 files: converted)."""
    from trainstack.checkpoint.pretrained import SavedTensor, read_slice, saved_tensors

    saved = {"before": torch.arange(5.0), "t": torch.randn(shape).to(dtype)}
    save_file(saved, tmp_path / "model.safetensors")
    into = torch.empty([s.stop - s.start for s in part], dtype=torch.float32)
    with (tmp_path / "model.safetensors").open("rb") as f:
        read_slice(
            f,
            start=saved_tensors(tmp_path)["t"].start,
            saved=SavedTensor(shape=shape, dtype=dtype),
            offsets=tuple(s.start for s in part),
            into=into,
        )
    assert torch.equal(into, saved["t"][part].float())
