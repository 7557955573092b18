"""Write scikit-learn's handwritten digits as `train.npz` and `val.npz` for `data.kind: arrays`.

    cd examples
    python prepare_digits.py data/digits
    trainstack run specs/digits_cnn.yaml

The 1797 images of 8 x 8 pixels (classes 0 to 9) are split by a permutation seeded
with SEED into 1437 training and 360 held-out images. Each file holds `inputs`,
float32 [N, 1, 8, 8] scaled from the 0..16 grey levels to [0, 1], and `labels`,
int64 [N]. Needs scikit-learn (`pip install scikit-learn`), which ships the data.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

SEED = 0
"""Seed of the train / held-out split."""
HELD_OUT = 360
"""Images held out (the other 1437 train)."""


def write_digits(out_dir: Path, *, held_out: int = HELD_OUT, seed: int = SEED) -> None:
    """Write `out_dir/train.npz` and `out_dir/val.npz` (each renamed into place whole)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    inputs = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    splits = {"train": order[:-held_out], "val": order[-held_out:]}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        partial = out_dir / f".{name}.partial.npz"
        np.savez(partial, inputs=inputs[rows], labels=labels[rows])
        os.replace(partial, out_dir / f"{name}.npz")
        print(
            f"{out_dir / f'{name}.npz'}: {len(rows)} images, {np.bincount(labels[rows])} per class"
        )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} OUT_DIR")
    write_digits(Path(sys.argv[1]))
