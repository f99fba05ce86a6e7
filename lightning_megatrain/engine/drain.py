"""The gradient drain: the CUDA backend returns each layer's weight grads to its fp32 host grads.

The streamed Function (engine/streamed.py) hands a layer's weight grads to its transfer backend (engine/transfer.py)
at the end of the layer's backward; the CUDA backend's :class:`GradDrain` sends them on the transfer's D2H stream
(and, to add them to earlier micro-batches' on the device, uploads on its H2D stream), with a worker thread for the
host adds.

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
stream still reads them: a structural invariant, not bookkeeping (the GPU tests, tests/**/test_gpu_*.py, run every
path against plain training). ``wait_drained()`` is the only place the host waits for the device, once per optimizer
step, on the training thread or, when grads land late (engine/optimizer_step.py, [Note: late grads]), on the optimizer
step's worker.

[Note: one drain on the device]
A host group's drain holds device memory until its D2H has completed: the packed grads (and, accumulating, the
uploaded host grads and their sum). When a layer's backward is faster than its grads' D2H (a wide layer at a small
micro-batch), nothing else would keep the next layers' packs from piling up on the GPU while the D2H stream works
through them; the planner counts one (planner/memory.py, "one layer's weight grads"). So ``drain`` takes one of
``DEVICE_DRAINS`` slots before it packs, and the worker gives the slot back as soon as the copy's event has completed,
before its host add: the D2H of layer i+1 still overlaps the backward of layer i (the training thread waits only when
the D2H stream is a whole layer behind, when the step is bound by PCIe anyway). Device groups hold no drain buffers
(their sum lives in the group) and take no slot.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_megatrain.engine.device_state import DeviceGroup
from lightning_megatrain.engine.grad_norm import norm_sq
from lightning_megatrain.engine.host_store import FlatGroup
from lightning_megatrain.engine.pinned import HostRegistry

# Host-group drains whose device buffers may exist at once (see [Note: one drain on the device]).
DEVICE_DRAINS = 1


@dataclass
class _Drain:
    """A D2H copy in flight: the packed device grads stay referenced until ``done`` (see [Note: gradient drain])."""

    index: int
    present: list[bool]  # which parameters had a gradient, in layout order
    device: tuple[Tensor, ...]  # 1D device buffers the copy reads (the packed grads, the device-side sum)
    slab: Tensor | None  # 1D pinned host, [max layer numel]; None when the copy went straight into the grads
    done: torch.cuda.Event  # recorded by the D2H stream after the copy; waited on by the drain worker
    notify: Callable[[int], None] | None = None  # the landed hook when issued (engine/backward_updates.py)
    holds_slot: bool = False  # holds one of the DEVICE_DRAINS slots, given back once ``done`` has completed


def add_packed(group: FlatGroup, present: list[bool], packed: Tensor) -> None:
    """Add packed grads into ``group``'s fp32 host grads: ``packed`` (1D host, at least as long as the grads) holds
    the grads of the parameters flagged in ``present`` back to back in layout order, as ``torch.cat`` of the present
    grads wrote them (a grad slab here; the residents' staging buffer, engine/residents.py)."""
    host = packed[: sum(p.numel() for p, ok in zip(group.params, present) if ok)]
    grads: list[Tensor | None] = []
    offset = 0
    for p, ok in zip(group.params, present):
        grads.append(host[offset : offset + p.numel()].view(p.shape) if ok else None)
        offset += p.numel() if ok else 0
    group.accumulate(grads, packed=host)


class GradDrain:
    """Layer grads to host fp32 grads on the D2H stream, through pinned slabs and a worker thread where the host must
    add them (see [Note: gradient drain]); both streams are the transfer's (engine/transfer.py)."""

    def __init__(
        self,
        groups: list[FlatGroup],
        device: torch.device,
        compute_dtype: torch.dtype,
        registry: HostRegistry,
        h2d_stream: torch.cuda.Stream,
        d2h_stream: torch.cuda.Stream,
        device_groups: dict[int, DeviceGroup],
    ) -> None:
        self.groups = groups
        # layers whose grads are summed on the device (engine/device_state.py)
        self.device_groups = device_groups
        # whether a device group's summed grad is copied to its host grads (engine.set_grads_read)
        self.device_grads_to_host = True
        # told each layer index whose drain has landed in its host grads, for drains issued while it is set
        # (engine/backward_updates.py); called on the drain worker
        self.landed_hook: Callable[[int], None] | None = None
        self.device = device
        self.h2d_stream = h2d_stream  # uploads complete host grads for the device-side sum, behind the weight uploads
        self.d2h_stream = d2h_stream  # returns layer i's grads while the compute stream recomputes layer i-1
        max_numel = max(g.numel for g in groups)
        # Slabs let the D2H of layer i overlap the host accumulation of earlier layers; three absorb jitter.
        self._free_slabs: queue.Queue[Tensor] = queue.Queue()
        for _ in range(3):
            self._free_slabs.put(registry.empty(max_numel, compute_dtype))
        self.slab_nbytes = 3 * max_numel * compute_dtype.itemsize  # pinned host bytes of the slabs
        self._pending: queue.Queue[_Drain | None] = queue.Queue()
        # taken by drain() before it packs a host group's grads, given back by the worker once the copy is done
        self._device_slots = threading.BoundedSemaphore(DEVICE_DRAINS)
        self._in_flight: dict[int, int] = {}  # layer index -> drains queued and not yet accumulated
        self._host_added = False  # a drain since take_host_added() left its host grads to a host add
        self._lock = threading.Lock()  # guards _in_flight between the training and the worker thread
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._drain_worker, name="megatrain-grad-drain", daemon=True)
        self._worker.start()

    def drain(self, index: int, grads: list[Tensor | None]) -> None:
        """Send layer ``index``'s weight grads (device, compute dtype, one per parameter) to the host fp32 grads."""
        self._raise_worker_error()
        present = [g is not None for g in grads]
        if not any(present):
            return
        if index in self.device_groups:
            self._drain_device_group(index, grads)
            return
        self._device_slots.acquire()  # [Note: one drain on the device]: waits while the last pack is still copied
        try:
            self._drain_host_group(index, grads, present)
        except BaseException:
            self._device_slots.release()  # nothing was queued (a CUDA OOM in the pack): the worker will not give it
            raise

    def _drain_host_group(self, index: int, grads: list[Tensor | None], present: list[bool]) -> None:
        """Pack and send a host group's grads, holding a slot the queued ``_Drain`` hands to the worker."""
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
                packed = packed.to(group.grad_dtype)  # fp32, or bf16 as computed (a compact host_state)
                group.device_norm_sq = norm_sq(packed)  # the per-layer partial norm clipping will read
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
        self._pending.put(_Drain(index, present, (packed,), slab, done, self.landed_hook, holds_slot=True))

    def _drain_accumulating(
        self, index: int, packed: Tensor, packed_ready: torch.cuda.Event, done: torch.cuda.Event
    ) -> None:
        """Add ``packed`` to layer ``index``'s complete host grads on the device and write the sum back: computed in
        fp32, rounded once to bf16 for bf16 host grads (a compact ``host_state``)."""
        group = self.groups[index]
        with torch.cuda.stream(self.h2d_stream):
            uploaded_grads = torch.empty(group.numel, dtype=group.grad_dtype, device=self.device)  # [numel]
            uploaded_grads.copy_(group.grad, non_blocking=True)  # behind the weight prefetches already queued
            total = uploaded_grads.float()  # [numel] fp32 (the same tensor for fp32 grads)
            uploaded = torch.cuda.Event()  # recorded by the H2D stream; waited on by the D2H stream
            uploaded.record(self.h2d_stream)
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(uploaded)
            self.d2h_stream.wait_event(packed_ready)
            # fp32 += compute dtype, the same sum the slab path's host add makes; ``packed`` is shorter than the
            # group only for the last rank's owned share, whose padding stays zero (engine/sharded_layers.py)
            total[: packed.numel()].add_(packed)
            summed = total.to(group.grad_dtype)  # [numel] as the host holds it (``total`` itself for fp32)
            # Read by clip_grad_norm_ on the compute stream only after wait_drained() synchronized on ``done``.
            group.device_norm_sq = norm_sq(summed)
            group.grad.copy_(summed, non_blocking=True)
            done.record(self.d2h_stream)
        self._pending.put(_Drain(index, [True] * len(group.params), (packed, uploaded_grads, total, summed), None,
                                 done, self.landed_hook, holds_slot=True))

    def _count_in_flight(self, index: int) -> bool:
        """Count one more drain of layer ``index`` for the worker; True when none was in flight (the worker is done
        with this layer's host grads)."""
        with self._lock:
            idle = self._in_flight.get(index, 0) == 0
            self._in_flight[index] = self._in_flight.get(index, 0) + 1
        return idle

    def _drain_device_group(self, index: int, grads: list[Tensor | None]) -> None:
        """Sum layer ``index``'s grads into its device group's grad (the host grads' dtype), then copy that sum to
        the host grads when code may read them (``device_grads_to_host``).

        The device sum is what the device optimizer step reads; the host copy keeps ``p.grad`` what it is without
        device groups (engine/device_state.py). Parameters without a gradient in any micro-batch keep ``grad=None``.
        A sum starts anew after ``zero_grad``: with host copies, when the host grads are ``None`` (as for any layer);
        without, when the engine cleared the group (``grads_zeroed``).
        """
        group, device_group = self.groups[index], self.device_groups[index]
        if not self.device_grads_to_host:
            with torch.profiler.record_function("megatrain::device_grad_sum"):
                device_group.add_grads(grads, first=not any(device_group.present))
                group.device_norm_sq = norm_sq(device_group.grad)  # absent grads are zeros
            return
        first = self._count_in_flight(index) and all(p.grad is None for p in group.params)
        compute = torch.cuda.current_stream(self.device)
        done = torch.cuda.Event()  # recorded by the D2H stream after the copy; waited on by the drain worker
        with torch.profiler.record_function("megatrain::d2h"):
            device_group.add_grads(grads, first)
            group.device_norm_sq = norm_sq(device_group.grad)  # absent grads are zeros
            summed = torch.cuda.Event()  # recorded by the compute stream; waited on by the D2H stream
            summed.record(compute)
            with torch.cuda.stream(self.d2h_stream):
                self.d2h_stream.wait_event(summed)
                group.grad.copy_(device_group.grad, non_blocking=True)
                device_group.grad_read.record(self.d2h_stream)
                done.record(self.d2h_stream)
        self._pending.put(_Drain(index, list(device_group.present), (), None, done))  # never speculated: no hook

    def _drain_worker(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            try:
                item.done.synchronize()
                del item.device  # the D2H has completed: the allocator may reuse the device buffers now
                self._give_back_slot(item)
                group = self.groups[item.index]
                if item.slab is None:
                    group.attach_grads(item.present)
                else:
                    add_packed(group, item.present, item.slab)
                if item.notify is not None:
                    item.notify(item.index)
            except BaseException as e:  # surfaced on the training thread by the next drain/wait_drained
                self._error = e
            finally:
                self._give_back_slot(item)  # a failed copy gives its slot back too
                if item.slab is not None:
                    self._free_slabs.put(item.slab)
                with self._lock:
                    self._in_flight[item.index] -= 1
                self._pending.task_done()

    def _give_back_slot(self, item: _Drain) -> None:
        if item.holds_slot:
            item.holds_slot = False
            self._device_slots.release()

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("MegaTrain gradient drain worker failed") from error

    def take_host_added(self) -> bool:
        """Whether a drain since the last call left host grads to a host add, so some layer's device norm is missing
        (engine/optimizer_step.py, [Note: late grads])."""
        added, self._host_added = self._host_added, False
        return added

    def wait_drained(self) -> None:
        """Block until every drained gradient is in the host fp32 grads (once per optimizer step)."""
        self._pending.join()
        self._raise_worker_error()


    def close(self) -> None:
        """Stop the worker once it has drained everything queued."""
        self._pending.put(None)
        self._worker.join()
