"""The machine a plan is for: its memory limits and cores, and the rates the time model is calibrated with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lightning_megatrain.planner.constants import (
    GPU_RESERVE_GIB,
    INTER_HOST_GBPS,
    NVLINK_GBPS,
    PCIE_D2H_GBPS,
    PCIE_DUPLEX_GBPS,
    PCIE_H2D_GBPS,
    PROCESS_GIB,
)


@dataclass(frozen=True)
class Machine:
    """Limits, cores and calibrated rates of the machine a plan is for. ``None`` is read from this machine when
    :func:`~lightning_megatrain.planner.plan` runs; the other defaults are the H200 measurements of constants.py."""

    host_ram_gib: float | None = None
    """Host RAM limit in GiB. ``None``: this machine's ``MemTotal``, else ``HOST_REF_GIB``."""

    gpu_mem_gib: float | None = None
    """GPU memory limit in GiB. ``None``: this machine's first GPU, else ``GPU_REF_GIB`` (an H200's)."""

    cpu_cores: int | None = None
    """Cores of the host optimizer, whose measured rate scales linearly from ``CPU_REF_CORES``. ``None``: the
    cores this process may run on."""

    pcie_h2d_gbps: float = PCIE_H2D_GBPS
    """Pinned host-to-device rate, GB/s."""

    pcie_d2h_gbps: float = PCIE_D2H_GBPS
    """Pinned device-to-host rate, GB/s."""

    pcie_duplex_gbps: float = PCIE_DUPLEX_GBPS
    """Both directions at once, GB/s in total."""

    nvlink_gbps: float = NVLINK_GBPS
    """Bus bandwidth of an all-gather or reduce-scatter among the GPUs of one host, per GPU and direction, GB/s
    (several ranks only, planner/ranks.py)."""

    inter_host_gbps: float = INTER_HOST_GBPS
    """Network bandwidth between hosts, per GPU and direction, GB/s (``num_nodes`` > 1 only; a 400 Gb/s NIC is 50)."""

    achieved_tflops: float | None = None
    """Sustained GPU rate on executed FLOPs. ``None``: ``ACHIEVED_TFLOPS`` under bf16, ``COMPILED_TFLOPS`` under
    bf16 with ``compile_layers``, ``FP32_TFLOPS`` under 32-true."""

    process_gib: float = PROCESS_GIB
    """Host RAM of the process itself (CUDA context, libraries, Python), GiB."""

    gpu_reserve_gib: float = GPU_RESERVE_GIB
    """GPU memory no tensor of the plan accounts for (CUDA context, cuBLAS workspaces, fragmentation), GiB."""

    pinned_pow2_rounding: bool = False
    """Model the engine before engine/pinned.py, which took every pinned buffer (masters, grads, slabs, offloaded
    layer inputs) from torch's caching host allocator, rounded up to a power of two, as the 2026-11-29 core runs
    measured (benchmarks/planner_vs_measured.py plans them so)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("Invalid Machine arguments:\n- " + "\n- ".join(problems))

    def problems(self) -> list[str]:
        """Every invalid field, one line each with the value found and what is allowed."""
        out = []
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        for name in ("host_ram_gib", "gpu_mem_gib", "achieved_tflops"):
            value = getattr(self, name)
            if value is not None and not (number(value) and value > 0):
                out.append(f"{name}={value!r}: need a number > 0, or None (this machine's / the default)")
        if self.cpu_cores is not None and not (type(self.cpu_cores) is int and self.cpu_cores >= 1):
            out.append(f"cpu_cores={self.cpu_cores!r}: need an int >= 1, or None (the cores this process may use)")
        for name in ("pcie_h2d_gbps", "pcie_d2h_gbps", "pcie_duplex_gbps", "nvlink_gbps", "inter_host_gbps"):
            value = getattr(self, name)
            if not (number(value) and value > 0):
                out.append(f"{name}={value!r}: need a rate in GB/s > 0")
        for name in ("process_gib", "gpu_reserve_gib"):
            value = getattr(self, name)
            if not (number(value) and value >= 0):
                out.append(f"{name}={value!r}: need a number of GiB >= 0")
        if not isinstance(self.pinned_pow2_rounding, bool):
            out.append(f"pinned_pow2_rounding={self.pinned_pow2_rounding!r}: need True or False")
        return out

    def replace(self, **changes: object) -> Machine:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
