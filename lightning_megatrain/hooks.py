"""Which user hooks may read gradients before the optimizer step, or parameters after it; the barrier that waits.

[Note: user hooks]
The engine may finish an optimizer step after Lightning's ``optimizer.step()`` returned: the overlapped host step
updates the host masters on a worker thread while the next forward starts, and device groups write their updated
masters back only when the host reads them ([Note: overlapped optimizer step], [Note: device groups]). Likewise the
last gradient copies may still be landing when the step starts ([Note: late grads]). User code must not see
either:

- *gradients*: the precision plugin lands every host grad before the step when the module or a callback overrides
  ``on_before_optimizer_step``, or the module its own ``configure_gradient_clipping``
  (:func:`grads_read_by_hooks`);
- *parameters*: :class:`OptimizerBarrier`, the first callback, waits for the whole step before every hook that runs
  between a step and the next one's update (:data:`PARAMETER_HOOKS`) when the module or a callback overrides it
  (an EMA callback's ``on_train_batch_end``, a module logging weight norms in ``on_before_zero_grad``), and always
  at epoch end, train end, validation start and on an exception. A run without such hooks keeps all the overlap.

Zeroing grads waits too: ``optimizer.zero_grad()`` and the module's ``zero_grad()``, which Lightning calls before
validation (engine/optimizer_step.py, ``guard_module_zero_grad``).

Lightning's own callbacks that read neither (progress bars, model summary, LR monitor, timer, early stopping, and
checkpointing, whose save waits through the strategy) do not count, nor does a callback whose class sets
``megatrain_reads_state = False`` (the package's ``ThroughputLogger``). Code that reads parameters elsewhere (inside
``training_step``, from another thread) calls ``trainer.strategy.wait_for_optimizer()`` first.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    Timer,
)
from lightning.pytorch.utilities.model_helpers import is_overridden

log = logging.getLogger(__name__)

# The hooks Lightning runs between one optimizer step and the next one's update, in the order it runs them.
PARAMETER_HOOKS = (
    "on_train_batch_end",
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
)
# Lightning callbacks that read no parameters or gradients in those hooks.
_STATELESS_CALLBACKS = (ProgressBar, ModelSummary, LearningRateMonitor, Timer, EarlyStopping, ModelCheckpoint)


def _reads_state(callback: pl.Callback) -> bool:
    return getattr(callback, "megatrain_reads_state", True) and not isinstance(callback, _STATELESS_CALLBACKS)


def grads_read_by_hooks(model: pl.LightningModule) -> bool:
    """Whether user code runs between backward and the optimizer step where it may read ``p.grad``: an
    ``on_before_optimizer_step`` of the module or of a callback, or the module's own ``configure_gradient_clipping``."""
    if is_overridden("on_before_optimizer_step", model) or is_overridden("configure_gradient_clipping", model):
        return True
    callbacks = [c for c in model.trainer.callbacks if _reads_state(c)]
    return any(is_overridden("on_before_optimizer_step", callback) for callback in callbacks)


def backward_update_blockers(model: pl.LightningModule) -> list[str]:
    """What stops the host updates during backward ([Note: updates during backward] in engine/backward_updates.py):
    user code that may read grads or parameters between backward and the optimizer step (``on_after_backward``,
    ``on_before_optimizer_step``, ``configure_gradient_clipping``), manual optimization, clipping by value, several
    optimizers. Empty when nothing does."""
    trainer = model.trainer
    owners = [model, *(c for c in trainer.callbacks if _reads_state(c))]
    blockers = [f"{type(owner).__name__}.on_after_backward" for owner in owners
                if is_overridden("on_after_backward", owner)]
    if grads_read_by_hooks(model):
        blockers.append("a hook that reads grads before the step (on_before_optimizer_step, "
                        "configure_gradient_clipping)")
    if not model.automatic_optimization:
        blockers.append("manual optimization")
    if trainer.gradient_clip_val is not None and trainer.gradient_clip_algorithm == "value":
        blockers.append("gradient_clip_algorithm='value'")
    if len(trainer.optimizers) != 1:
        blockers.append(f"{len(trainer.optimizers)} optimizers")
    return blockers


def placement_hooks(model: pl.LightningModule) -> dict[str, bool]:
    """What the first micro-batch's placement asks of the user's code (the engine's ``place_for_batch``):
    ``custom_clipping``, the Trainer clips by value or the module overrides ``configure_gradient_clipping``;
    ``grads_read``, a hook reads grads before the step (:func:`grads_read_by_hooks`) or the module optimizes
    manually."""
    trainer = model.trainer
    return {
        "custom_clipping": (trainer.gradient_clip_val is not None and trainer.gradient_clip_algorithm == "value")
        or is_overridden("configure_gradient_clipping", model),
        "grads_read": grads_read_by_hooks(model) or not model.automatic_optimization,
    }


def parameter_readers(model: pl.LightningModule) -> dict[str, list[str]]:
    """For each of :data:`PARAMETER_HOOKS` that user code overrides, who does (the module's or callbacks' class
    names): the hooks before which :class:`OptimizerBarrier` waits."""
    readers: dict[str, list[str]] = {}
    owners = [model, *(c for c in model.trainer.callbacks if _reads_state(c))]
    for hook in PARAMETER_HOOKS:
        names = [type(owner).__name__ for owner in owners if is_overridden(hook, owner)]
        if names:
            readers[hook] = names
    return readers


class OptimizerBarrier(pl.Callback):
    """Waits for the optimizer step in flight before hooks that may read parameters (see [Note: user hooks]).

    Inserted by the strategy as the first callback when the engine may finish a step after it returned; the hooks
    it waits before are decided at ``on_train_start``, when the callbacks are final.
    """

    megatrain_reads_state = False  # it waits; it reads nothing

    def __init__(self) -> None:
        self.wait_before: frozenset[str] = frozenset()

    def _wait(self, trainer: pl.Trainer, *_: Any) -> None:
        trainer.strategy.wait_for_optimizer()

    on_train_epoch_end = on_train_end = on_validation_start = _wait

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # No update may run while Lightning handles the exception (an OnExceptionCheckpoint saves next), but a failed
        # step's error raised here would replace the one Lightning is handling, and skip its teardown: logged instead.
        try:
            trainer.strategy.wait_for_optimizer()
        except Exception as error:
            log.error("MegaTrain: while handling %s: %s", type(exception).__name__, error)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        readers = parameter_readers(pl_module)
        self.wait_before = frozenset(readers)
        if readers:
            log.info(
                "MegaTrain: the optimizer step finishes before %s, which may read parameters: those steps overlap less",
                "; ".join(f"{hook} ({', '.join(names)})" for hook, names in readers.items()),
            )

    def _wait_before(self, hook: str, trainer: pl.Trainer) -> None:
        if hook in self.wait_before:
            trainer.strategy.wait_for_optimizer()

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self._wait_before("on_train_batch_end", trainer)

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self._wait_before("on_train_batch_start", trainer)

    def on_before_zero_grad(self, trainer: pl.Trainer, *_: Any) -> None:
        self._wait_before("on_before_zero_grad", trainer)

    def on_before_backward(self, trainer: pl.Trainer, *_: Any) -> None:
        self._wait_before("on_before_backward", trainer)

    def on_after_backward(self, trainer: pl.Trainer, *_: Any) -> None:
        self._wait_before("on_after_backward", trainer)

    def on_before_optimizer_step(self, trainer: pl.Trainer, *_: Any) -> None:
        self._wait_before("on_before_optimizer_step", trainer)
