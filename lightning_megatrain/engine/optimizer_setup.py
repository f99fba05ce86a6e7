"""The setup half of the optimizer step (engine/optimizer_step.py): the user's optimizers swapped for the host
implementation, ``zero_grad`` made to wait for the host step in flight, and the paths refused with device groups.

:class:`OptimizerSetup` is the base of :class:`~lightning_megatrain.engine.optimizer_step.OptimizerStep`, which sets
the attributes annotated here.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_megatrain.engine.host_budget import device_steppable
from lightning_megatrain.optim.compact_update import to_compact_adamw
from lightning_megatrain.optim.host_optimizer import rebind_scheduler, to_host_optimizer
from lightning_megatrain.optim.updates import engine_steps

if TYPE_CHECKING:
    from lightning_megatrain.config import EngineConfig
    from lightning_megatrain.engine.device_state import DeviceGroup
    from lightning_megatrain.engine.overlap import OverlappedStep


class OptimizerSetup:
    """The host optimizers and their ``zero_grad``, before and between steps (see the module docstring)."""

    config: EngineConfig  # the engine's options (``overlap_optimizer``, ``cpu_adam``, ``gpu_optimizer_groups``)
    overlap: OverlappedStep | None  # the worker thread of the host step, when ``overlap_optimizer``
    device_groups: list[DeviceGroup]  # the groups that step on the device (engine/device_state.py)

    @property
    def steps_after_return(self) -> bool:
        """Whether host parameters may get the update after :meth:`OptimizerStep.run` returned (the overlap worker
        still runs, or device groups write their masters back when the host reads them): readers wait for
        :meth:`OptimizerStep.wait_for_optimizer`.
        """
        return self.overlap is not None or bool(self.device_groups)

    # - setup

    def to_host_optimizers(
        self, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]
    ) -> list[torch.optim.Optimizer]:
        """``optimizers`` with Adam/AdamW replaced by the host implementation (``cpu_adam``; ``CompactAdamW`` under a
        compact ``host_state``), ``schedulers`` rebound to the replacements, and ``zero_grad`` waiting for the step in
        flight where :attr:`steps_after_return`.

        Raises:
            ValueError: device groups with an optimizer other than the host Adam/AdamW (their step is Adam's); a
                compact ``host_state`` with an optimizer other than Adam/AdamW (optim/compact_update.py).
        """
        replaced = {}
        host_optimizers = []
        # DeepSpeedCPUAdam holds the GIL for each parameter's update, stalling the forward it overlaps with.
        cpu_adam = self.config.cpu_adam
        mode = "torch" if self.overlap is not None and cpu_adam == "auto" else cpu_adam
        host_state = self.config.host_state
        for optimizer in optimizers:
            if host_state == "fp32":
                host = to_host_optimizer(optimizer, mode)
            else:
                host = to_compact_adamw(optimizer, host_state)
            replaced[id(optimizer)] = host
            host_optimizers.append(host)
        if self.device_groups:
            # the device step's Adam: torch's fused kernel, or CompactAdamW's own under a compact host_state
            refused = [type(o).__name__ for o in host_optimizers if not device_steppable(o, host_state)]
            if refused:
                raise ValueError(
                    f"MegaTrainStrategy(gpu_optimizer_groups={self.config.gpu_optimizer_groups}) steps Adam/AdamW on "
                    f"the GPU, got {', '.join(refused)} (or an Adam variant: amsgrad, maximize, capturable, "
                    "differentiable). HINT: use torch.optim.AdamW (a compact host_state runs it as CompactAdamW, "
                    "which device groups step too), or gpu_optimizer_groups=0."
                )
        if self.steps_after_return:
            for optimizer in host_optimizers:
                # in-place zeroing must not race the overlapped step reading the grads; the device groups'
                # grad sums restart too (engine/device_state.py)
                _wait_in_zero_grad(optimizer, self.wait_for_host_step, then=self.grads_zeroed)
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

        Lightning zeroes the module's grads itself before validation (``on_validation_model_zero_grad``, before any hook
        the barrier waits in) and user code may call ``self.zero_grad()``; with grads landing late the host step's
        worker reads ``p.grad`` only once they have landed ([Note: late grads] in engine/optimizer_step.py), so grads
        set to ``None`` before that would silently skip those parameters' update.
        """
        return _wait_in_zero_grad(module, self.wait_for_host_step)

    def takes_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`OptimizerStep.run` runs ``optimizer``'s step (the host Adam/AdamW and Muon: all-or-nothing,
        overlapped and, for Adam/AdamW, split with the device); other optimizers step as given
        (``optimizer.step()``)."""
        return engine_steps(optimizer)

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

    # - what zero_grad waits for, and what it restarts

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


def _wait_in_zero_grad(
    owner: torch.nn.Module | torch.optim.Optimizer, wait: Callable[[], None], then: Callable[[], None] | None = None
) -> Callable[[], None]:
    """Wrap ``owner.zero_grad`` to call ``wait`` before it (and ``then`` after); return the undo."""
    zero_grad = owner.zero_grad

    @functools.wraps(zero_grad)
    def waiting_zero_grad(*args: Any, **kwargs: Any) -> None:
        wait()
        zero_grad(*args, **kwargs)
        if then is not None:
            then()

    owner.zero_grad = waiting_zero_grad  # type: ignore[method-assign]

    def undo() -> None:
        if owner.__dict__.get("zero_grad") is waiting_zero_grad:
            del owner.zero_grad

    return undo
