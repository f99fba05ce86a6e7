"""Units, the GPU peak MFU is quoted against, and readers of this machine: the one home of each.

Bottom of the package: imports nothing from ``lightning_megatrain``, so the strategy, the engine, the planner and the
callbacks all may import it (and none of them has to import another for these).
"""

from __future__ import annotations

import os

import torch

GIB = 2**30  # bytes per GiB: every "GiB" in logs, errors and plans

#: Dense bf16 tensor-core peak of one H100 / H200 SXM GPU in FLOP/s: NVIDIA's H100 and H200 Tensor Core GPU data
#: sheets give 1,979 TFLOPS "with sparsity" (2:4 structured) for BF16, half of it dense. The MFU denominator of
#: ``ThroughputLogger`` and ``megatrain plan``.
H100_BF16_PEAK_FLOPS = 989e12


def meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` field (``"MemAvailable"``, ``"MemTotal"``) in bytes; None where unknown (e.g. not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024  # the value is in kB
    except OSError:
        return None
    return None


def host_rss_gib(field: str = "VmRSS") -> float | None:
    """Resident set size of this process in GiB, read from ``/proc/self/status`` (``None`` where there is no procfs):
    now (``VmRSS``) or its high-water mark so far (``VmHWM``). Both count pinned memory."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024 / GIB  # the value is in kB
    except OSError:
        return None
    return None


def host_ram_gib() -> float | None:
    """This machine's RAM (``MemTotal``) in GiB; None where unknown."""
    total = meminfo_bytes("MemTotal")
    return None if total is None else total / GIB


def gpu_mem_gib() -> float | None:
    """Memory of this machine's first CUDA GPU in GiB; None without one."""
    return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else None


def cpu_cores() -> int:
    """Cores this process may run on (its affinity where the OS has one, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
