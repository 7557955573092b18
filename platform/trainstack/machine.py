"""What this machine has: the CPUs an embedded Ray instance gets, its memory, its GPUs."""

from __future__ import annotations

import os

from trainstack.compat.ray import embedded_ray_cpus


def local_cpus() -> float:
    """CPUs an embedded Ray instance started here gets: Ray's own count (which
    `ray.init` uses: the cgroup quota in a container, else the machine's CPUs), or on a
    Ray that hides it, the CPUs this process may use."""
    return embedded_ray_cpus()


def local_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_gpus() -> int:
    """GPUs torch can use here."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
