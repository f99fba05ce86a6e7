"""Residents: parameters and buffers outside the layer stack, used on the compute device as ordinary autograd leaves.

On a CUDA compute device the residents' fp32 masters are uploaded as *compute copies* (leaf tensors that require
grad) when a step first needs them, bound into the module for the duration of each ``*_step`` call, and take part
in the normal autograd graph. Their grads are drained into the host fp32 grads once per optimizer step
(:meth:`Residents.drain`, one D2H on the D2H stream, waited for at once or later: [Note: late grads] in
engine/optimizer_step.py; several ranks reduce-scatter them from the device instead: engine/sharded_step.py), and
the copies are refreshed after the optimizer changed the masters
(:meth:`Residents.invalidate`). When the residents are a device group (engine/device_state.py) the copies are views
of its mirror, updated in place on the device, and their grads stay for the device step until
:meth:`Residents.clear_grads`. Tied weights are one master, one compute copy and one grad. On the CPU backend the
masters are the compute tensors: nothing is bound, and autograd writes ``p.grad`` directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from lightning_megatrain.engine.device_state import DeviceGroup
from lightning_megatrain.engine.discovery import TensorSlot
from lightning_megatrain.engine.drain import add_packed
from lightning_megatrain.engine.grad_norm import norm_sq
from lightning_megatrain.engine.host_store import FlatGroup
from lightning_megatrain.engine.pinned import HostRegistry
from lightning_megatrain.engine.streamed import bind


class Residents:
    """GPU compute copies of the residents (see module docstring)."""

    def __init__(
        self,
        group: FlatGroup,
        buffer_slots: list[TensorSlot],
        device: torch.device,
        registry: HostRegistry,
        d2h_stream: torch.cuda.Stream,
        gate: Callable[[FlatGroup], None] | None = None,
    ) -> None:
        self.group = group
        self.d2h_stream = d2h_stream  # the transfer layer's: the grads' D2H queues behind the layers' drains
        self.gate = gate
        self.device_group: DeviceGroup | None = None  # set_device_group: the residents step on the device
        self.buffer_slots = buffer_slots
        self.device = device
        # one device leaf per unique parameter in the masters' dtype (fp32, or bf16 for a compact host_state), or None
        # when stale
        self._copies: list[Tensor] | None = None
        self._buffers = [(slot, slot.get().to(device)) for slot in buffer_slots]
        self._registry = registry
        # pinned landing buffer for grads that must be *added* to host grads (some resident without a grad, or host
        # grads already holding some); allocated on first need. Written only by a drain's D2H copy and read only by
        # the host add in :meth:`wait_landed`; a drain lands the previous one first, so one add at most is pending
        self._grad_staging: Tensor | None = None
        # whether a device group's grads are copied to the host grads (engine.set_grads_read); others always are
        self.grads_to_host = True
        # the presence mask of the grads waiting in ``_grad_staging`` for :meth:`wait_landed`'s host add; None when
        # the copy in flight went straight into the host grads (or none is in flight)
        self._add_mask: list[bool] | None = None
        # - CUDA event for stream synchronization
        # recorded by the D2H stream after the grads' copy (into the host grads or the staging buffer); waited on by
        # the thread that lands them (:meth:`wait_landed`: the training thread, or the overlapped step's worker)
        self._landed: torch.cuda.Event | None = None

    def set_device_group(self, device_group: DeviceGroup | None) -> None:
        """The residents became a device group (engine/device_state.py): their compute copies are views of its
        mirror from the next step on. Called once, before any training step."""
        self.device_group = device_group
        self._copies = None  # copies uploaded before (validation) are not views of the mirror

    def _upload(self) -> list[Tensor]:
        if self.device_group is not None:
            flat = self.device_group.master  # [numel] as the masters, always current on the device: views, no upload
        else:
            if self.gate is not None:
                self.gate(self.group)  # an overlapped optimizer step may still be updating these masters
            flat = self.group.master.to(self.device, non_blocking=True)  # [numel] as the masters, from pinned memory
        return [v.detach().requires_grad_(p.requires_grad) for v, p in zip(self.group.views(flat), self.group.params)]

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """Bind the compute copies into the module for one ``*_step`` call."""
        if self._copies is None:
            self._copies = self._upload()
        bindings = [(slot, self._copies[k]) for slot, k in self.group.slot_index] + self._buffers
        with bind(bindings):
            yield

    def drain(self, wait: bool = True) -> None:
        """Add the compute copies' grads into the host fp32 grads and clear them (once per optimizer step); a device
        group's grads only get their norm when no code reads them before the step (``grads_to_host`` False).

        One D2H on the D2H stream, behind the layers' drains: straight into the pinned host grads when every
        parameter has a gradient and the host grads are empty, else into the pinned staging buffer, which
        :meth:`wait_landed` then adds into the host grads (a frozen embedding, an unused vision tower). The host never
        waits for the device here: ``wait=False`` leaves the copy in flight for :meth:`wait_landed` (whose caller
        owns the host side from then on), ``wait=True`` lands it before returning.
        """
        if self._copies is None or not self.group.numel:
            return
        grads = [c.grad for c in self._copies]
        if all(g is None for g in grads):
            return
        if self.device_group is not None and not self.grads_to_host:  # the device step reads the grads in place
            flats = [g.reshape(-1) for g in grads if g is not None]
            self.group.device_norm_sq = torch.stack([norm_sq(g) for g in flats]).sum()
            return
        # A drain no optimizer step landed (an exception between them, a drain without a step) lands first: its
        # grads are host grads the new ones add to, and its host add reads the staging buffer this copy may write.
        # In the training loop none is left: the step lands each drain, and gradient finalization waits for the step.
        self.wait_landed()
        compute = torch.cuda.current_stream(self.device)
        mask = [g is not None for g in grads]
        # [n_present] as the masters, on the compute stream; never empty (some grad is present), though a zero-numel
        # parameter's grad adds nothing to it
        present = torch.cat([g.reshape(-1) for g in grads if g is not None])
        host_empty = all(p.grad is None for p in self.group.params)
        # one copy into the host grads when they start empty and every grad is present
        exact = all(mask) and host_empty
        # into empty host grads the host add is a copy too: the device norm of ``present`` is theirs, and clipping
        # (the late norm included) reads it without waiting; an add onto held grads leaves it to a host pass
        self.group.device_norm_sq = norm_sq(present) if host_empty else None
        if exact:
            target = self.group.grad  # one D2H straight into the pinned host grads: no staging buffer, no host pass
        else:
            if self._grad_staging is None:
                self._grad_staging = self._registry.empty(self.group.numel, self.group.grad_dtype)
            target = self._grad_staging[: present.numel()]
        packed = torch.cuda.Event()  # recorded by the compute stream after ``present``; waited on by the D2H stream
        packed.record(compute)
        landed = torch.cuda.Event()  # recorded by the D2H stream after the copy; waited on in wait_landed
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(packed)
            target.copy_(present, non_blocking=True)
            landed.record(self.d2h_stream)
        present.record_stream(self.d2h_stream)  # the allocator reuses the block only after the copy
        self._landed, self._add_mask = landed, None if exact else mask
        self._after_drain()  # the copy reads ``present``, not the grads: they may be cleared or stepped meanwhile
        if wait:
            self.wait_landed()

    @property
    def norm_after_landing(self) -> bool:
        """Whether grads are in flight whose norm only the host can take once they landed: an add onto host grads
        that held some already (``device_norm_sq`` is None)."""
        return self._landed is not None and self.group.device_norm_sq is None

    def wait_landed(self) -> None:
        """Block until the grads :meth:`drain` sent have landed, then put them in the host grads: attach them as
        ``p.grad`` (a copy straight into the host grads) or add the staging buffer into them. A no-op when none are
        in flight. Called by the thread that reads them next (never two at once: the training thread waits for the
        overlapped step's worker before it drains again)."""
        landed, mask = self._landed, self._add_mask
        if landed is None:
            return
        # taken first: a failure below (a CUDA error) drops these grads, and never adds them twice
        self._landed = self._add_mask = None
        landed.synchronize()
        if mask is None:
            self.group.attach_grads()
            return
        assert self._grad_staging is not None
        add_packed(self.group, mask, self._grad_staging)  # the D2H wrote the staging buffer: host-side add, no copy

    def _after_drain(self) -> None:
        if self.device_group is None:
            self.clear_grads()  # a device group's step reads them first

    def grads(self) -> list[Tensor | None]:
        """The compute copies' grads (device), one per parameter: what a device-group step reads."""
        return [None] * len(self.group.params) if self._copies is None else [c.grad for c in self._copies]

    def clear_grads(self) -> None:
        for c in self._copies or ():
            c.grad = None

    def invalidate(self) -> None:
        """The optimizer changed the masters: upload fresh compute copies before the next step."""
        if self.device_group is None:
            self._copies = None
