"""MegaTrainPrecision: Lightning's precision hooks translated into engine calls."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_megatrain.engine import MegaTrainEngine
from lightning_megatrain.hooks import backward_update_blockers, grads_read_by_hooks

MegaTrainPrecisionInput = Literal["bf16-mixed", "32-true"]


class _SkippedStep(Exception):
    """Raised by the closure so that no update runs: the engine found the step non-finite and skips it."""

    def __init__(self, closure_result: Any) -> None:
        self.closure_result = closure_result


class MegaTrainPrecision(Precision):
    """Precision for :class:`~lightning_megatrain.MegaTrainStrategy`; masters, grads and optimizer states stay fp32.

    Args:
        precision: ``"bf16-mixed"`` casts each layer's streamed fp32 weights to bf16 in its GPU slot and computes
            under ``torch.autocast`` (residents stay fp32 on the device, as in Lightning's own bf16-mixed).
            ``"32-true"`` computes in fp32: true full precision, with much slower matmuls. Both stream the fp32
            masters over PCIe (no bf16 host copy to keep in sync, see engine/transfer.py).
        device_type: ``"cuda"`` or ``"cpu"``: where autocast applies.
    """

    def __init__(self, precision: MegaTrainPrecisionInput = "bf16-mixed", device_type: str = "cuda") -> None:
        if precision not in ("bf16-mixed", "32-true"):
            raise ValueError(
                f"MegaTrainPrecision(precision={precision!r}) is not supported. HINT: use 'bf16-mixed' (fp32 masters, "
                "bf16 compute) or '32-true' (fp32 everywhere)."
            )
        self.precision = precision
        self.device_type = device_type
        self._engine: MegaTrainEngine | None = None  # set by the strategy's setup

    @property
    def engine(self) -> MegaTrainEngine:
        """The engine of the :class:`~lightning_megatrain.MegaTrainStrategy` this plugin serves, set in its setup.

        Raises:
            RuntimeError: the plugin runs without that strategy's setup (another strategy, or a direct call).
        """
        if self._engine is None:
            raise RuntimeError(
                "MegaTrainPrecision has no engine: it works only under MegaTrainStrategy, whose setup hands it one. "
                "HINT: use Trainer(strategy='megatrain', precision='bf16-mixed') instead of passing MegaTrainPrecision "
                "as a plugin to another strategy."
            )
        return self._engine

    @engine.setter
    def engine(self, engine: MegaTrainEngine | None) -> None:
        self._engine = engine

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float32

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # The parameters are the fp32 masters: never cast them (streaming casts the device copies instead).
        return module

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "bf16-mixed":
            with torch.autocast(self.device_type, dtype=torch.bfloat16, cache_enabled=False):
                yield
        else:
            yield

    @override
    def _wrap_closure(self, model: pl.LightningModule, optimizer: Any, closure: Callable[[], Any]) -> Any:
        closure_result = closure()
        # Host grads must be final before hooks, clipping and the step read them; with nothing reading them before an
        # overlapped step, that step's worker waits for them instead (engine/optimizer_step.py, [Note: late grads]).
        step = self.engine.step
        step.finalize_gradients(grads_read=self._grads_read(model))
        self._after_closure(model, optimizer)
        # a non-finite loss or gradient norm skips the step or raises (engine/optimizer_step.py, [Note: all-or-nothing
        # steps]); raised inside optimizer.step(closure), the skip comes before any optimizer's update
        if not step.check_finite(closure_result, model.trainer.global_step):
            raise _SkippedStep(closure_result)
        return closure_result

    def _grads_read(self, model: pl.LightningModule) -> bool:
        """Whether code may read ``p.grad`` between backward and the optimizer step: manual optimization, an
        optimizer whose step the engine does not take (``optimizer.step`` reads them), or a hook
        (:func:`grads_read_by_hooks`)."""
        step = self.engine.step
        if not model.automatic_optimization or not all(step.takes_step(o) for o in model.trainer.optimizers):
            return True
        return grads_read_by_hooks(model)

    @override
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:
        # The backward's drains write the host grads that an overlapped optimizer step may still be reading.
        engine = self.engine
        engine.step.wait_for_host_step()
        engine.step.backward_starts()  # grads pending until finalized; the armed step's drains count from here
        # Unread device-group grads stay on the GPU; their sums restart at optimizer.zero_grad(), which an
        # optimizer_zero_grad of the module's own might not call (engine/device_state.py).
        engine.set_grads_read(self._grads_read(module) or is_overridden("optimizer_zero_grad", module))
        return super().pre_backward(tensor, module)

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        # The engine clips the flat host grad buffers (norms from the device); torch's per-tensor path otherwise.
        step = self.engine.step
        # the factor is left to an update that runs after optimizer.step() returns (overlapped, device groups); a
        # synchronous step gets grads scaled as torch's clipping scales them (a multiply: bitwise plain Lightning's)
        defer = step.takes_step(optimizer) and step.steps_after_return
        if not step.clip_grad_norm_(list(self.main_params(optimizer)), float(clip_val), defer):
            step.refuse_host_fallback("clipping an optimizer that holds only part of the model's parameters")
            super().clip_grad_by_norm(optimizer, clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        self.engine.step.refuse_host_fallback("gradient_clip_algorithm='value'")
        super().clip_grad_by_value(optimizer, clip_val)

    @override
    def optimizer_step(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        engine = self.engine
        try:
            if engine.step.takes_step(optimizer) and not kwargs:
                # layers may start their host update during the closure's backward ([Note: updates during backward]);
                # not while the first micro-batch's placement may still make some of them device groups (a resume)
                if not engine.placement_pending:
                    engine.step.arm_backward_updates(optimizer, backward_update_blockers(model))
                # forward/backward/clipping now; the update runs on the device and/or the overlap worker, or now
                with torch.enable_grad():
                    result = self._wrap_closure(model, optimizer, closure)
                engine.step.run(optimizer)
            else:
                engine.step.refuse_host_fallback(f"optimizer.step() with arguments {sorted(kwargs)}")
                result = super().optimizer_step(optimizer, model, closure, **kwargs)
        except _SkippedStep as skipped:
            result = skipped.closure_result
        except BaseException:
            engine.step.abort_backward_updates()  # a step that raised updates nothing
            raise
        engine.masters_updated()
        return result


def megatrain_precision(precision_plugin: Precision, device_type: str) -> MegaTrainPrecision:
    """The :class:`MegaTrainPrecision` that runs Lightning's ``precision_plugin`` (``MegaTrainStrategy``'s setter):
    ``"bf16-mixed"`` and ``"32-true"`` as they are, ``"bf16-true"`` as ``"bf16-mixed"`` with a warning (masters are
    never kept in bf16).

    Raises:
        TypeError: another plugin, named with its precision.
    """
    if isinstance(precision_plugin, MixedPrecision) and precision_plugin.precision == "bf16-mixed":
        return MegaTrainPrecision("bf16-mixed", device_type)
    if isinstance(precision_plugin, HalfPrecision) and precision_plugin.precision == "bf16-true":
        warnings.warn(
            "MegaTrainStrategy keeps fp32 masters: precision='bf16-true' runs as 'bf16-mixed' (bf16 compute, "
            "fp32 masters, grads and Adam states).",
            stacklevel=3,  # the strategy's setter's caller, as before the move
        )
        return MegaTrainPrecision("bf16-mixed", device_type)
    if type(precision_plugin) is Precision:
        return MegaTrainPrecision("32-true", device_type)
    raise TypeError(
        f"MegaTrainStrategy supports precision='bf16-mixed', '32-true' (or 'bf16-true', run as bf16-mixed), "
        f"got {type(precision_plugin).__name__}"
        f"{f'({precision_plugin.precision!r})' if hasattr(precision_plugin, 'precision') else ''}."
    )
