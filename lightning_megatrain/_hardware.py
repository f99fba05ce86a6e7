"""Units, the GPU peak MFU is quoted against, and readers of this machine: the one home of each.

Bottom of the package: imports nothing from ``lightning_megatrain``, so the strategy, the engine, the planner and the
callbacks all may import it (and none of them has to import another for these).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

GIB = 2**30  # bytes per GiB: every "GiB" in logs, errors and plans

#: Dense bf16 tensor-core peak of one H100 / H200 SXM GPU in FLOP/s: NVIDIA's H100 and H200 Tensor Core GPU data
#: sheets give 1,979 TFLOPS "with sparsity" (2:4 structured) for BF16, half of it dense. The MFU denominator of
#: ``ThroughputLogger`` and ``megatrain plan``.
H100_BF16_PEAK_FLOPS = 989e12

#: Dense bf16 tensor-core peaks by GPU name fragment, from NVIDIA's data sheets (half the "with sparsity" figure):
#: the MFU denominator of ``ThroughputLogger(peak_flops="auto")``. A device not listed (a CPU, another GPU) gets no MFU.
GPU_BF16_PEAK_FLOPS = {"H100": H100_BF16_PEAK_FLOPS, "H200": H100_BF16_PEAK_FLOPS, "A100": 312e12}


def device_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak FLOP/s of ``device`` from ``GPU_BF16_PEAK_FLOPS``; None for a CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_BF16_PEAK_FLOPS.items() if key in name), None)


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


# Host RAM left to the OS and other processes ([Note: host reserve]): max(MIN_GIB,
# FRACTION x MemTotal). The planner leaves it of MemTotal; the engine leaves it of what MemAvailable says when it
# places anything on the host. MemTotal counts the kernel's own memory, the page cache the data loader reads through,
# sshd, shells and monitoring; pinned memory cannot be swapped out, so a plan at 125.9 of 128 GiB leaves them nothing
# and the OOM killer picks the trainer. Assumed, not measured: 2 GiB covers a minimal server, 3% (3.8 GiB of 128) the
# kernel's page tables and slab on a large one.
HOST_OS_RESERVE_MIN_GIB = 2.0
HOST_OS_RESERVE_FRACTION = 0.03
# What the engine's own process allocates after its placements and cannot count, which the engine leaves free on top
# of the OS reserve ([Note: host reserve]). Measured on the H200's host (benchmarks/memory_pool.py, the Llama-2-13B
# shape at 8 x 1024 tokens, compiled layers; 2026-12-03-memory-pool-llama-2-13b-h200-d4ea2b4.host-samples.txt): 2.2 GiB
# beyond the plan from the split to the end of fit, torch.compile's 16 workers and its heap at the first forward and
# backward. (An earlier 5.3 GiB was most likely Lightning's teardown copying the device groups' moments to the host
# after an error, since stopped: [Note: device states at teardown] in engine/device_state.py.) 6 GiB keeps 3.8 GiB of
# margin on it.
ENGINE_HOST_SLACK_GIB = 6.0


def host_os_reserve(host_limit: int) -> int:
    """Bytes of a host RAM limit left to the OS and other processes: max(``HOST_OS_RESERVE_MIN_GIB``,
    ``HOST_OS_RESERVE_FRACTION`` x the limit), capped at the limit."""
    return min(host_limit, max(int(HOST_OS_RESERVE_MIN_GIB * GIB), int(HOST_OS_RESERVE_FRACTION * host_limit)))


def _read_int(path: Path) -> int | None:
    """An integer file (cgroup counters); None where missing or unlimited (``max``)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_host_bytes(cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """What this process may still allocate before swapping or being killed, and which limit that is: the smallest of
    ``MemAvailable``, the cgroup's memory limit less its usage (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), and
    the address-space limit (``RLIMIT_AS``) less this process's ``VmSize``. None where none is known."""
    bounds = []
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        bounds.append((available, "MemAvailable"))
    for limit, usage, name in (("memory.max", "memory.current", "cgroup memory.max"),
                               ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                "cgroup memory.limit_in_bytes")):
        cap, used = _read_int(cgroup_root / limit), _read_int(cgroup_root / usage)
        if cap is not None and used is not None and cap < 1 << 60:  # v1 reports "no limit" as a huge number
            bounds.append((max(cap - used, 0), name))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    vm_size = host_rss_gib("VmSize")
    if soft != resource.RLIM_INFINITY and vm_size is not None:
        bounds.append((max(soft - int(vm_size * GIB), 0), "RLIMIT_AS (ulimit -v)"))
    return min(bounds) if bounds else None


def placeable_host_bytes() -> tuple[int, str] | None:
    """What the engine may place on the host ([Note: host reserve]): :func:`available_host_bytes` less
    :func:`host_os_reserve` of ``MemTotal`` and ``ENGINE_HOST_SLACK_GIB``, and the limit that binds; None where
    unknown.

    Note: host reserve
        MemAvailable, read when the engine places something (the setup's checks, the split between both memories,
        the offloaded checkpoints, the snapshots of the updates during backward), does not hold what arrives after
        it and the engine does not count: torch.compile's worker processes and the compiler's heap (the first
        forward, after the placement), the CUDA driver's host allocations, the data loader's batches, other
        processes. A placement that takes all of it leaves the kernel nothing to give them, and pinned memory cannot
        be swapped out: the OOM killer then ends the trainer without a message. The engine therefore leaves the reserve
        the planner leaves of MemTotal (max(2 GiB, 3%)) and, on top, ``ENGINE_HOST_SLACK_GIB`` for its own growth
        after the placement (measured: 2.2 GiB). The planner counts only the OS reserve and a 3 GiB process, so at
        the host's edge it is that much more optimistic than the engine (docs/planner.md).
    """
    bound = available_host_bytes()
    total = meminfo_bytes("MemTotal")
    if bound is None or total is None:
        return bound
    reserve = host_os_reserve(total) + int(ENGINE_HOST_SLACK_GIB * GIB)
    return max(bound[0] - reserve, 0), f"{bound[1]} less the {reserve / GIB:.1f} GiB reserve"


def other_processes_slack(per_host: int) -> int:
    """Host bytes the other ``per_host - 1`` ranks of this host keep free for their own growth after placement
    (``ENGINE_HOST_SLACK_GIB`` each, [Note: host reserve]); :func:`placeable_host_bytes` leaves this process's."""
    return (per_host - 1) * int(ENGINE_HOST_SLACK_GIB * GIB)


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


def umask() -> int:
    """This process's file-creation mask (``/proc/self/status``'s ``Umask``, else set and restored at once): files and
    folders made private by ``tempfile`` get ``0o666 & ~umask()`` / ``0o777 & ~umask()`` before they are published."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
