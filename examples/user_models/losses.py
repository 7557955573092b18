"""A user loss for `task.loss: "user_models.losses:label_smoothed_ce"`.

trainstack calls it as `fn(outputs, batch)` with `batch = (inputs, targets)` (under a
pipeline the last stage has no inputs: `(None, targets)`) and trains on the scalar it
returns. Held-out `eval_loss` is this loss too; `eval_accuracy` still compares the
logits' argmax with the targets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SMOOTHING = 0.1
"""Probability mass spread evenly over all classes (tokens) in each target."""


def label_smoothed_ce(
    outputs: Any, batch: tuple[torch.Tensor | None, torch.Tensor]
) -> torch.Tensor:
    """Mean cross-entropy against targets smoothed by SMOOTHING.

    Works for classification logits [B, C] with labels [B] and for language-model
    logits [B, T, V] with next tokens [B, T]; `outputs` may be a tensor or carry a
    `.logits` tensor (Hugging Face models).
    """
    _, targets = batch
    logits = getattr(outputs, "logits", outputs)
    return F.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), label_smoothing=SMOOTHING
    )
