"""Page-locked host buffers of exactly the requested size, for the engine's long-lived host state.

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds every block up to
a power of two (measured on the H200, torch 2.11: a 384 MiB request took a 512 MiB block,
benchmarks/results/planner_gpu_check_2026-11-29.json): up to 2x the host RAM for the fp32 masters and grads. The
engine instead allocates ordinary host memory, page-aligns it, writes its initial contents (so the page faults are
taken by torch's multi-threaded copy, not by the driver) and page-locks it with ``cudaHostRegister``: the H2D and
D2H streams then read and write it at full PCIe speed, and ``Tensor.is_pinned()`` is True for it.

Registration outlives nothing: :meth:`HostRegistry.release` unregisters every region (the memory itself stays valid
for the parameters that view it, now pageable) and is called by the engine's teardown after a device synchronize;
:meth:`HostRegistry.free` unregisters one region early. The activation offload's ``StashPool`` takes the buffers of
offloaded layer inputs from here too, and frees them only once their copies are done (offload.py,
[Note: activation offload]).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import torch
from torch import Tensor

PAGE = mmap.PAGESIZE


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class HostRegistry:
    """Allocates page-locked host tensors and unregisters them all on :meth:`release`."""

    def __init__(self) -> None:
        self._regions: list[int] = []  # data_ptr of each registered region, for cudaHostUnregister

    def empty(self, numel: int, dtype: torch.dtype, init: Callable[[Tensor], None] | None = None) -> Tensor:
        """A 1D host tensor of ``numel`` elements, written by ``init`` (default: zeros), then page-locked.

        The memory is its own anonymous mapping (whole pages, page-aligned), so the registered range is exactly the
        tensor's storage: no page is shared with another allocation, and ``Tensor.is_pinned()`` (which asks the
        driver about the storage's first byte) is True.
        """
        nbytes = numel * dtype.itemsize
        span = round_up(max(nbytes, 1), PAGE)
        region = torch.frombuffer(mmap.mmap(-1, span), dtype=torch.uint8)  # the tensor keeps the mapping alive
        out = region[:nbytes].view(dtype)
        # Touch every page here (torch's parallel copy/fill) rather than one by one inside the driver's registration.
        if init is not None:
            init(out)
        else:
            region.zero_()
        err = int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), span, 0))
        if err != 0:
            raise RuntimeError(
                f"cudaHostRegister of {span / 2**20:.0f} MiB of host memory failed (cudaError {err}). HINT: the "
                "locked-memory limit may be too low (`ulimit -l`; containers: --ulimit memlock=-1)."
            )
        self._regions.append(region.data_ptr())
        return out

    def free(self, tensor: Tensor) -> None:
        """Unregister the region :meth:`empty` returned as ``tensor`` (no copy may still touch it). The memory goes
        back to the OS with the last reference to ``tensor``."""
        self._regions.remove(tensor.data_ptr())
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

    def release(self) -> None:
        """Unregister every region (call after the device has finished all copies touching them)."""
        cudart = torch.cuda.cudart() if self._regions else None
        while self._regions:
            cudart.cudaHostUnregister(self._regions.pop())
