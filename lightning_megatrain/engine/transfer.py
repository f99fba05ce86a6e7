"""The transfer/stream layer: moves layer weights host->device into *slots* and gradients device->host.

Everything device-specific in the engine lives here and in the two mechanisms the CUDA backend is built from
(DESIGN principle 5). The engine (engine/engine.py) and the streamed Function (engine/streamed.py) call a backend
through :class:`Transfer`, one protocol that both backends satisfy. :class:`HostTransfer` is the CPU backend
(compute on the host: weights are used in place, gradients accumulate synchronously). :class:`CudaTransfer` is the
GPU backend, built on three streams and S >= 2 slots: it creates the H2D and D2H streams and the slots, and hands
the streams to the activation offload (engine/offload.py, [Note: activation offload]) and the gradient drain
(engine/drain.py, [Note: gradient drain]).

[Note: slot lifecycle]
A slot is a device buffer that holds one layer's weights at a time. ``prefetch(i)`` picks the least recently used
slot not in use, makes the H2D stream wait for that slot's ``free`` event (recorded on the compute stream after the
last kernel that read the previous layer), copies layer i's fp32 master into the slot (casting to the compute dtype
on the H2D stream; a bf16 master of a compact ``host_state`` under bf16 compute is copied straight into the compute
buffer, no fp32 staging and half the PCIe bytes) and records the slot's ``ready`` event. ``acquire(i)`` makes the
compute stream wait for ``ready``; ``release(i)`` records ``free``. Slot reuse is therefore ordered by events only:
no host synchronization. Because backward starts with the layers forward ended with, the last S layers of forward
are reused by backward without a second upload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_megatrain.engine.device_state import DeviceGroup
from lightning_megatrain.engine.drain import GradDrain
from lightning_megatrain.engine.host_store import FlatGroup
from lightning_megatrain.engine.offload import ActivationOffload, _Stashed
from lightning_megatrain.engine.pinned import HostRegistry

Gate = Callable[[FlatGroup], None]  # blocks until a group's masters are final (engine/overlap.py)


def _no_gate(group: FlatGroup) -> None:
    """No optimizer step runs concurrently: masters are always final."""


# A saved layer input's handle, from :meth:`Transfer.stash` to :meth:`Transfer.unstash`: the input itself on the host
# backend, an offloaded copy (engine/offload.py) on CUDA.
Stashed = Any


@runtime_checkable
class Transfer(Protocol):
    """A transfer backend, per layer index of the stack: what the engine and the streamed Function call."""

    device: torch.device  # where compute runs
    # whether a device group's summed grad is copied to its host grads; set before each backward
    # (engine.set_grads_read); only device groups read it
    device_grads_to_host: bool
    # told each layer index whose drain, issued while it was set, has landed in the host grads; any thread
    # (engine/backward_updates.py)
    landed_hook: Callable[[int], None] | None

    # - weights (see [Note: slot lifecycle])
    def prefetch(self, index: int) -> None:
        """Start making layer ``index``'s weights available (a no-op out of range)."""

    def acquire(self, index: int) -> Tensor:
        """Layer ``index``'s weights, 1D in the compute dtype, usable by the compute that follows."""

    def release(self, index: int) -> None:
        """Compute has issued its last use of the weights :meth:`acquire` gave."""

    def persistent(self, index: int) -> bool:
        """Whether :meth:`acquire`'s weights stay unchanged until the optimizer step (a kept layer needs no copy)."""

    def invalidate(self) -> None:
        """The masters may have changed: the next :meth:`acquire` reads them again."""

    # - saved layer inputs (see engine/offload.py, [Note: activation offload])
    def stash(self, x: Tensor, on_device: bool = False) -> Stashed:
        """Keep a saved layer input for its recompute in backward (``on_device``: where compute runs, not offloaded)."""

    def prefetch_stash(self, stashed: Stashed | None) -> None:
        """Start bringing a stashed input back (no-op for ``None`` or one already back)."""

    def unstash(self, stashed: Stashed) -> Tensor:
        """The stashed input, usable by the compute that follows."""

    def trim_stash_cache(self) -> None:
        """Free the stash buffers no longer needed once the recompute policy has calibrated (once per run)."""

    # - grads (see engine/drain.py, [Note: gradient drain])
    def drain(self, index: int, grads: list[Tensor | None]) -> None:
        """Add layer ``index``'s weight grads (one per parameter, ``None`` = no gradient) into the host fp32 grads."""

    def take_host_added(self) -> bool:
        """Whether a drain since the last call added on the host, so some layer's device norm is missing
        (engine/optimizer_step.py, [Note: late grads])."""

    def wait_drained(self) -> None:
        """Block until every drained gradient is in the host fp32 grads."""

    # - host memory and teardown
    def host_bytes(self) -> dict[str, int]:
        """Host bytes the backend holds beyond the masters and grads, by kind (sizes only, no sync)."""

    def close(self) -> None:
        """Free the backend's resources (after the last drain)."""


class HostTransfer:
    """CPU backend (a :class:`Transfer`): compute runs on the host, so a *slot* is the master itself (fp32) or a cast
    copy of it."""

    device = torch.device("cpu")  # compute runs where the masters are

    def __init__(self, groups: list[FlatGroup], compute_dtype: torch.dtype, gate: Gate | None = None) -> None:
        self.groups = groups
        self.compute_dtype = compute_dtype
        self.gate = gate or _no_gate
        self.device_grads_to_host = True  # no device groups on the host backend: nothing reads it
        self.landed_hook: Callable[[int], None] | None = None  # told each drained layer (engine/backward_updates.py)

    def prefetch(self, index: int) -> None:
        """Nothing to prefetch: the host masters are already where compute runs."""

    def acquire(self, index: int) -> Tensor:
        """1D weights of layer ``index`` in the compute dtype (the fp32 master itself, no copy, under 32-true)."""
        self.gate(self.groups[index])
        master = self.groups[index].master
        return master if master.dtype == self.compute_dtype else master.to(self.compute_dtype)

    def release(self, index: int) -> None:
        """Nothing to release: no slot is held."""

    def invalidate(self) -> None:
        """Nothing cached: :meth:`acquire` always reads the current masters."""

    def persistent(self, index: int) -> bool:
        """Whether :meth:`acquire`'s weights stay unchanged until the optimizer step: never assumed on the host."""
        return False

    def stash(self, x: Tensor, on_device: bool = False) -> Tensor:
        """Keep a saved layer input as is: host memory is where it lives anyway."""
        return x

    def unstash(self, stashed: Tensor) -> Tensor:
        return stashed

    def trim_stash_cache(self) -> None:
        """No pinned blocks on the host backend."""

    def prefetch_stash(self, stashed: Tensor | None) -> None:
        """Nothing to prefetch on the host."""

    def drain(self, index: int, grads: list[Tensor | None]) -> None:
        self.groups[index].accumulate(grads)
        if self.landed_hook is not None:
            self.landed_hook(index)

    def take_host_added(self) -> bool:
        """Every drain is a host add on the host backend."""
        return True

    def wait_drained(self) -> None:
        """Grads are accumulated synchronously by :meth:`drain`."""

    def host_bytes(self) -> dict[str, int]:
        """No host buffers beyond the masters and grads."""
        return {}

    def close(self) -> None:
        """No resources to free."""


@dataclass
class _Slot:
    """One device buffer for one layer's weights, with the two events that order its reuse."""

    staging: Tensor  # 1D on device in the masters' dtype, [max layer numel]: H2D target
    compute: Tensor  # 1D compute dtype on device, [max layer numel]; ``staging`` itself when the dtypes are equal
    # - CUDA events for stream synchronization (see [Note: slot lifecycle])
    ready: torch.cuda.Event  # recorded by the H2D stream after the copy (and cast); waited on by the compute stream
    free: torch.cuda.Event  # recorded by the compute stream after the layer's last kernel; waited on by the H2D stream
    layer: int | None = None
    last_use: int = 0


class CudaTransfer:
    """GPU backend (a :class:`Transfer`): S slots fed by an H2D stream; saved layer inputs offloaded
    (engine/offload.py) and grads returned (engine/drain.py) on a D2H stream."""

    def __init__(
        self,
        groups: list[FlatGroup],
        device: torch.device,
        compute_dtype: torch.dtype,
        num_slots: int,
        registry: HostRegistry,
        gate: Gate | None = None,
        drain_groups: list[FlatGroup] | None = None,
    ) -> None:
        self.groups = groups
        self.gate = gate or _no_gate
        # layers whose weights live on the device for good (engine/device_state.py): no slot, no upload; shared with
        # the drain, filled in place by set_device_groups
        self.device_groups: dict[int, DeviceGroup] = {}
        self.device = device
        self.compute_dtype = compute_dtype
        max_numel = max(g.numel for g in groups)
        master_dtype = groups[0].master.dtype  # fp32, or bf16 for a compact host_state: the upload's dtype
        # H2D stream: uploads layer i+1 (forward) or i-1 (backward) while the compute stream runs layer i; also
        # restores offloaded inputs and uploads host grads for the device-side sum (engine/offload.py, drain.py).
        self.h2d_stream = torch.cuda.Stream(device)
        # D2H stream: returns layer i's grads to host while the compute stream recomputes layer i-1; also offloads
        # saved layer inputs in forward (engine/offload.py).
        self.d2h_stream = torch.cuda.Stream(device)
        self.slots: list[_Slot] = []
        for _ in range(num_slots):
            staging = torch.empty(max_numel, dtype=master_dtype, device=device)
            compute = staging if compute_dtype == master_dtype else torch.empty_like(staging, dtype=compute_dtype)
            self.slots.append(_Slot(staging, compute, torch.cuda.Event(), torch.cuda.Event()))
        self._in_use: set[int] = set()  # layer indices acquired and not yet released
        # fills a slot's staging with layer i whole on the H2D stream instead of copying its master (several ranks:
        # engine/sharded_layers.py, [Note: sharded layer masters]); None: the master is whole on the host
        self.upload: Callable[[int, Tensor], None] | None = None
        self.offload = ActivationOffload(device, self.h2d_stream, self.d2h_stream, registry)  # engine/offload.py
        self._clock = 0
        # the host grads each layer's drain writes: the layers' own, or with several ranks each layer's owned share,
        # drained as the fp32 mean its reduce-scatter leaves (engine/sharded_layers.py)
        self.grad_drain = GradDrain(  # engine/drain.py
            drain_groups or groups, device, compute_dtype if drain_groups is None else torch.float32, registry,
            self.h2d_stream, self.d2h_stream, self.device_groups,
        )

    # ----------------------------------------------------------------------------------------------- H2D / slots
    def _slot_of(self, index: int) -> _Slot | None:
        return next((s for s in self.slots if s.layer == index), None)

    def prefetch(self, index: int) -> None:
        """Start uploading layer ``index`` into a slot unless it is already in one (see [Note: slot lifecycle])."""
        if not 0 <= index < len(self.groups) or index in self.device_groups or self._slot_of(index) is not None:
            return
        candidates = [s for s in self.slots if s.layer not in self._in_use]
        if not candidates:
            raise RuntimeError(
                f"MegaTrain: all {len(self.slots)} slots hold layers still in use ({sorted(self._in_use)}) while "
                f"layer {index} is requested. A layer called from inside another layer needs num_slots >= "
                f"{len(self._in_use) + 1}."
            )
        slot = min(candidates, key=lambda s: s.last_use)
        group = self.groups[index]
        self.gate(group)  # an overlapped optimizer step may still be updating these masters
        n = group.numel
        with torch.cuda.stream(self.h2d_stream), torch.profiler.record_function("megatrain::h2d"):
            self.h2d_stream.wait_event(slot.free)
            if self.upload is None:
                slot.staging[:n].copy_(group.master, non_blocking=True)
            else:
                self.upload(index, slot.staging)
            if slot.compute is not slot.staging:
                slot.compute[:n].copy_(slot.staging[:n])
            slot.ready.record(self.h2d_stream)
        slot.layer = index

    def acquire(self, index: int) -> Tensor:
        """Layer ``index``'s weights as a 1D compute-dtype device tensor, usable on the current (compute) stream."""
        if index in self.device_groups:
            return self.device_groups[index].compute  # written on the compute stream only
        self.prefetch(index)
        slot = self._slot_of(index)
        assert slot is not None
        torch.cuda.current_stream(self.device).wait_event(slot.ready)
        self._in_use.add(index)
        self._clock += 1
        slot.last_use = self._clock
        return slot.compute[: self.groups[index].numel]

    def release(self, index: int) -> None:
        """The compute stream has issued its last kernel reading layer ``index``: the slot may be refilled after."""
        if index in self.device_groups:
            return
        slot = self._slot_of(index)
        assert slot is not None
        slot.free.record(torch.cuda.current_stream(self.device))
        self._in_use.discard(index)

    def set_device_groups(self, device_groups: dict[int, DeviceGroup]) -> None:
        """Layers that became device groups (engine/device_state.py): their weights and grads stay on the device from
        the next step on. Called once, before any training step; the drain shares the mapping."""
        self.device_groups.update(device_groups)

    def persistent(self, index: int) -> bool:
        """Whether layer ``index``'s weights stay where :meth:`acquire` put them until the optimizer step: a device
        group's compute copy does, a slot is refilled after :meth:`release`."""
        return index in self.device_groups

    def invalidate(self) -> None:
        """Masters may have changed (optimizer step, load_state_dict): the next acquire uploads again."""
        for slot in self.slots:
            if slot.layer not in self._in_use:
                slot.layer = None

    # ------------------------------------------------------------------------------------------ activation offload
    def stash(self, x: Tensor, on_device: bool = False) -> _Stashed | Tensor:
        """Offload a saved layer input to pinned host memory (see engine/offload.py, [Note: activation offload]), or
        keep it on the device (``on_device``: the last checkpoints, see [Note: recompute segments])."""
        return x if on_device else self.offload.stash(x)

    def prefetch_stash(self, stashed: _Stashed | Tensor | None) -> None:
        """Start copying an offloaded input back to the device (no-op if already there or never offloaded)."""
        if not isinstance(stashed, Tensor):
            self.offload.prefetch_stash(stashed)

    def trim_stash_cache(self) -> None:
        """Return the stash pool's idle buffers to the OS once the auto recompute policy has calibrated."""
        self.offload.trim_stash_cache()

    def unstash(self, stashed: _Stashed | Tensor) -> Tensor:
        """The offloaded input on the device, ready for the compute stream."""
        return stashed if isinstance(stashed, Tensor) else self.offload.unstash(stashed)

    # ------------------------------------------------------------------------------------------------- D2H / drain
    @property
    def device_grads_to_host(self) -> bool:
        """Whether a device group's summed grad is copied to its host grads (engine.set_grads_read)."""
        return self.grad_drain.device_grads_to_host

    @device_grads_to_host.setter
    def device_grads_to_host(self, read: bool) -> None:
        self.grad_drain.device_grads_to_host = read

    def drain(self, index: int, grads: list[Tensor | None]) -> None:
        """Send layer ``index``'s weight grads to the host fp32 grads (see engine/drain.py, [Note: gradient drain])."""
        self.grad_drain.drain(index, grads)

    @property
    def landed_hook(self) -> Callable[[int], None] | None:
        """Told each layer whose drain, issued while the hook was set, has landed (engine/backward_updates.py)."""
        return self.grad_drain.landed_hook

    @landed_hook.setter
    def landed_hook(self, hook: Callable[[int], None] | None) -> None:
        self.grad_drain.landed_hook = hook

    def take_host_added(self) -> bool:
        """Whether a drain since the last call left host grads to a host add (engine/optimizer_step.py, [Note: late
        grads])."""
        return self.grad_drain.take_host_added()

    def wait_drained(self) -> None:
        """Block until every drained gradient is in the host fp32 grads (once per optimizer step)."""
        self.grad_drain.wait_drained()

    # --------------------------------------------------------------------------------------------------------------
    def host_bytes(self) -> dict[str, int]:
        """Pinned host bytes beyond the masters and grads: the drain's grad slabs and the stash pool's buffers of
        offloaded layer inputs."""
        return {"grad_slabs": self.grad_drain.slab_nbytes, "offload_cache": self.offload.stash_pool.nbytes}

    def close(self) -> None:
        self.grad_drain.close()
        self.slots.clear()
