"""GPU side of the speed options; skipped without CUDA (see the device tool)."""

import pytest
import torch

from trainstack.config import OptimConfig
from trainstack.optim import build_optimizer
from trainstack.strategies.base import to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_adamw_on_a_gpu_uses_the_fused_kernel_unless_told_not_to() -> None:
    model = torch.nn.Linear(8, 8).cuda()
    assert build_optimizer(model, OptimConfig(), lr=1e-3).defaults["fused"]
    assert not build_optimizer(model, OptimConfig(fused=False), lr=1e-3).defaults["fused"]


def test_batches_reach_the_gpu_through_pinned_memory() -> None:
    x, y = torch.arange(6).view(2, 3), torch.arange(6, 12).view(2, 3)
    moved = to_device((x, y), torch.device("cuda"), pin_memory=True)
    torch.cuda.synchronize()
    assert moved[0].is_cuda and torch.equal(moved[0].cpu(), x)
    assert torch.equal(moved[1].cpu(), y)
