"""`trainstack export RUN --out model.pt`: a checkpoint's consolidated weights (and a
Hugging Face model's `save_pretrained` folder)."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainstack.cli.args import error, store_option
from trainstack.config import ConfigError
from trainstack.kinds import model_kind_of
from trainstack.storage import open_location


def export_command(args: argparse.Namespace) -> int:
    """Verify a checkpoint and write its consolidated weights (`model.pt`) to --out; a
    Hugging Face model (`model.kind: hf`) also as a `save_pretrained` directory."""
    from trainstack.checkpoint import CheckpointError, resolve, save_atomically
    from trainstack.config import config_from_dict

    try:
        options = dict(store_option(text) for text in args.storage_options)
        found = resolve(open_location(args.checkpoint, options))
        state = found.full_weights()
        cfg = config_from_dict(found.manifest["spec"])
    except (CheckpointError, ConfigError) as err:
        return error(str(err), code=2)
    out = Path(args.out)
    save_atomically(state, out)
    numel = sum(t.numel() for t in state.values())
    print(f"trainstack: wrote {out} ({len(state)} tensors, {numel:,} values) from {found.path}")
    if not model_kind_of(cfg).hf_config:
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
    return 0
