"""`trainstack export RUN --out model.pt`: a checkpoint's consolidated weights (and a
Hugging Face model's `save_pretrained` folder); a LoRA run's adapters as a peft adapter
folder (`--adapter-dir`), or folded into the weights (`--merge`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from trainstack.cli.args import error, store_option
from trainstack.config import ConfigError
from trainstack.kinds import data_kind_of, model_kind_of
from trainstack.storage import open_location


def export_command(args: argparse.Namespace) -> int:
    """Verify a checkpoint and write its consolidated weights (`model.pt`) to --out; a
    Hugging Face model (`model.kind: hf`) also as a `save_pretrained` directory; a LoRA
    run's adapters to --adapter-dir, its weights with the adapters merged (--merge)."""
    from trainstack.checkpoint import CheckpointError, resolve, save_atomically
    from trainstack.config import config_from_dict
    from trainstack.models.lora import whole_weights

    if not args.out and not args.adapter_dir:
        return error("export needs --out, --adapter-dir or both", code=2)
    try:
        options = dict(store_option(text) for text in args.storage_options)
        found = resolve(open_location(args.checkpoint, options))
        state = whole_weights(found)
        cfg = config_from_dict(found.manifest["spec"])
    except (CheckpointError, ConfigError) as err:
        return error(str(err), code=2)
    lora = bool(cfg.model.lora.rank)
    if (args.merge or args.adapter_dir) and not lora:
        flag = "--merge" if args.merge else "--adapter-dir"
        return error(
            f"{flag} is for a run with model.lora; {found.path} trained every weight", code=2
        )
    if args.adapter_dir:
        from trainstack.models.lora import write_adapter_folder

        adapter_dir = Path(args.adapter_dir)
        if adapter_dir.exists() and any(adapter_dir.iterdir()):
            return error(f"--adapter-dir {adapter_dir} exists and is not empty", code=2)
        write_adapter_folder(
            cfg.model, vocab_size=cfg.data.vocab_size, weights=state, directory=adapter_dir
        )
        print(
            f"trainstack: wrote {adapter_dir} (a peft adapter folder; load it with "
            "peft.PeftModel.from_pretrained(base_model, folder))"
        )
    if args.merge:
        from trainstack.models.lora import merged_weights

        state = merged_weights(cfg.model, vocab_size=cfg.data.vocab_size, weights=state)
    if not args.out:
        return 0
    out = Path(args.out)
    save_atomically(state, out)
    numel = sum(t.numel() for t in state.values())
    merged = ", adapters merged" if args.merge else ""
    written = f"{len(state)} tensors, {numel:,} values{merged}"
    print(f"trainstack: wrote {out} ({written}) from {found.path}")
    if not model_kind_of(cfg).hf_config:
        return 0
    if lora and not args.merge:
        if args.hf_dir:
            return error(
                "--hf-dir of a run with model.lora needs --merge (the adapters folded into "
                "the weights); or --adapter-dir for the adapters alone",
                code=2,
            )
        return 0
    from trainstack.models.hf import export_pretrained

    hf_dir = Path(args.hf_dir) if args.hf_dir else out.with_name(out.stem + "_hf")
    try:
        export_pretrained(
            cfg.model, vocab_size=cfg.data.vocab_size, weights=state, directory=hf_dir
        )
    except ConfigError as err:
        return error(str(err), code=2)
    print(
        f"trainstack: wrote {hf_dir} (Hugging Face save_pretrained; load it with "
        "AutoModelForCausalLM.from_pretrained)"
    )
    copied = copy_tokenizer(cfg, hf_dir)
    if copied:
        print(f"trainstack: copied the run's tokenizer from {copied} into {hf_dir}")
    return 0


def copy_tokenizer(cfg: Any, hf_dir: Path) -> str:
    """Save the run's tokenizer (a chat job's `data.tokenizer`, else the pretrained
    folder's, when it has one) beside the exported model; the folder it came from, or
    "" when the run had none (or it is gone: the model is exported all the same)."""
    folders = [cfg.data.tokenizer] if data_kind_of(cfg).chat_template else []
    folders.append(cfg.model.pretrained)
    for folder in folders:
        if not folder or not Path(folder, "tokenizer_config.json").is_file():
            continue
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(folder, local_files_only=True).save_pretrained(hf_dir)
        return str(folder)
    return ""
