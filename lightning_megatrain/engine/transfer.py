"""The transfer/stream layer: moves layer weights host->device into *slots* and gradients device->host.

Everything device-specific in the engine lives here (DESIGN principle 5). :class:`HostTransfer` is the CPU backend
(compute on the host: weights are used in place, gradients accumulate synchronously). :class:`CudaTransfer` is the
GPU backend, built on three streams and S >= 2 slots; it offloads saved layer inputs through engine/offload.py.

[Note: slot lifecycle]
A slot is a device buffer that holds one layer's weights at a time. ``prefetch(i)`` picks the least recently used
slot not in use, makes the H2D stream wait for that slot's ``free`` event (recorded on the compute stream after the
last kernel that read the previous layer), copies layer i's fp32 master into the slot (casting to the compute dtype
on the H2D stream) and records the slot's ``ready`` event. ``acquire(i)`` makes the compute stream wait for
``ready``; ``release(i)`` records ``free``. Slot reuse is therefore ordered by events only: no host synchronization.
Because backward starts with the layers forward ended with, the last S layers of forward are reused by backward
without a second upload.

[Note: gradient drain]
``drain(i, grads)`` packs layer i's weight grads into one contiguous device buffer on the compute stream (one D2H
per layer, not one per parameter). When every parameter got a gradient, the fp32 host grads end up written by one
D2H straight into the layer's pinned grad buffer, with no host pass at all:

- *first arrival* (no host grads since ``zero_grad``): the buffer is cast to fp32 on the compute stream;
- *accumulation* (the host grads are complete from earlier micro-batches): the H2D stream uploads them, the D2H
  stream waits for that upload and for the packed buffer, adds the two in fp32 and writes the sum back. The
  upload rides behind the weight prefetches, the add runs beside the compute stream, and nothing waits on the
  host, so accumulated micro-batches cost PCIe time only.

Either way the per-layer squared norm is taken on the device from the fp32 buffer written back, so clipping needs
no pass over host memory. Otherwise (an expert without tokens, or a layer whose host grads are partial) the packed
buffer goes into a free pinned *grad slab* and a worker thread adds the slab into the fp32 host grads. In every case
the worker waits for the copy's event and then owns the host side. Holding the device buffers in the worker's queue
entry until the copy's event has completed is what keeps the caching allocator from reusing them while the D2H
stream still reads them: a structural invariant, not bookkeeping (tests/test_gpu.py runs every path against plain
training). ``wait_drained()`` is the only place the host waits for the device, once per optimizer step, on the training
thread or, when grads land late (engine/engine.py, [Note: late grads]), on the optimizer step's worker.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_megatrain.engine.device_state import DeviceGroup
from lightning_megatrain.engine.host_store import FlatGroup
from lightning_megatrain.engine.offload import ActivationOffload, _Stashed
from lightning_megatrain.engine.pinned import HostRegistry


Gate = Callable[[FlatGroup], None]  # blocks until a group's masters are final (engine/overlap.py)


def _no_gate(group: FlatGroup) -> None:
    """No optimizer step runs concurrently: masters are always final."""


class HostTransfer:
    """CPU backend: compute runs on the host, so a *slot* is the master itself (fp32) or a cast copy of it."""

    def __init__(self, groups: list[FlatGroup], compute_dtype: torch.dtype, gate: Gate | None = None) -> None:
        self.groups = groups
        self.compute_dtype = compute_dtype
        self.gate = gate or _no_gate

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

    def stash(self, x: Tensor) -> Tensor:
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

    def take_host_added(self) -> bool:
        """Every drain is a host add on the host backend."""
        return True

    def wait_drained(self) -> None:
        """Grads are accumulated synchronously by :meth:`drain`."""

    def close(self) -> None:
        """No resources to free."""


@dataclass
class _Slot:
    """One device buffer for one layer's weights, with the two events that order its reuse."""

    staging: Tensor  # 1D fp32 on device, [max layer numel]: H2D target
    compute: Tensor  # 1D compute dtype on device, [max layer numel]; the same tensor as ``staging`` under fp32
    # - CUDA events for stream synchronization (see [Note: slot lifecycle])
    ready: torch.cuda.Event  # recorded by the H2D stream after the copy (and cast); waited on by the compute stream
    free: torch.cuda.Event  # recorded by the compute stream after the layer's last kernel; waited on by the H2D stream
    layer: int | None = None
    last_use: int = 0


@dataclass
class _Drain:
    """A D2H copy in flight: the packed device grads stay referenced until ``done`` (see [Note: gradient drain])."""

    index: int
    present: list[bool]  # which parameters had a gradient, in layout order
    device: tuple[Tensor, ...]  # 1D device buffers the copy reads (the packed grads, the device-side sum)
    slab: Tensor | None  # 1D pinned host, [max layer numel]; None when the copy went straight into the grads
    done: torch.cuda.Event  # recorded by the D2H stream after the copy; waited on by the drain worker


class CudaTransfer:
    """GPU backend: S slots fed by an H2D stream, grads returned on a D2H stream into pinned slabs."""

    def __init__(
        self,
        groups: list[FlatGroup],
        device: torch.device,
        compute_dtype: torch.dtype,
        num_slots: int,
        registry: HostRegistry,
        gate: Gate | None = None,
        device_groups: dict[int, DeviceGroup] | None = None,
    ) -> None:
        self.groups = groups
        self.gate = gate or _no_gate
        # layers whose weights live on the device for good (engine/device_state.py): no slot, no upload
        self.device_groups = device_groups or {}
        # whether a device group's summed grad is copied to its host grads (engine.set_grads_read)
        self.device_grads_to_host = True
        self.device = device
        self.compute_dtype = compute_dtype
        max_numel = max(g.numel for g in groups)
        # H2D stream: uploads layer i+1 (forward) or i-1 (backward) while the compute stream runs layer i.
        self.h2d_stream = torch.cuda.Stream(device)
        # D2H stream: returns layer i's grads to host while the compute stream recomputes layer i-1.
        self.d2h_stream = torch.cuda.Stream(device)
        self.slots: list[_Slot] = []
        for _ in range(num_slots):
            staging = torch.empty(max_numel, dtype=torch.float32, device=device)
            compute = staging if compute_dtype == torch.float32 else torch.empty_like(staging, dtype=compute_dtype)
            self.slots.append(_Slot(staging, compute, torch.cuda.Event(), torch.cuda.Event()))
        self._in_use: set[int] = set()  # layer indices acquired and not yet released
        self.offload = ActivationOffload(device, self.h2d_stream, self.d2h_stream, registry)  # engine/offload.py
        self._clock = 0
        # Slabs let the D2H of layer i overlap the host accumulation of earlier layers; three absorb jitter.
        self._free_slabs: queue.Queue[Tensor] = queue.Queue()
        for _ in range(3):
            self._free_slabs.put(registry.empty(max_numel, compute_dtype))
        self.slab_nbytes = 3 * max_numel * compute_dtype.itemsize  # pinned host bytes of the slabs
        self._pending: queue.Queue[_Drain | None] = queue.Queue()
        self._in_flight: dict[int, int] = {}  # layer index -> drains queued and not yet accumulated
        self._host_added = False  # a drain since take_host_added() left its host grads to a host add
        self._lock = threading.Lock()  # guards _in_flight between the training and the worker thread
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._drain_worker, name="megatrain-grad-drain", daemon=True)
        self._worker.start()

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
            slot.staging[:n].copy_(group.master, non_blocking=True)
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
    def stash(self, x: Tensor) -> _Stashed:
        """Offload a saved layer input to pinned host memory (see engine/offload.py, [Note: activation offload])."""
        return self.offload.stash(x)

    def prefetch_stash(self, stashed: _Stashed | None) -> None:
        """Start copying an offloaded input back to the device (no-op if already there)."""
        self.offload.prefetch_stash(stashed)

    def trim_stash_cache(self) -> None:
        """Return the stash pool's idle buffers to the OS once the auto recompute policy has calibrated."""
        self.offload.trim_stash_cache()

    def unstash(self, stashed: _Stashed) -> Tensor:
        """The offloaded input on the device, ready for the compute stream."""
        return self.offload.unstash(stashed)

    # ------------------------------------------------------------------------------------------------- D2H / drain
    def drain(self, index: int, grads: list[Tensor | None]) -> None:
        """Send layer ``index``'s weight grads (device, compute dtype, one per parameter) to the host fp32 grads."""
        self._raise_worker_error()
        present = [g is not None for g in grads]
        if not any(present):
            return
        if index in self.device_groups:
            self._drain_device_group(index, grads)
            return
        group = self.groups[index]
        idle = self._count_in_flight(index)
        # See [Note: gradient drain] for the three paths.
        whole = idle and all(present) and group.grad.is_pinned()
        first = whole and all(p.grad is None for p in group.params)
        accumulate = whole and not first and group.grads_are_views()
        compute = torch.cuda.current_stream(self.device)
        done = torch.cuda.Event()  # recorded by the D2H stream after the copy; waited on by the drain worker
        with torch.profiler.record_function("megatrain::d2h"):
            packed = torch.cat([g.reshape(-1) for g in grads if g is not None])  # [n_present] on the compute stream
            if first:
                packed = packed.float()
                group.device_norm_sq = torch.dot(packed, packed)  # the per-layer partial norm clipping will read
            packed_ready = torch.cuda.Event()  # recorded by the compute stream; waited on by the D2H stream
            packed_ready.record(compute)
            if accumulate:
                self._drain_accumulating(index, packed, packed_ready, done)
                return
            if not first:
                group.device_norm_sq = None  # the host add below makes it stale: clipping takes a host pass
                self._host_added = True
            slab = None if first else self._free_slabs.get()  # blocks only when the worker is 3 layers behind
            target = group.grad if slab is None else slab
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(packed_ready)
                target[: packed.numel()].copy_(packed, non_blocking=True)
                done.record(self.d2h_stream)
        self._pending.put(_Drain(index, present, (packed,), slab, done))

    def _drain_accumulating(
        self, index: int, packed: Tensor, packed_ready: torch.cuda.Event, done: torch.cuda.Event
    ) -> None:
        """Add ``packed`` to layer ``index``'s complete host grads on the device and write the fp32 sum back."""
        group = self.groups[index]
        with torch.cuda.stream(self.h2d_stream):
            total = torch.empty(group.numel, dtype=torch.float32, device=self.device)  # [numel] fp32
            total.copy_(group.grad, non_blocking=True)  # behind the weight prefetches already queued
            uploaded = torch.cuda.Event()  # recorded by the H2D stream; waited on by the D2H stream
            uploaded.record(self.h2d_stream)
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(uploaded)
            self.d2h_stream.wait_event(packed_ready)
            total.add_(packed)  # fp32 += compute dtype, the same sum the slab path's host add makes
            # Read by clip_grad_norm_ on the compute stream only after wait_drained() synchronized on ``done``.
            group.device_norm_sq = torch.dot(total, total)
            group.grad.copy_(total, non_blocking=True)
            done.record(self.d2h_stream)
        self._pending.put(_Drain(index, [True] * len(group.params), (packed, total), None, done))

    def _count_in_flight(self, index: int) -> bool:
        """Count one more drain of layer ``index`` for the worker; True when none was in flight (the worker is done
        with this layer's host grads)."""
        with self._lock:
            idle = self._in_flight.get(index, 0) == 0
            self._in_flight[index] = self._in_flight.get(index, 0) + 1
        return idle

    def _drain_device_group(self, index: int, grads: list[Tensor | None]) -> None:
        """Sum layer ``index``'s grads into its device group's fp32 grad, then copy that sum to the host grads when
        code may read them (``device_grads_to_host``).

        The device sum is what the device optimizer step reads; the host copy keeps ``p.grad`` what it is without
        device groups (engine/device_state.py). Parameters without a gradient in any micro-batch keep ``grad=None``.
        A sum starts anew after ``zero_grad``: with host copies, when the host grads are ``None`` (as for any layer);
        without, when the engine cleared the group (``grads_zeroed``).
        """
        group, device_group = self.groups[index], self.device_groups[index]
        if not self.device_grads_to_host:
            with torch.profiler.record_function("megatrain::device_grad_sum"):
                device_group.add_grads(grads, first=not any(device_group.present))
                group.device_norm_sq = torch.dot(device_group.grad, device_group.grad)  # absent grads are zeros
            return
        first = self._count_in_flight(index) and all(p.grad is None for p in group.params)
        compute = torch.cuda.current_stream(self.device)
        done = torch.cuda.Event()  # recorded by the D2H stream after the copy; waited on by the drain worker
        with torch.profiler.record_function("megatrain::d2h"):
            device_group.add_grads(grads, first)
            group.device_norm_sq = torch.dot(device_group.grad, device_group.grad)  # absent grads are zeros
            summed = torch.cuda.Event()  # recorded by the compute stream; waited on by the D2H stream
            summed.record(compute)
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(summed)
                group.grad.copy_(device_group.grad, non_blocking=True)
                device_group.grad_read.record(self.d2h_stream)
                done.record(self.d2h_stream)
        self._pending.put(_Drain(index, list(device_group.present), (), None, done))

    def _drain_worker(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            try:
                item.done.synchronize()
                del item.device  # the D2H has completed: the allocator may reuse the device buffers now
                group = self.groups[item.index]
                if item.slab is None:
                    group.attach_grads(item.present)
                    continue
                host = item.slab[: sum(p.numel() for p, ok in zip(group.params, item.present) if ok)]
                grads: list[Tensor | None] = []
                offset = 0
                for p, ok in zip(group.params, item.present):
                    grads.append(host[offset : offset + p.numel()].view(p.shape) if ok else None)
                    offset += p.numel() if ok else 0
                group.accumulate(grads, packed=host)
            except BaseException as e:  # surfaced on the training thread by the next drain/wait_drained
                self._error = e
            finally:
                if item.slab is not None:
                    self._free_slabs.put(item.slab)
                with self._lock:
                    self._in_flight[item.index] -= 1
                self._pending.task_done()

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("MegaTrain gradient drain worker failed") from error

    def take_host_added(self) -> bool:
        """Whether a drain since the last call left host grads to a host add, so some layer's device norm is missing
        (engine/engine.py, [Note: late grads])."""
        added, self._host_added = self._host_added, False
        return added

    def wait_drained(self) -> None:
        """Block until every drained gradient is in the host fp32 grads (once per optimizer step)."""
        self._pending.join()
        self._raise_worker_error()

    def close(self) -> None:
        self._pending.put(None)
        self._worker.join()
        self.slots.clear()
