"""Device groups: parameter groups whose master, grad and Adam states are mirrored on the GPU.

[Note: device groups]
The host Adam step moves 28 bytes per parameter through host memory (reads master, grad and both moments, writes
master and moments): 0.73 s for 3.2B parameters on the lent H200's 16 cores, longer than one 32K-token forward
(0.56 s), so even the overlapped step holds the next forward back, and it runs slower beside the forward's H2D
traffic (benchmarks/results/2026-11-29-llama-3.2-3b-h200.json). A *device group* trades GPU memory for that host
work: the first groups the forward reads (the residents, then layers 0, 1, ...) keep a device mirror of their fp32
master, their fp32 grad and both Adam moments, and take their optimizer step on the GPU with torch's fused AdamW
kernel (the same update the host fused path runs, to fp32 rounding; a compact host state is mirrored in its own
formats, [Note: compact device groups]). Their weights cross PCIe only as grads (when
code reads the host grads) and as the updated master written back (when the host reads parameters).

The host master stays the parameter (DESIGN principle 1), brought up to date where the host reads it: every
reader of host parameters between steps already waits for the optimizer (``wait_for_optimizer``: checkpoints,
``state_dict()``, the barrier hooks, teardown), and that wait first has the D2H stream write the mirror back
(:meth:`DeviceGroup.flush`). Writing it back after every step instead cost 0.4 GB of D2H per 3B-model layer per
step that nothing read, and a loss read at the step's end waited behind it (engine/optimizer_step.py, [Note: late
grads]).
Likewise the layer's fp32 grad reaches the host grads only when code may read ``p.grad`` before the step (hooks,
manual optimization: the engine's ``set_grads_read``); otherwise the device step and clipping read the device sum
and the host ``p.grad`` of these parameters stays ``None``. With hooks, ``state_dict()``, checkpoints, clipping and
hooks read the same tensors as without device groups. The optimizer's state entries for
these parameters are the device moments (``optimizer.state[p]`` holds views of them); checkpoints write them from
the GPU a piece at a time, and a resume reads them from the mapped checkpoint straight into the device moments once
the groups are placed (:func:`settle_states`; [Note: mapped checkpoint tensors] in mapped.py); states a host
optimizer wrote are copied in at the next step (:meth:`DeviceGroup.bind_states`).
Parameters written directly on the host between steps (not through ``load_state_dict``) are not seen by the mirror.

[Note: device states at teardown]
Lightning's ``Strategy.teardown`` copies every optimizer state to the host, to give the GPU back after fit. The
device groups' moments are there because the host could not hold them: 57 GiB for the 24 groups of the Llama-2-13B
shape on the lent H200, with 7.6 GiB of its host free at the end of fit, where that copy took the host to its last
GiB (benchmarks/results/2026-12-03-memory-pool-llama-2-13b-h200-*). So the strategy's teardown hides them from that copy
where they exceed the host memory still free (:func:`device_states_kept`); they stay on the GPU, as ``optimizer.state``
entries, until the optimizer goes. Where the host can take them, Lightning moves them as it moves any strategy's.

Streams and events (all of a device group's own kernels run on the compute stream, so they are ordered among
themselves and with the layer's forward and backward):

- ``grad_read``: recorded by the D2H stream after copying ``grad`` to the host grads; the compute stream waits on
  it before the next micro-batch's backward writes ``grad`` again.
- ``written_back``: recorded by the D2H stream after a :meth:`DeviceGroup.flush` copied the updated ``master`` to
  the host master; the compute stream waits on it before the next update writes ``master``, and host readers
  synchronize on it (:meth:`DeviceGroup.wait_written_back`, from the engine's ``wait_for_optimizer``, which
  checkpoints, barrier hooks and teardown call; backward, ``zero_grad`` and gradient finalization touch grads only
  and skip it).

GPU memory (fp32 host state): 18 bytes per layer parameter (mirror, grad, two moments and a compute-dtype copy under
bf16), 8 per resident parameter (their fp32 compute copies are the mirror, their grads exist anyway: the moments
only). Host memory saves the 8 bytes/param of moments and, where no code reads ``p.grad`` before the step, the 4 of
the grad: the host keeps the 4-byte master only, which is what lets ``gpu_optimizer_groups="auto"`` split a model's
state between both memories (planner/pool.py, [Note: memory pool]). :func:`gpu_bytes_per_param` is the one home of
these numbers.

[Note: compact device groups]
Under a compact ``host_state`` (optim/compact_adam.py, [Note: compact host state]) a device group holds the host layout
itself on the GPU: the mirror in the master's dtype (bf16 for ``compact``: the compute copy too), the grad sum in the
host grads' dtype (added with one rounding per micro-batch, as the host drain adds), and CompactAdamW's entries (8-bit
moments, block scales, Kahan compensation) as ``optimizer.state[p]``, the step count on the CPU as the host optimizer
keeps it. The update is CompactAdamW's own (``CompactAdamW.update_param`` on the mirror, the same stochastic-rounding
stream: optim/compact_update.py, ``compact_device_update``), so a checkpoint holds the same entries whichever memory
stepped a parameter, and resumes into either. For ``compact`` that is 6.03 bytes per layer parameter on the GPU, 2.03
per resident one, and the host keeps the 2-byte bf16 master only: the two memories hold one state, not two copies of it.
That update reads the step count, the clipping factor and the finite decision on the host, so with compact device
groups the grads never land late ([Note: late grads] in engine/optimizer_step.py): the step waits for the norm, a
sync per optimizer step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_megatrain._hardware import GIB
from lightning_megatrain.engine.host_store import FlatGroup
from lightning_megatrain.mapped import copy_released, owned
from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS, new_state

log = logging.getLogger(__name__)


def gpu_bytes_per_param(compute_itemsize: int, resident: bool, host_state: str = "fp32") -> float:
    """GPU memory a device group adds per parameter (see the module note and [Note: compact device groups]): a
    layer's mirror, grad and moments in the ``host_state`` layout's formats plus, where the compute dtype is narrower
    than the mirror, a compute-dtype copy; the residents' moments (and Kahan compensation) only, since their compute
    copies and grads exist without device groups. ``fp32``: 18 per layer parameter under bf16, 8 per resident one;
    ``compact``: 6.03 and 2.03."""
    layout = HOST_STATE_LAYOUTS[host_state]
    parts = layout.bytes_per_param()
    compensation = parts["weights"] - layout.weight_dtype.itemsize
    if resident:
        return parts["optimizer states"] + compensation
    copy = compute_itemsize if compute_itemsize < layout.weight_dtype.itemsize else 0
    return sum(parts.values()) + copy


class DeviceGroup:
    """The device mirror of one :class:`FlatGroup` and its Adam states (see [Note: device groups])."""

    def __init__(
        self, group: FlatGroup, device: torch.device, compute_dtype: torch.dtype, own_grad: bool = True,
        host_state: str = "fp32",
    ) -> None:
        self.group = group
        self.device = device
        layout = HOST_STATE_LAYOUTS[host_state]
        n = group.numel
        # [numel] the mirror of group.master, in its dtype (fp32, or bf16 under a compact host_state)
        self.master = torch.empty(n, dtype=group.master.dtype, device=device)
        # [numel] the weights forward and backward read: the mirror itself where the dtypes agree, else a cast
        # refreshed per step
        self.compute = (
            self.master if compute_dtype == self.master.dtype else torch.empty(n, dtype=compute_dtype, device=device)
        )
        # [numel] the sum over micro-batches in the host grads' dtype; None for the residents, whose autograd leaves
        # hold their grads
        self.grad = torch.empty(n, dtype=group.grad_dtype, device=device) if own_grad else None
        self.present = [False] * len(group.params)  # which parameters have a gradient in ``grad`` since zero_grad
        # each parameter's optimizer state on the device: views of two flat fp32 moments and a device step count
        # (torch's fused AdamW), or CompactAdamW's entries ([Note: compact device groups])
        self.states: list[dict[str, Tensor]]
        if layout.moments == "fp32" and layout.weights == "fp32":
            exp_avg = torch.zeros(n, dtype=torch.float32, device=device)  # [numel]
            exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=device)  # [numel]
            self.states = [
                {"step": torch.zeros((), dtype=torch.float32, device=device), "exp_avg": m, "exp_avg_sq": v}
                for m, v in zip(group.views(exp_avg), group.views(exp_avg_sq))
            ]
        else:
            self.states = [new_state(w, layout.weights, layout.moments) for w in group.views(self.master)]
        # - CUDA events for stream synchronization (see the module note)
        self.grad_read = torch.cuda.Event()  # recorded by D2H after reading ``grad``; waited on by compute
        self.written_back = torch.cuda.Event()  # recorded by D2H after reading ``master``; waited on by compute, host
        self.host_stale = False  # the mirror holds an update the host master has not received yet (flush)
        self.upload()

    def upload(self) -> None:
        """Copy the host master into the mirror (setup, ``load_state_dict``): blocks, never in the hot path."""
        self.master.copy_(self.group.master)
        self.host_stale = False
        self._refresh()
        torch.cuda.current_stream(self.device).synchronize()

    def _refresh(self) -> None:
        if self.compute is not self.master:
            self.compute.copy_(self.master)

    def add_grads(self, grads: list[Tensor | None], first: bool) -> None:
        """Add one micro-batch's weight grads (device, compute dtype) into ``grad`` on the compute stream.

        ``first``: no gradient arrived since ``zero_grad``, so the grads are copied, not added (no zeroing pass).
        """
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.grad_read)  # the previous micro-batch's D2H may still read ``grad``
        if first:
            self.present = [False] * len(grads)
        if first and all(g is not None for g in grads):
            torch.cat([g.reshape(-1) for g in grads], out=self.grad)  # grad dtype <- compute dtype, one kernel
        else:
            if first:
                self.grad.zero_()  # absent grads read as zeros in the layer's norm
            for k, (view, g) in enumerate(zip(self.group.views(self.grad), grads)):
                if g is None:
                    continue
                if self.present[k]:
                    view.add_(g)
                else:
                    view.copy_(g)
        self.present = [p or g is not None for p, g in zip(self.present, grads)]

    def present_grads(self) -> list[Tensor | None]:
        """``grad`` as one view per parameter, ``None`` where no micro-batch produced a gradient."""
        return [v if ok else None for v, ok in zip(self.group.views(self.grad), self.present)]

    def bind_states(self, optimizer: torch.optim.Optimizer, which: list[bool]) -> None:
        """Make ``optimizer.state[p]`` hold this group's device states for the parameters flagged in ``which`` (those
        about to be updated), copying in states loaded from a checkpoint or left by the host optimizer."""
        for p, ours, bind in zip(self.group.params, self.states, which):
            if not bind:
                continue
            state = optimizer.state[p]
            bound = state.get("exp_avg")
            mine = ours["exp_avg"]
            if bound is not None and bound.device == mine.device and bound.data_ptr() == mine.data_ptr():
                continue
            if state:  # loaded from a checkpoint (mapped: read straight in) or written by a host optimizer
                for key, tensor in ours.items():
                    if key == "step":
                        tensor.fill_(float(state["step"]))
                    else:
                        copy_released(state[key], tensor)
            state.update(ours)

    def clear_grads(self) -> None:
        """``zero_grad``: the next micro-batch's grads replace ``grad`` instead of adding to it."""
        self.present = [False] * len(self.present)

    def updated(self) -> None:
        """The update ran on the compute stream: refresh the compute copy; the host master is stale until
        :meth:`flush`."""
        self._refresh()
        self.host_stale = True

    def flush(self, d2h_stream: torch.cuda.Stream) -> None:
        """Queue the copy of the updated mirror into the host master (a no-op when the host holds it already)."""
        if not self.host_stale:
            return
        updated = torch.cuda.Event()  # recorded by the compute stream after the update; waited on by the D2H stream
        updated.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(d2h_stream):
            d2h_stream.wait_event(updated)
            self.group.master.copy_(self.master, non_blocking=True)
            self.written_back.record(d2h_stream)
        self.host_stale = False

    def wait_written_back(self, d2h_stream: torch.cuda.Stream) -> None:
        """Bring the host master up to date with the last update and block until it is."""
        self.flush(d2h_stream)
        self.written_back.synchronize()


def settle_states(optimizer: torch.optim.Optimizer, device_groups: list[DeviceGroup]) -> None:
    """Put the optimizer states loaded from a checkpoint where they live: a device group's straight into its GPU
    moments (:meth:`DeviceGroup.bind_states`), every other parameter's mapped tensors into host memory of their own
    (``mapped.owned``); see [Note: mapped checkpoint tensors] in mapped.py."""
    on_device = set()
    for device_group in device_groups:
        device_group.bind_states(optimizer, [bool(optimizer.state.get(p)) for p in device_group.group.params])
        on_device.update(id(p) for p in device_group.group.params)
    for p, state in list(optimizer.state.items()):
        if id(p) not in on_device:
            optimizer.state[p] = owned(state)


@contextlib.contextmanager
def device_states_kept(optimizers: list[torch.optim.Optimizer], host_free: int | None,
                       announce: bool = True) -> Iterator[None]:
    """Hide the optimizer states held outside host memory from the code inside when they exceed ``host_free`` (the
    bytes the host may still take; None: unknown), so that they stay on the GPU ([Note: device states at
    teardown]); put back on exit. ``announce``: log it (once per fit, not again at a later stage's teardown)."""
    held = [(optimizer.state, p, entry) for optimizer in optimizers for p, entry in optimizer.state.items()
            if any(_off_host(k, v) for k, v in entry.items())]
    nbytes = sum(v.nbytes for _, _, entry in held for k, v in entry.items() if _off_host(k, v))
    if not held or host_free is None or nbytes <= host_free:
        yield
        return
    if announce:
        log.info("MegaTrain: the optimizer states of the device groups (%.1f GiB) stay on the GPU after fit: the "
                 "host has %.1f GiB free for them. They are freed with the optimizer.", nbytes / GIB,
                 host_free / GIB)
    for states, p, _ in held:
        del states[p]
    try:
        yield
    finally:
        for states, p, entry in held:
            states[p] = entry


def _off_host(key: str, value: object) -> bool:
    # ``step`` aside: Lightning's teardown leaves it where it is
    return key != "step" and isinstance(value, Tensor) and value.device.type != "cpu"
