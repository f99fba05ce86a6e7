"""Whether an optimizer step updates, and what a failed one leaves: the non-finite check's decision and the update's
failure reports (:class:`StepGuard`, used by engine/optimizer_step.py).

[Note: all-or-nothing steps]
A step updates every master, Adam state and step count, or none.

*Non-finite steps.* :meth:`OptimizerStep.check_finite` runs after clipping, before the update: the loss and the
global gradient norm must be finite, else the step is skipped (``nonfinite="skip"``: logged with its index and
counted in :attr:`StepGuard.skipped`) or an error is raised (``"raise"``). The norm is clipping's (computed once
when both run), from the per-layer squared norms the drains take on the device (engine/drain.py), with a host pass
only where a drain added on the host, as for clipping. Without clipping that sum is the check's whole cost on a GPU:
a few scalar kernels. On the CPU backend the grads have no device norm: the check reads them once, 4 bytes per
parameter against the update's 28 (23 ms per 20M parameters on 2 cores, a third of the fused AdamW step). Where the
decision is read:

- grads final before the step (no overlap, a hook reads ``p.grad``, or a drain added on the host): on the training
  thread, which has just waited for every drain; the device norms' sum and the loss come over in a few bytes of
  D2H. A skipped step then runs nothing, device groups included.
- grads landing late ([Note: late grads]): the device computes the flag. The device groups' fused AdamW reads it
  as ``found_inf`` when it runs (the kernel then leaves parameters, moments and step counts as they were); the
  host step's worker reads the norm and the loss from the pinned copy it already waited for, and skips or raises
  there. The training thread never waits for it; the error, with ``"raise"``, surfaces at the next wait (the next
  forward's first upload).

Lightning's ``global_step`` and the LR scheduler advance on a skipped step, as on AMP's skipped steps.

*Failures.* :meth:`HostUpdate.prepare <lightning_megatrain.optim.host_optimizer.HostUpdate.prepare>` runs over every
group before the first is updated: it allocates the Adam states of a first update (8 bytes per parameter, the
allocation that fails when host RAM runs out) and checks every gradient and state the kernel reads: dense, of the
parameter's shape, dtype and device (torch's CPU fused AdamW does not check a state's size: it writes past a short
one). About 10 us per parameter tensor, on the thread that prepares. A failure there removes the states it created
and the error says that nothing was updated. With late grads and device groups the device step is queued before the
worker prepares, so the host states are allocated on the training thread first, for every host parameter of the
optimizer that requires grad (one with no grad yet gets a zero state with step 0, a difference from torch only in
what a checkpoint lists). After the prepare only the kernels run, in place, on tensors checked to suit them.

Rolling back a group already updated would need its master and both moments as they were: 12 bytes per parameter
kept until the last group is done, 75% more host state than the 16 the strategy needs, plus one more pass over it
per step. That is not paid. A kernel failing after the prepare (a crash-class fault, or a ``KeyboardInterrupt``
between two groups of a step that is not overlapped) leaves the step *torn*: the error says how many parameters
were updated, and checkpoints of the mixed state are refused (:meth:`StepGuard.refuse_torn`) so that none is
written; resume from the last checkpoint.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_megatrain.config import NonFiniteMode

if TYPE_CHECKING:
    from lightning_megatrain.optim.host_optimizer import HostUpdate

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """``nonfinite="raise"``: an optimizer step's loss or gradient norm is inf or NaN; nothing was updated."""


class StepFailed(RuntimeError):
    """The optimizer update raised; the message says whether it left masters and optimizer states as they were."""


class StepGuard:
    """The decisions of [Note: all-or-nothing steps] for one engine: skip or raise on a non-finite step, report a
    failed update, refuse checkpoints of a torn one. Its methods may run on the training thread or the overlap worker.

    Args:
        mode: ``nonfinite``, ``"skip"`` or ``"raise"``.
    """

    def __init__(self, mode: NonFiniteMode) -> None:
        self.mode = mode
        self.device_stepped = False  # the device groups' update of this step is queued (a failure after: torn)
        self._torn: str | None = None  # what a failure mid-update left applied
        # global_step of each step skipped for a non-finite loss or gradient norm (appended by the thread deciding)
        self.skipped: list[int] = []

    def nonfinite(self, index: int, norm_sq: float, loss: float | None) -> bool:
        """Raise for ``nonfinite="raise"``; else log and count the skipped step and return False (any thread)."""
        norm = math.sqrt(norm_sq) if norm_sq >= 0 else norm_sq  # inf and nan stay what they are
        what = f"gradient norm {norm:g}" + ("" if loss is None else f", loss {loss:g}")
        if self.mode == "raise":
            raise NonFiniteError(
                f"MegaTrainStrategy(nonfinite='raise'): optimizer step {index} has a non-finite {what}; nothing was "
                "updated (masters, Adam states and step counts are as before it). HINT: nonfinite='skip' skips such "
                "steps and trains on; lower the learning rate or clip gradients (gradient_clip_val) if they recur."
            )
        self.skipped.append(index)
        log.warning(
            "MegaTrain: skipped optimizer step %d: non-finite %s; masters, Adam states and step counts are unchanged "
            "(%d skipped so far, MegaTrainStrategy(nonfinite='skip'))", index, what, len(self.skipped),
        )
        return False

    def guarded(self, index: int, update: HostUpdate | None, work: Callable[[], object]) -> None:
        """Run part of step ``index``'s update; a failure raises :class:`StepFailed` saying whether anything was
        updated, and marks a step left with part of its update applied as torn ([Note: all-or-nothing steps])."""
        try:
            work()
        except BaseException as error:
            started = update.started if update is not None else 0
            if not started and not self.device_stepped:
                message = (
                    f"MegaTrain: optimizer step {index} failed before updating anything: every master, Adam state and "
                    f"step count is as it was before the step ({type(error).__name__}: {error})"
                )
            else:
                self._torn = (
                    f"optimizer step {index} failed after updating {started} host parameters"
                    f"{' and the gpu_optimizer_groups' if self.device_stepped else ''}, so the parameters and "
                    "optimizer states mix two steps"
                )
                message = (
                    f"MegaTrain: {self._torn} ({type(error).__name__}: {error}). Checkpoints of this state are "
                    "refused. HINT: resume from the last checkpoint."
                )
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: Lightning handles those itself
                raise
            raise StepFailed(message) from error

    def refuse_torn(self, what: str) -> None:
        """Called before saving parameters or optimizer states.

        Raises:
            RuntimeError: a failed step left part of its update applied ([Note: all-or-nothing steps]).
        """
        if self._torn is not None:
            raise RuntimeError(f"MegaTrain cannot {what}: {self._torn}. HINT: resume from the last checkpoint.")
