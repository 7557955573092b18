"""Files written so that a reader never sees half of one, and their sha256: what
checkpoints, prepared data, sweep state and tracking records share (no torch here)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from trainstack.storage import Location, open_binary


def file_sha256(path: Location) -> str:
    """The file's sha256, streamed (from the store, for a store's file)."""
    digest = hashlib.sha256()
    with open_binary(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary name beside `path`, then rename: never a half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
