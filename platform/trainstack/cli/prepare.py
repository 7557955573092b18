"""`trainstack prepare SPEC`: tokenize a text job's files once into token files."""

from __future__ import annotations

import argparse
import sys

from trainstack.cli.args import error
from trainstack.config import ConfigError, load_config
from trainstack.kinds import DATA_KINDS, data_kind_of, kinds_that


def prepare_command(args: argparse.Namespace) -> int:
    """Tokenize a `data.kind: text` spec's files into its prepared directory (or reuse it)."""
    from trainstack.data.paths import resolve_data
    from trainstack.data.prepare import ensure_prepared

    try:
        cfg = resolve_data(load_config(args.config, args.overrides))
        if not data_kind_of(cfg).prepared:
            prepared = kinds_that(lambda k: k.prepared, table=DATA_KINDS, last=" or ")
            raise ConfigError(
                f"data.kind={cfg.data.kind} has nothing to prepare; `trainstack prepare` "
                f"tokenizes data.kind={prepared}"
            )
        ensure_prepared(cfg, out=sys.stdout)
    except ConfigError as err:
        return error(str(err), code=2)
    return 0
