"""Training metrics: throughput, MFU, step-time statistics and peak memory.

Throughput is global (all workers together): every rank steps in lock-step, so one
rank's step time is the group's. MFU is reported only where the device's peak
FLOP/s is known (`PEAK_FLOPS`, bf16 dense tensor-core figures); on CPU it is None.
"""

from __future__ import annotations

import resource
import statistics
from dataclasses import dataclass, field

import torch

PEAK_FLOPS: dict[str, float] = {
    # Substring of torch.cuda.get_device_name() -> bf16 dense peak FLOP/s.
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "V100": 125e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """Peak bf16 dense FLOP/s of `device`, or None when unknown (CPU included)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_FLOPS.items():
        if key in name:
            return flops
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this worker: allocated GPU memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def mfu(
    *, flops_per_token: float, tokens_per_s: float, peak_flops: float | None, world_size: int
) -> float | None:
    """Model FLOPs utilisation: achieved training FLOP/s over the group's peak."""
    if peak_flops is None:
        return None
    return flops_per_token * tokens_per_s / (peak_flops * world_size)


@dataclass(kw_only=True)
class ThroughputMeter:
    """Step times of a run; the first `warmup_steps` are start-up, not steady state."""

    tokens_per_step: int
    samples_per_step: int
    warmup_steps: int = 3
    step_times: list[float] = field(default_factory=list)
    _window_start: int = 0

    def record(self, step_time_s: float) -> None:
        self.step_times.append(step_time_s)

    def window(self) -> dict[str, float]:
        """Mean step time and throughput over the steps since the last call."""
        times = self.step_times[self._window_start :] or self.step_times[-1:]
        self._window_start = len(self.step_times)
        step_s = sum(times) / len(times)
        return {
            "step_time_s": step_s,
            "tokens_per_s": self.tokens_per_step / step_s,
            "samples_per_s": self.samples_per_step / step_s,
        }

    def steady_state(self) -> dict[str, float]:
        """Throughput over all steps after warm-up (all steps if the run is that short)."""
        times = self.step_times[self.warmup_steps :] or self.step_times
        step_s = sum(times) / len(times)
        return {
            "step_time_s": step_s,
            "step_time_p50_s": statistics.median(times),
            "tokens_per_s": self.tokens_per_step / step_s,
            "samples_per_s": self.samples_per_step / step_s,
        }
