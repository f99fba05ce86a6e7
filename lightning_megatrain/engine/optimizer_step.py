"""The optimizer step: host optimizers, gradient finalization, clipping and the update, in the order they run.

One optimizer step, as :class:`OptimizerStep` runs it (the precision plugin calls each part from its Lightning hook):

- **setup** (engine/optimizer_setup.py): :meth:`~OptimizerStep.to_host_optimizers` swaps Adam/AdamW for the host
  implementation (optim/host_optimizer.py; ``CompactAdamW`` under a compact ``host_state``, optim/compact_update.py;
  Muon stays itself, optim/muon.py) and has ``zero_grad`` wait for the step in flight.
- **end of backward**: :meth:`~OptimizerStep.finalize_gradients` drains the residents and waits for every layer's
  drain, or leaves the last copies landing ([Note: late grads]); once per backward
  (:meth:`~OptimizerStep.backward_starts`).
- **clipping**: :meth:`~OptimizerStep.clip_grad_norm_` finalizes the grads first where nothing has (manual
  optimization clips before ``optimizer.step()``), takes the global norm from the per-layer norms measured on the
  device and scales the flat host grads, or leaves the factor to the update.
- **the finite check**: :meth:`~OptimizerStep.check_finite` decides whether the step updates at all ([Note:
  all-or-nothing steps]).
- **during backward**: :meth:`~OptimizerStep.arm_backward_updates` lets the layers whose grads are final start
  their host update speculatively (engine/backward_updates.py, [Note: updates during backward]).
- **update**: :meth:`~OptimizerStep.run` keeps or undoes the speculated layers, prepares the host update, steps the
  device groups on the compute stream (engine/device_state.py, [Note: device groups]), then the host groups on the
  overlap worker (engine/overlap.py, [Note: overlapped optimizer step]) or at once.
- **after**: the next ``zero_grad`` and backward wait for the host step (:meth:`~OptimizerStep.wait_for_host_step`);
  readers of host parameters wait for the whole step (:meth:`~OptimizerStep.wait_for_optimizer`).

[Note: late grads]
At the end of backward the last layers' grads (and the residents', one ~1.6 GB D2H at 3B) are still on their way
to the host. Waiting for them on the training thread idles the GPU (~0.1 s per step at 3B, 64K tokens/step,
benchmarks/results kernel_gaps) and then the host queues the next forward into an empty GPU. When nothing can read
``p.grad`` before the optimizer step (no ``on_before_optimizer_step`` hook in the module or a callback and no
``configure_gradient_clipping`` of its own: hooks.py, [Note: user hooks]) and the host step is overlapped,
:meth:`OptimizerStep.finalize_gradients` leaves them landing instead:

- the residents' D2H stays in flight on the D2H stream (its event: ``Residents.wait_landed``), a frozen resident's
  host add included (its norm is measured on the device), unless it adds onto host grads that held some already:
  that one lands at once, on the training thread, since only the host can take its norm;
- clipping takes the global norm from the per-layer norms measured on the device and computes the factor there;
  the device groups' step reads it on the device, and one 12-byte D2H into pinned memory (its event
  ``_stats_copied``, recorded by the compute stream) hands it to the host step, with the norm and the loss that
  the finite check reads ([Note: all-or-nothing steps]);
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
(engine/device_state.py). The step's end then has no copy left to wait for (measured: no gap at the step end;
benchmarks/HISTORY.md).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.backward_updates import StepSpeculation, params_of
from lightning_megatrain.engine.grad_norm import clip_coef, device_norm_sq, host_norm_sq
from lightning_megatrain.engine.optimizer_setup import OptimizerSetup
from lightning_megatrain.engine.step_guard import StepGuard
from lightning_megatrain.optim.host_optimizer import Hyper, allocate_states, hyper_snapshot
from lightning_megatrain.optim.updates import Update, device_update, host_update

if TYPE_CHECKING:
    from lightning_megatrain.engine.backward_updates import BackwardUpdates, Speculation
    from lightning_megatrain.engine.device_state import DeviceGroup
    from lightning_megatrain.engine.host_store import FlatGroup
    from lightning_megatrain.engine.overlap import OverlappedStep
    from lightning_megatrain.engine.residents import Residents
    from lightning_megatrain.engine.transfer import Transfer

log = logging.getLogger(__name__)


class OptimizerStep(OptimizerSetup, StepSpeculation):
    """Gradient finalization, clipping and the optimizer update for the engine's groups (see the module docstring);
    the host optimizers' setup and ``zero_grad`` are its base's (engine/optimizer_setup.py).

    Built by :meth:`MegaTrainEngine.setup`, which owns the parts it steps.

    Args:
        config: the engine's options (``overlap_optimizer``, ``cpu_adam``, ``gpu_optimizer_groups``, ``nonfinite``).
        device: the compute device.
        groups: every host flat group, the layers' then the residents' (the order clipping sums the norms in).
        overlap: the worker thread of the host step, when ``overlap_optimizer``.
        transfer: the layers' slots (engine/transfer.py) and gradient drain (engine/drain.py).
        residents: the residents' compute copies and drain (CUDA only).
        backward_updates: the speculative host updates during backward, when ``update_during_backward``.
    """

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        groups: list[FlatGroup],
        overlap: OverlappedStep | None,
        transfer: Transfer,
        residents: Residents | None,
        backward_updates: BackwardUpdates | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.groups = groups
        self.device_groups: list[DeviceGroup] = []  # set_device_groups
        self.overlap = overlap
        self.transfer = transfer
        self.residents = residents
        self.backward_updates = backward_updates
        self._speculation: Speculation | None = None  # this step's, armed and not yet taken by run()
        self._device_param_ids: frozenset[int] = frozenset()  # the host step skips them
        self._deferred_grad_scale: Tensor | None = None  # clipping factor the optimizer step applies
        self._late_grads = False  # this step's host grads are still landing ([Note: late grads])
        self._grads_final = False  # finalize_gradients ran since the last backward started (backward_starts)
        self._norm_sq: Tensor | None = None  # the step's squared global grad norm once measured (device: late grads)
        self._found_inf: Tensor | None = None  # device 0-dim fp32, 1.0 = skip: the device step's flag (late grads)
        self._stats_host: Tensor | None = None  # pinned [3] fp32: clip factor, squared grad norm, loss (late grads)
        self._clip_fired = False  # this step's clipping scales the grads (known on the host: not late grads)
        self._told_blocked = False  # update_during_backward=True was blocked, and the log said why
        self._index = 0  # trainer.global_step of the step being taken, for logs and errors
        self.guard = StepGuard(config.nonfinite)  # skip/raise, failure reports ([Note: all-or-nothing steps])
        # - CUDA event for stream synchronization
        self._stats_copied: torch.cuda.Event | None = None  # recorded by compute after the stats' D2H; worker waits

    def set_device_groups(self, device_groups: list[DeviceGroup]) -> None:
        """The groups that step on the device from now on (engine/device_state.py), in forward order; called once,
        before any step."""
        self.device_groups = device_groups
        self._device_param_ids = frozenset(id(p) for d in device_groups for p in d.group.params)

    # - end of backward: the host grads

    def backward_starts(self) -> None:
        """A backward starts (the precision plugin's ``pre_backward``): its grads are not final until
        :meth:`finalize_gradients`, and the armed step's drains count from here ([Note: updates during backward])."""
        self._grads_final = False
        self.open_backward_updates()

    def finalize_gradients(self, grads_read: bool = True) -> None:
        """Drain the residents and make every host fp32 grad final, or leave the last copies landing for the
        overlapped host step when nothing reads them before it ([Note: late grads]). Once per backward: manual
        optimization clips before ``optimizer.step()`` finalizes, so clipping finalizes first (:meth:`clip_grad_norm_`)
        and the step's own call then keeps the grads, and the clipping factor, as they are. A second drain would send
        a device group's resident grads to the host twice.

        Args:
            grads_read: code may read ``p.grad`` before the optimizer step (hooks, or a step that is not overlapped).
        """
        if not self._grads_final:
            self._grads_final = True
            self._finalize(grads_read)

    def _finalize(self, grads_read: bool) -> None:
        """:meth:`finalize_gradients`' work, once per backward (the sharded step adds the residents' reduction)."""
        self._deferred_grad_scale = self._stats_copied = self._norm_sq = self._found_inf = None
        self._clip_fired = False
        self.wait_for_host_step()  # the residents' drain below writes grads an overlapped step may still read
        host_added = self.transfer.take_host_added()
        # a compact device step reads the factor and the finite decision on the host ([Note: compact device groups])
        compact_device = bool(self.device_groups) and self.config.host_state != "fp32"
        self._late_grads = self.overlap is not None and not grads_read and not host_added and not compact_device
        self._drain_residents()
        if not self._late_grads:
            self.transfer.wait_drained()

    def _drain_residents(self) -> None:
        """The residents' grads into their host grads (CUDA; engine/residents.py), left landing with late grads. The
        sharded step reduces them from the device instead (engine/sharded_step.py)."""
        if self.residents is not None:
            self.residents.drain(wait=not self._late_grads)
            if self._late_grads and self.residents.norm_after_landing:
                # an add onto held host grads leaves no device norm: the late norm reads the host grads (grad_norm.py)
                self.residents.wait_landed()

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
        # manual optimization clips between manual_backward and optimizer.step(): the layers' drains may still be
        # writing the host grads, and the residents' grads are still on the device
        self.finalize_gradients(grads_read=True)
        groups = self.groups
        if self._late_grads and {id(p) for p in params} != {id(p) for g in groups for p in g.params}:
            self._late_grads = False  # torch's clipping may read p.grad below: land them now
            self._land_grads()
        if not self.clips_whole(params):
            self._decide_speculation(self._take_speculation(), keep=False)  # torch's clipping scales the grads used
            return False
        if self._late_grads:  # the factor stays on the device; check_finite sends it to the host step
            self._norm_sq = device_norm_sq(groups, self.device)
            self._deferred_grad_scale = clip_coef(self._norm_sq, max_norm)  # the device step reads it there
            return True
        self._norm_sq = self._host_norm_sq()
        coef = clip_coef(self._norm_sq, max_norm)
        self._clip_fired = coef.item() != 1.0  # host tensors: no device sync
        if self._clip_fired:
            # they assumed no clipping: undone before the grads change
            self._decide_speculation(self._take_speculation(), keep=False)
            # bf16 grads are never scaled in place (a second rounding): the update takes the factor ([Note: compact
            # state in the engine])
            if defer or any(g.grad_dtype != torch.float32 for g in groups):
                self._deferred_grad_scale = coef
            else:
                for g in groups:
                    g.scale_grads(coef)
        return True

    def clips_whole(self, params: list[Tensor]) -> bool:
        """Whether :meth:`clip_grad_norm_` clips ``params`` itself: they are parameters the engine holds grads for,
        and every one holding a grad is among them."""
        held = {id(p) for g in self.groups for p in g.params}
        wanted = {id(p) for p in params}
        return wanted <= held and not any(
            p.grad is not None and id(p) not in wanted for g in self.groups for p in g.params)

    # - the finite check ([Note: all-or-nothing steps])

    def check_finite(self, loss: Tensor | None, index: int) -> bool:
        """Whether step ``index`` (``trainer.global_step``) updates: its ``loss`` (the closure's, if any) and global
        gradient norm are finite. Called after clipping, before :meth:`run`.

        Returns False for a step to skip (``nonfinite="skip"``; logged and counted in ``guard.skipped``). With grads
        landing late the flag stays on the device, read by the device step and by the host step's worker: True here.

        Raises:
            NonFiniteError: ``nonfinite="raise"`` and the loss or norm is inf or NaN (nothing was updated).
        """
        self._index = index
        loss = loss.detach().float().sum() if isinstance(loss, Tensor) else None  # .sum(): a 0-dim loss, NaN kept
        if self._late_grads:
            self._flag_on_device(loss)
            return True
        norm_sq = self._norm_sq if self._norm_sq is not None else self._host_norm_sq()
        # waits for everything queued on the compute stream: the drained layers' backward has finished (their drains
        # were waited for), the device groups' and residents' may not have
        host_loss = None if loss is None else loss.cpu()
        if bool(torch.isfinite(torch.stack([norm_sq] + ([host_loss] if host_loss is not None else []))).all()):
            return True
        self._decide_speculation(self._take_speculation(), keep=False)
        self.guard.nonfinite(index, float(norm_sq), None if host_loss is None else float(host_loss))
        if self.residents is not None:  # the device step that would have consumed a resident device group's grads
            self.residents.clear_grads()
        return False

    def _host_norm_sq(self) -> Tensor:
        """The squared global grad norm on the host (grad_norm.py); the sharded step sums it over ranks."""
        return host_norm_sq(self.groups)

    def _flag_on_device(self, loss: Tensor | None) -> None:
        """The step's non-finite flag on the device for the device step, and the stats it is made of on their way to
        the host step's worker (one 12-byte D2H; [Note: late grads])."""
        norm_sq = self._norm_sq if self._norm_sq is not None else device_norm_sq(self.groups, self.device)
        coef = self._deferred_grad_scale
        stats = torch.stack([  # [3] fp32 on the device
            coef if coef is not None else torch.ones((), device=self.device),
            norm_sq,
            loss.to(self.device) if loss is not None else torch.zeros((), device=self.device),
        ])
        self._found_inf = (~torch.isfinite(stats[1:]).all()).float()  # 0-dim fp32, as fused AdamW takes it
        if self.device.type != "cuda":  # the CPU backend's grads land at once (tests take this path on purpose)
            self._stats_host = stats
            return
        if self._stats_host is None:
            self._stats_host = torch.empty(3, dtype=torch.float32, pin_memory=True)
        self._stats_host.copy_(stats, non_blocking=True)
        self._stats_copied = torch.cuda.Event()
        self._stats_copied.record(torch.cuda.current_stream(self.device))

    # - the update

    def run(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer``'s step with the deferred clipping, all or nothing ([Note: all-or-nothing steps]): the host
        update prepared, the device groups stepped on the compute stream, then the host groups on the overlap worker
        (engine/overlap.py) or now.

        Raises:
            StepFailed: the update failed; the message says whether anything was updated.
        """
        scale, self._deferred_grad_scale = self._deferred_grad_scale, None
        found_inf, self._found_inf = self._found_inf, None
        copied, self._stats_copied = self._stats_copied, None
        index, self.guard.device_stepped = self._index, False
        if self._late_grads:
            assert self.overlap is not None
            self._late_grads = False  # the worker waits for them; zero_grad and backward wait for the worker
            if self.device_groups:  # they step before the worker prepares: allocate the host states it may need now
                self.guard.guarded(index, None, lambda: allocate_states(optimizer, self._host_params(optimizer)))
                self._device_step(optimizer, scale, found_inf, index)
            hyper = hyper_snapshot(optimizer)
            speculation = self._take_speculation()  # the worker decides it
            self.overlap.launch(functools.partial(self._landed_update, optimizer, hyper, copied, index, speculation))
        else:
            kept = self._decide_speculation(self._take_speculation(), keep=not self._clip_fired)
            if self.backward_updates is not None:
                self.backward_updates.clipped_last = self._clip_fired
            skip = self._device_param_ids | params_of(kept)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            with self._undone_on_failure(kept):
                update = host_update(optimizer, scale, skip, None, self.device)
                self.guard.guarded(index, update, lambda: update.prepare([params]))
                if self.device_groups:
                    self._device_step(optimizer, scale, None, index)
            update.started += len(params_of(kept))  # they are updated: a failure from here on tears the step
            if self.overlap is not None:
                self.overlap.launch(lambda: self._committing(update, index))
            else:
                with torch.no_grad():
                    self._committing(update, index)(params)
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what LR schedulers check (optimizer.step ran)

    def _host_params(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        """``optimizer``'s parameters that require grad and are updated on the host (not by a device group)."""
        on_device = self._device_param_ids
        return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and id(p) not in on_device]

    def _device_step(
        self, optimizer: torch.optim.Optimizer, grad_scale: Tensor | None, found_inf: Tensor | None, index: int
    ) -> None:
        """The update of every device group, queued on the compute stream (see [Note: device groups]); the kernel
        skips itself where ``found_inf`` (device) is 1 ([Note: all-or-nothing steps])."""
        assert self.device.type == "cuda"  # device groups exist on CUDA only (the engine's setup checks)
        update = device_update(optimizer, grad_scale, found_inf)
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        compute = torch.cuda.current_stream(self.device)

        def step() -> None:
            for device_group in self.device_groups:
                resident = self.residents is not None and self.residents.device_group is device_group
                grads = self.residents.grads() if resident else device_group.present_grads()
                bind = [g is not None and id(p) in in_optimizer for p, g in zip(device_group.group.params, grads)]
                device_group.bind_states(optimizer, bind)
                compute.wait_event(device_group.written_back)  # the last write-back may still read the mirror
                self.guard.device_stepped = True
                update(device_group.group.params, device_group.group.views(device_group.master), grads)
                device_group.updated()

        with torch.no_grad(), torch.profiler.record_function("megatrain::device_optimizer_step"):
            self.guard.guarded(index, None, step)
        if self.residents is not None:
            self.residents.clear_grads()

    def _landed_update(
        self, optimizer: torch.optim.Optimizer, hyper: Hyper, stats_copied: torch.cuda.Event | None, index: int,
        speculation: Speculation | None = None,
    ) -> Callable[[list[Tensor]], None] | None:
        """Step ``index``'s host update, built on its worker once the grads and the step's stats have landed, after
        ``speculation`` is decided; None for a step skipped as non-finite (the device groups skipped it too, on the
        device)."""
        try:
            self._land_grads()
            assert self._stats_host is not None
            if stats_copied is not None:
                stats_copied.synchronize()
            coef, norm_sq, loss = self._stats_host.tolist()  # a host buffer: no device sync
        except BaseException:  # a failed drain: the step updates nothing, the speculation included
            self._decide_speculation(speculation, keep=False)
            raise
        finite = math.isfinite(norm_sq) and math.isfinite(loss)
        kept = self._decide_speculation(speculation, finite and coef == 1.0, hyper)
        if self.backward_updates is not None:
            self.backward_updates.clipped_last = coef != 1.0
        if not finite:
            self.guard.nonfinite(index, norm_sq, loss)
            return None
        scale = None if coef == 1.0 else torch.tensor(coef, dtype=torch.float32)
        with self._undone_on_failure(kept):
            update = host_update(optimizer, scale, self._device_param_ids | params_of(kept), hyper, self.device)
            self.guard.guarded(index, update, lambda: update.prepare([g.params for g in self.groups]))
        update.started += len(params_of(kept))  # they are updated: a failure from here on tears the step
        return self._committing(update, index)

    def _committing(self, update: Update, index: int) -> Callable[[list[Tensor]], None]:
        """``update``, applied to one group at a time, with failures reported by :meth:`StepGuard.guarded`."""
        return lambda params: self.guard.guarded(index, update, lambda: update(params))

    # - after the update: waits

    def wait_for_optimizer(self) -> None:
        """Block until the optimizer step in flight has updated every host master and optimizer state: the host
        step, and the device groups' masters written back (for readers of host parameters: checkpoints, hooks)."""
        self.wait_for_host_step()
        for device_group in self.device_groups:
            device_group.wait_written_back(self.transfer.d2h_stream)  # device groups exist on CUDA only
