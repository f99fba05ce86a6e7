"""The optimizer step: host optimizers, gradient finalization, clipping and the update, in the order they run.

One optimizer step, as :class:`OptimizerStep` runs it (the precision plugin calls each part from its Lightning hook):

- **setup**: :meth:`~OptimizerStep.to_host_optimizers` swaps Adam/AdamW for the host implementation
  (optim/host_optimizer.py) and has ``zero_grad`` wait for the step in flight.
- **end of backward**: :meth:`~OptimizerStep.finalize_gradients` drains the residents and waits for every layer's
  drain, or leaves the last copies landing ([Note: late grads]).
- **clipping**: :meth:`~OptimizerStep.clip_grad_norm_` takes the global norm from the per-layer norms measured on the
  device and scales the flat host grads, or leaves the factor to the update.
- **update**: :meth:`~OptimizerStep.run` steps the device groups on the compute stream (engine/device_state.py,
  [Note: device groups]), then the host groups on the overlap worker (engine/overlap.py, [Note: overlapped optimizer
  step]) or at once.
- **after**: the next ``zero_grad`` and backward wait for the host step (:meth:`~OptimizerStep.wait_for_host_step`);
  readers of host parameters wait for the whole step (:meth:`~OptimizerStep.wait_for_optimizer`).

[Note: late grads]
At the end of backward the last layers' grads (and the residents', one ~1.6 GB D2H at 3B) are still on their way
to the host. Waiting for them on the training thread idles the GPU (~0.1 s per step at 3B, 64K tokens/step,
benchmarks/results kernel_gaps) and then the host queues the next forward into an empty GPU. When nothing can read
``p.grad`` before the optimizer step (no ``on_before_optimizer_step`` hook in the module or a callback and no
``configure_gradient_clipping`` of its own: hooks.py, [Note: user hooks]) and the host step is overlapped,
:meth:`OptimizerStep.finalize_gradients` leaves them landing instead:

- the residents' D2H stays in flight on the D2H stream (its event: ``Residents.wait_landed``);
- clipping takes the global norm from the per-layer norms measured on the device and computes the factor there;
  the device groups' step reads it on the device, and one 4-byte D2H into a pinned scalar (its event
  ``_clip_copied``, recorded by the compute stream) hands it to the host step;
- the host step's worker (engine/overlap.py) first waits for every drain and the residents' copy, then for that
  factor, and only then reads ``p.grad``;
- the next ``zero_grad`` and backward wait for the whole host step, as always, so they find the grads landed.

Where a drain left a host add behind (an expert without tokens, a busy layer under accumulation) the device norms
are incomplete and the step waits as before.

Measured (3B, 64K tokens/step, 8 device groups, benchmarks/results kernel_gaps): with the engine's waits gone the
copies still ran at the end of the step, and a read of the loss right after it (``.item()``: a progress bar showing a
logged loss, the benchmark's recorder) queued its 4 bytes behind them on the D2H copy engine and waited as long
(73 + 30 ms). Those copies were the device groups' grads and updated masters, which nothing on the host read: they
now stay on the GPU unless code reads ``p.grad`` before the step, and the masters go to the host when it reads them
(engine/device_state.py). The step's end then has no copy left to wait for (1459861: no gap at the step end).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.optim.host_optimizer import (
    Hyper,
    device_update,
    hyper_snapshot,
    overlappable,
    rebind_scheduler,
    snapshot_update,
    to_host_optimizer,
)

if TYPE_CHECKING:
    from lightning_megatrain.engine.device_state import DeviceGroup
    from lightning_megatrain.engine.host_store import FlatGroup
    from lightning_megatrain.engine.overlap import OverlappedStep
    from lightning_megatrain.engine.residents import Residents
    from lightning_megatrain.engine.transfer import Transfer


class OptimizerStep:
    """Gradient finalization, clipping and the optimizer update for the engine's groups (see the module docstring).

    Built by :meth:`MegaTrainEngine.setup`, which owns the parts it steps.

    Args:
        config: the engine's options (``overlap_optimizer``, ``cpu_adam``, ``gpu_optimizer_groups``).
        device: the compute device.
        groups: every host flat group, the layers' then the residents' (the order clipping sums the norms in).
        overlap: the worker thread of the host step, when ``overlap_optimizer``.
        transfer: the layers' slots (engine/transfer.py) and gradient drain (engine/drain.py).
        residents: the residents' compute copies and drain (CUDA only).
    """

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        groups: list[FlatGroup],
        overlap: OverlappedStep | None,
        transfer: Transfer,
        residents: Residents | None,
    ) -> None:
        self.config = config
        self.device = device
        self.groups = groups
        self.device_groups: list[DeviceGroup] = []  # set_device_groups
        self.overlap = overlap
        self.transfer = transfer
        self.residents = residents
        self._device_param_ids: frozenset[int] = frozenset()  # the host step skips them
        self._deferred_grad_scale: torch.Tensor | None = None  # clipping factor the optimizer step applies
        self._late_grads = False  # this step's host grads are still landing ([Note: late grads])
        self._clip_host: torch.Tensor | None = None  # pinned 0-dim fp32: the device clip factor, for the host step
        # - CUDA event for stream synchronization
        self._clip_copied: torch.cuda.Event | None = None  # recorded by compute after the factor's D2H; host waits

    def set_device_groups(self, device_groups: list[DeviceGroup]) -> None:
        """The groups that step on the device from now on (engine/device_state.py), in forward order; called once,
        before any step."""
        self.device_groups = device_groups
        self._device_param_ids = frozenset(id(p) for d in device_groups for p in d.group.params)

    @property
    def steps_after_return(self) -> bool:
        """Whether host parameters may get the update after :meth:`run` returned (the overlap worker still runs, or
        device groups write their masters back when the host reads them): readers wait for :meth:`wait_for_optimizer`.
        """
        return self.overlap is not None or bool(self.device_groups)

    # - setup

    def to_host_optimizers(
        self, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]
    ) -> list[torch.optim.Optimizer]:
        """``optimizers`` with Adam/AdamW replaced by the host implementation (``cpu_adam``), ``schedulers`` rebound
        to the replacements, and ``zero_grad`` waiting for the step in flight where :attr:`steps_after_return`.

        Raises:
            ValueError: device groups with an optimizer whose step :meth:`run` does not take.
        """
        replaced = {}
        host_optimizers = []
        # DeepSpeedCPUAdam holds the GIL for each parameter's update, stalling the forward it overlaps with.
        cpu_adam = self.config.cpu_adam
        mode = "torch" if self.overlap is not None and cpu_adam == "auto" else cpu_adam
        for optimizer in optimizers:
            host = to_host_optimizer(optimizer, mode)
            replaced[id(optimizer)] = host
            host_optimizers.append(host)
        if self.device_groups:
            refused = [type(o).__name__ for o in host_optimizers if not self.takes_step(o)]
            if refused:
                raise ValueError(
                    f"MegaTrainStrategy(gpu_optimizer_groups={self.config.gpu_optimizer_groups}) steps Adam/AdamW on "
                    f"the GPU, got {', '.join(refused)} (or an Adam variant: amsgrad, maximize, capturable, "
                    "differentiable). HINT: use torch.optim.AdamW, or gpu_optimizer_groups=0."
                )
        if self.steps_after_return:
            for optimizer in host_optimizers:
                self._hook_zero_grad(optimizer)
        if self.overlap is not None:
            for optimizer in host_optimizers:
                if not self.takes_step(optimizer):
                    warnings.warn(
                        f"MegaTrainStrategy(overlap_optimizer=True) overlaps the host Adam/AdamW step only; "
                        f"{type(optimizer).__name__} steps synchronously between steps (amsgrad, maximize, "
                        "capturable and differentiable Adam variants too).",
                        stacklevel=2,
                    )
        for scheduler in schedulers:
            scheduler_optimizer = getattr(scheduler, "optimizer", None)
            host = replaced.get(id(scheduler_optimizer))
            if host is not None and host is not scheduler_optimizer:
                rebind_scheduler(scheduler, host)
        return host_optimizers

    def guard_module_zero_grad(self, module: torch.nn.Module) -> Callable[[], None]:
        """Make ``module.zero_grad()`` wait for the host step first, and return the undo.

        Lightning zeroes the module's grads itself before validation (``on_validation_model_zero_grad``, before any
        hook the barrier waits in) and user code may call ``self.zero_grad()``; with grads landing late the host
        step's worker reads ``p.grad`` only once they have landed ([Note: late grads]), so grads set to ``None``
        before that would silently skip those parameters' update.
        """
        zero_grad = module.zero_grad

        @functools.wraps(zero_grad)
        def waiting_zero_grad(*args: Any, **kwargs: Any) -> None:
            self.wait_for_host_step()
            zero_grad(*args, **kwargs)

        module.zero_grad = waiting_zero_grad  # type: ignore[method-assign]

        def undo() -> None:
            if module.__dict__.get("zero_grad") is waiting_zero_grad:
                del module.zero_grad

        return undo

    def _hook_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """``zero_grad`` (``set_to_none=False`` zeroes in place) must not race the overlapped step reading the grads,
        and clears the device groups' grad sums too (engine/device_state.py)."""
        zero_grad = optimizer.zero_grad

        @functools.wraps(zero_grad)
        def waiting_zero_grad(*args: Any, **kwargs: Any) -> None:
            self.wait_for_host_step()
            zero_grad(*args, **kwargs)
            self.grads_zeroed()

        optimizer.zero_grad = waiting_zero_grad  # type: ignore[method-assign]

    def takes_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`run` runs ``optimizer``'s step (overlapped and/or split with the device)."""
        return self.steps_after_return and overlappable(optimizer)

    def refuse_host_fallback(self, what: str) -> None:
        """Called before a path that reads the host grads and states only (torch's clipping, ``optimizer.step()``):
        those do not see the grads and states that device groups keep on the GPU.

        Raises:
            RuntimeError: the engine has device groups.
        """
        if self.device_groups:
            raise RuntimeError(
                f"MegaTrainStrategy(gpu_optimizer_groups={len(self.device_groups)}) does not support {what}: those "
                "groups' gradients and Adam states live on the GPU. HINT: use gpu_optimizer_groups=0."
            )

    # - end of backward: the host grads

    def finalize_gradients(self, grads_read: bool = True) -> None:
        """Drain the residents and make every host fp32 grad final, or leave the last copies landing for the
        overlapped host step when nothing reads them before it ([Note: late grads]).

        Args:
            grads_read: code may read ``p.grad`` before the optimizer step (hooks, or a step that is not overlapped).
        """
        self._deferred_grad_scale = self._clip_copied = None
        self.wait_for_host_step()  # the residents' drain below writes grads an overlapped step may still read
        host_added = self.transfer.take_host_added()
        self._late_grads = self.overlap is not None and not grads_read and not host_added
        if self.residents is not None:
            self.residents.drain(wait=not self._late_grads)
        if not self._late_grads:
            self.transfer.wait_drained()

    def _land_grads(self) -> None:
        """Wait for the host grads left landing by :meth:`finalize_gradients` (any thread; no-op when none)."""
        self.transfer.wait_drained()
        if self.residents is not None:
            self.residents.wait_landed()

    # - clipping

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float, defer: bool = False) -> bool:
        """Clip the host grads of ``params`` to a global L2 norm of ``max_norm``, as ``clip_grad_norm_`` does.

        The norm comes from the per-layer norms taken on the device during backward (a host pass only where those
        are not valid); the scaling is one vectorized pass per flat grad buffer, or, with ``defer`` (the optimizer
        step will be overlapped), left to the overlapped step, group by group. Returns False (nothing done) when
        ``params`` is not exactly the set of parameters the engine holds grads for, so the caller falls back to
        torch.
        """
        groups = self.groups
        held = {id(p) for g in groups for p in g.params}
        wanted = {id(p) for p in params}
        if self._late_grads and wanted != held:
            self._late_grads = False  # torch's clipping may read p.grad below: land them now
            self._land_grads()
        if not wanted <= held or any(p.grad is not None and id(p) not in wanted for g in groups for p in g.params):
            return False
        if self._late_grads:
            self._clip_on_device(groups, max_norm)
            return True
        partial = [g.grad_norm_sq() for g in groups]  # device norms from backward where valid, else host passes
        on_device = [n for n in partial if n.device.type != "cpu"]
        on_host = [n for n in partial if n.device.type == "cpu"]
        if on_device:  # one small D2H at the step boundary, where the host waits anyway
            on_host.append(torch.stack(on_device).sum().cpu())
        total = torch.stack(on_host).sum().sqrt()
        # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total + 1e-6), clamped to 1 (a no-op multiply we skip)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if coef.item() != 1.0:  # host tensors: no device sync
            if defer:
                self._deferred_grad_scale = coef
            else:
                for g in groups:
                    g.scale_grads(coef)
        return True

    def _clip_on_device(self, groups: list[FlatGroup], max_norm: float) -> None:
        """The clipping factor from the device norms, left on the device with a copy on its way to the host.

        Grads still landing have their norm measured on the device (a group with a host add makes the grads wait,
        :meth:`finalize_gradients`); a group without one has no grads this step, or grads final on the host (the
        residents' host add). See [Note: late grads].
        """
        device_sq = [g.device_norm_sq for g in groups if g.device_norm_sq is not None]
        host_sq = [g.grad_norm_sq() for g in groups if g.device_norm_sq is None]  # zeros where there are no grads
        total_sq = torch.stack(device_sq).sum() if device_sq else torch.zeros((), device=self.device)
        total = (total_sq + float(torch.stack(host_sq).sum()) if host_sq else total_sq).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch.nn.utils.clip_grad_norm_, on the device
        self._deferred_grad_scale = coef  # the device step reads it there
        if self._clip_host is None:
            self._clip_host = torch.empty((), dtype=torch.float32, pin_memory=True)
        self._clip_host.copy_(coef, non_blocking=True)
        self._clip_copied = torch.cuda.Event()
        self._clip_copied.record(torch.cuda.current_stream(self.device))

    # - the update

    def run(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer``'s step with the deferred clipping: device groups on the compute stream now, the host
        groups on the overlap worker (engine/overlap.py) or now."""
        scale, self._deferred_grad_scale = self._deferred_grad_scale, None
        if self.device_groups:
            self._device_step(optimizer, scale)
        copied, self._clip_copied = self._clip_copied, None
        if self._late_grads:
            assert self.overlap is not None
            self._late_grads = False  # the worker waits for them; zero_grad and backward wait for the worker
            self.overlap.launch(functools.partial(self._landed_update, optimizer, hyper_snapshot(optimizer), copied))
        else:
            update = snapshot_update(optimizer, scale, skip=self._device_param_ids)
            assert update is not None
            if self.overlap is not None:
                self.overlap.launch(lambda: update)
            else:
                with torch.no_grad():
                    update([p for group in optimizer.param_groups for p in group["params"]])
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what LR schedulers check (optimizer.step ran)

    def _device_step(self, optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None) -> None:
        """The update of every device group, queued on the compute stream (see [Note: device groups])."""
        assert self.device.type == "cuda"  # device groups exist on CUDA only (the engine's setup checks)
        update = device_update(optimizer, grad_scale)
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        compute = torch.cuda.current_stream(self.device)
        with torch.no_grad(), torch.profiler.record_function("megatrain::device_optimizer_step"):
            for device_group in self.device_groups:
                resident = self.residents is not None and self.residents.device_group is device_group
                grads = self.residents.grads() if resident else device_group.present_grads()
                bind = [g is not None and id(p) in in_optimizer for p, g in zip(device_group.group.params, grads)]
                device_group.bind_states(optimizer, bind)
                compute.wait_event(device_group.written_back)  # the last write-back may still read the mirror
                update(device_group.group.params, device_group.group.views(device_group.master), grads)
                device_group.updated()
        if self.residents is not None:
            self.residents.clear_grads()

    def _landed_update(
        self, optimizer: torch.optim.Optimizer, hyper: Hyper, clip_copied: torch.cuda.Event | None
    ) -> Callable[[list[torch.Tensor]], None]:
        """The host step's update, built on its worker once the grads and the clipping factor have landed."""
        self._land_grads()
        scale = None
        if clip_copied is not None:
            assert self._clip_host is not None
            clip_copied.synchronize()
            if self._clip_host.item() != 1.0:  # a pinned host scalar: no device sync
                scale = self._clip_host.clone()
        update = snapshot_update(optimizer, scale, skip=self._device_param_ids, snapshot=hyper)
        assert update is not None
        return update

    # - after the update: waits

    def wait_for_host_step(self) -> None:
        """Block until the overlapped host optimizer step is done with the host grads and the host groups' masters.

        What backward's drains, ``zero_grad`` and gradient finalization wait for: they write host grads, which only
        the host step reads (device groups step from their device grads).
        """
        if self.overlap is not None:
            self.overlap.wait_all()

    def grads_zeroed(self) -> None:
        """``optimizer.zero_grad()`` ran: the device groups' next grads start a new sum."""
        for device_group in self.device_groups:
            device_group.clear_grads()

    def wait_for_optimizer(self) -> None:
        """Block until the optimizer step in flight has updated every host master and optimizer state: the host
        step, and the device groups' masters written back (for readers of host parameters: checkpoints, hooks)."""
        self.wait_for_host_step()
        for device_group in self.device_groups:
            device_group.wait_written_back(self.transfer.d2h_stream)  # device groups exist on CUDA only
