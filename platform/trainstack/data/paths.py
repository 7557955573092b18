"""Where a job's files are: `data.train` / `data.val` globs expanded on the driver.

Workers may run in another working directory (or on another node with the same
shared paths), so the driver turns every pattern into the sorted list of absolute
file paths it matches before the spec reaches them, and `data.prepared_dir` into an
absolute directory. A pattern may start with `stdlib:`, a path in the running
interpreter's standard library (`stdlib:*.py`: its sources ship with every Python). A
pattern that matches nothing is one `ConfigError` line.
"""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path

from trainstack.config import ConfigError, JobConfig
from trainstack.data.text import stdlib_pattern
from trainstack.kinds import DATA_KINDS
from trainstack.storage import local_storage

PREPARED = "prepared"
"""`data.prepared_dir` defaults to this folder of `checkpoint.storage_path` (of
`.cache/trainstack/runs` when that is an object store)."""


def resolve_data(cfg: JobConfig) -> JobConfig:
    """`cfg` with the paths workers read made absolute (their working directory may be
    another): `data.train`/`data.val` as files, `data.prepared_dir`, a chat job's
    tokenizer and template, and `model.pretrained`."""
    if cfg.model.pretrained:
        model = dataclasses.replace(cfg.model, pretrained=absolute(cfg.model.pretrained))
        cfg = dataclasses.replace(cfg, model=model)
    d = cfg.data
    if not DATA_KINDS[d.kind].reads_files(d.target):
        return cfg
    data = dataclasses.replace(
        d,
        train=expand("data.train", d.train),
        val=expand("data.val", d.val),
        prepared_dir=str(
            Path(d.prepared_dir or local_storage(cfg.checkpoint.storage_path) / PREPARED)
            .expanduser()
            .resolve()
        ),
    )
    if DATA_KINDS[d.kind].chat_template:  # a worker's working directory may be another
        data = dataclasses.replace(
            data,
            tokenizer=absolute(d.tokenizer),
            chat_template=absolute(d.chat_template) if d.chat_template else "",
        )
    return dataclasses.replace(cfg, data=data)


def absolute(path: str) -> str:
    """`path` made absolute when it names something here (else as given: the error comes
    from whoever reads it)."""
    resolved = Path(path).expanduser()
    return str(resolved.resolve()) if path and resolved.exists() else path


def expand(key: str, patterns: tuple[str, ...]) -> tuple[str, ...]:
    """Every file the patterns match, absolute, sorted within each pattern, each once."""
    files: list[str] = []
    for i, pattern in enumerate(patterns):
        path = Path(stdlib_pattern(pattern)).expanduser()
        matches = sorted(glob.glob(str(path), recursive=True))
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            what = "no such file" if not glob.has_magic(str(path)) else "matches no file"
            raise ConfigError(f"{key}[{i}]={pattern!r}: {what} (from {Path.cwd()})")
        files += [str(Path(m).resolve()) for m in matches if str(Path(m).resolve()) not in files]
    return tuple(files)
