"""The suite's bounds: a layout held to one process in a way that holds on any x86 CPU,
and a run held to what only learning reaches.

Another CPU's kernels sum in another order, and AdamW's normalised step turns those
last-bit differences into visible ones in weights whose gradient is near zero: in
float32 they once moved tensor-parallel results from 4e-6 to 1.4e-5 after 10 steps.

- **Torch engines** (ddp, fsdp, tensor parallel, torch pipelines) train in float64
  (`train.precision: fp64`) on both sides. A reordered sum differs by about 1e-16 of its
  size; AdamW's step amplifies a gradient's error by at most lr / eps (1e6 at lr 1e-2), so
  10 steps stay far under `FP64_BOUND`. A bug is not that small: a skipped gradient
  all-reduce, a wrong shard offset or a dropped optimizer state moves weights by 1e-4 to
  1e-2 in as many steps.
- **Engines that cannot** (DeepSpeed; the parameter server's float32 wire): the bound is
  a multiple of the reference's own float32 sensitivity, measured on the machine the
  test runs on: the one-process float32 run again with its micro-batches split in two
  and in four (the same samples and gradient, summed in other orders) moves the weights
  by what float32 rounding alone does here; a layout doing the same math in another order lands
  about as far from the reference. (A float32 run's distance from the float64 one is no
  such measure: a model whose arithmetic depends on its dtype, an RMSNorm taking
  `finfo(dtype).eps`, lands 6e-3 away on purpose.)

Learning: a run "learned" only if it ends below `context_blind_loss`, what a model that
ignores every earlier token scores (on the vocab-16 order-1 language most tests train
on: 2.424, the floor 1.139, ln 16 = 2.773), by a margin the run's measured loss clears.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch

from trainstack.config import config_from_dict
from trainstack.models import build_model
from trainstack.runtime.gloo_processes import run_processes

FP64_BOUND = 1e-9
"""Weights of a float64 layout and its one-process reference after a short run (measured:
1e-16 to 1e-13 after 10 to 20 steps on the suite's layouts). Float64 noise grows with a
run's length too: the 4-block GPT of test_auto_layout, reordered, moves 2e-13 in 10
steps, 1e-12 in 20 and 5e-9 in 30 at lr 1e-2, so runs held to this bound stay short."""

SENSITIVITY_MULTIPLE = 20
"""How many times the reference's own float32 sensitivity a float32 layout may land from
the float32 reference."""

MOVED = 1e-2
"""At least this far from initialisation: the comparison says something only if training
moved the weights."""


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys; inf
    where either holds a NaN (Python's `max` would drop it: an unread tensor full of NaN
    must not pass for an equal one)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    gaps = [(a[k].double() - b[k].double()).abs().nan_to_num(nan=math.inf).max() for k in a]
    return max(gap.item() for gap in gaps)


def initial_weights(raw: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights `raw`'s model starts from (its seed)."""
    cfg = config_from_dict(raw)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=cfg.train.seed)
    return model.state_dict()


def assert_trained(weights: dict[str, torch.Tensor], raw: dict[str, Any]) -> None:
    """Training moved the weights: an equivalence with them proves something."""
    moved = max_difference(weights, initial_weights(raw))
    assert moved > MOVED, f"training moved the weights by {moved:.3g} only"


def one_process(raw: dict[str, Any], out: Path) -> dict[str, torch.Tensor]:
    """`raw` trained by one process (DDP, no Ray), in this process; its final weights."""
    spec = copy.deepcopy(raw)
    spec["strategy"] = {"kind": "ddp"}
    spec["scaling"] = {"num_workers": 1}
    spec["checkpoint"] = {**spec.get("checkpoint", {}), "storage_path": str(out / "runs")}
    spec.pop("faults", None)
    run_processes(config_from_dict(spec), world_size=1, out_dir=out)
    weights: dict[str, torch.Tensor] = torch.load(out / "model.pt", weights_only=True)
    return weights


def float32_sensitivity(raw: dict[str, Any], out: Path) -> tuple[dict[str, torch.Tensor], float]:
    """`raw`'s one-process float32 reference, and how far float32 rounding alone moves it
    here: the largest weight difference to the same run with its micro-batches split in
    two and in four (the same samples and gradient, summed in other orders). One split
    alone can land within an ulp by luck: which weight Adam's step amplifies varies."""
    float32 = {**raw, "train": {**raw["train"], "precision": "fp32"}}
    reference = one_process(float32, out / "reference")
    micro = float32["train"]["micro_batch_size"]
    splits = [micro // parts for parts in (2, 4) if micro % parts == 0]
    assert splits, f"train.micro_batch_size={micro}: even sizes split, this one cannot"
    sensitivity = 0.0
    for size in splits:
        split = {**float32, "train": {**float32["train"], "micro_batch_size": size}}
        weights = one_process(split, out / f"split-{size}")
        sensitivity = max(sensitivity, max_difference(weights, reference))
    assert sensitivity > 0, "summed in other orders, nothing changed: no sensitivity to scale"
    print(f"float32 sensitivity here: {sensitivity:.3g}")
    return reference, sensitivity


def sensitivity_bound(sensitivity: float) -> float:
    """The bound for a float32 layout whose reference has `sensitivity`."""
    return SENSITIVITY_MULTIPLE * sensitivity


@torch.no_grad()
def held_out_loss(raw: dict[str, Any], weights: dict[str, torch.Tensor]) -> float:
    """`raw`'s held-out loss of `weights`, computed by the plain model in this process, in
    the weights' dtype, with the task's cross-entropy written out here."""
    from trainstack.data import build_corpus
    from trainstack.data.sharding import eval_batches

    cfg = config_from_dict(raw)
    model = build_model(cfg.model, vocab_size=cfg.data.vocab_size, seed=0)
    model.to(next(iter(weights.values())).dtype).load_state_dict(weights)
    model.eval()
    batches = eval_batches(
        build_corpus(cfg.data),
        count=cfg.data.eval_samples,
        seq_len=cfg.model.block_size,
        micro_batch_size=5,
        rank=0,
        world_size=1,
    )
    total = 0.0
    for x, y in batches:
        outputs = model(x)
        logits = getattr(outputs, "logits", outputs)  # a Hugging Face model's output
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        total += float(loss) * y.numel()
    return total / sum(y.numel() for _, y in batches)


def context_blind_loss(raw: dict[str, Any]) -> float:
    """What a model that ignores the context scores on `raw`'s Markov language."""
    from trainstack.data.markov import MarkovCorpus

    return MarkovCorpus.from_config(config_from_dict(raw).data).context_blind_loss()
