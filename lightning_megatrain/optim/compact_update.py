"""Compact host state in the engine: the user's Adam/AdamW becomes a :class:`CompactAdamW` over the ``host_state``
layout, and :class:`CompactUpdate` is its update as the engine runs it (engine/optimizer_step.py).

[Note: compact state in the engine]
With ``host_state`` other than ``"fp32"`` (config.py) the engine packs each flat group's masters and grads in the
layout's dtypes (engine/host_store.py: bf16 for ``compact`` and ``compact_kahan``, so the parameters are bf16 views)
and :func:`to_compact_adamw` rebuilds the Adam/AdamW from ``configure_optimizers`` as ``CompactAdamW`` on the same
param-group dicts (LR schedulers keep driving it), with the layout's weight and moment formats. The engine steps it
with :class:`CompactUpdate`, which has ``HostUpdate``'s interface (optim/host_optimizer.py): :meth:`prepare` over
every group first (states created and checked: [Note: all-or-nothing steps]), then one call per flat group (the
overlapped step runs them layer by layer on its worker, [Note: overlapped optimizer step]), the grads read when the
update is built (late grads land first, [Note: late grads]) and clipping's factor multiplied into each grad inside
the kernel (``grad_scale``), never into the bf16 grads in place (which would round them a second time). Each
parameter is updated exactly as ``CompactAdamW.step()`` updates it, with the same stochastic rounding bits (its
position over all param groups), so a run through the engine equals a plain loop calling ``CompactAdamW`` on bf16
parameters with the same grads (tests/strategy/test_strategy_compact_state.py).

Grads: a bf16 grad buffer receives each micro-batch's gradient as the compute produced it (bf16 under bf16-mixed)
and adds later micro-batches with one rounding per add, the sum computed in fp32 (the GPU drain adds on the device
in fp32 and writes the rounded sum back; the CPU's bf16 add computes in fp32 too), as autograd accumulates into a
bf16 parameter's ``.grad``. Norms of bf16 grads are accumulated in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_megatrain.optim.compact_adam import (
    HOST_STATE_LAYOUTS,
    CompactAdamW,
    describe,
    new_state,
    state_problems,
)
from lightning_megatrain.optim.host_optimizer import Hyper, allocate_states, hyper_snapshot, is_decoupled

# Adam/AdamW options CompactAdamW does not implement
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def to_compact_adamw(optimizer: Optimizer, host_state: str) -> CompactAdamW:
    """``optimizer`` as the :class:`CompactAdamW` of the ``host_state`` layout (see [Note: compact state in the
    engine]): a ``CompactAdamW`` with the layout's formats as is, a plain Adam/AdamW rebuilt on its own param groups
    (its hyperparameters, Adam's L2 or AdamW's decoupled weight decay kept; ``compile="auto"``).

    Raises:
        ValueError: another optimizer (SGD, Muon, an Adam variant with amsgrad, maximize, capturable or
            differentiable), or a ``CompactAdamW`` whose formats are not the layout's.
    """
    layout = HOST_STATE_LAYOUTS[host_state]
    if isinstance(optimizer, CompactAdamW):
        found = {(g["weights"], g["moments"]) for g in optimizer.param_groups}
        if found != {(layout.weights, layout.moments)}:
            have = ", ".join(f"weights={w!r}, moments={m!r}" for w, m in sorted(found))
            raise ValueError(
                f"MegaTrainStrategy(host_state={host_state!r}) stores weights={layout.weights!r} and "
                f"moments={layout.moments!r}, but configure_optimizers returned CompactAdamW({have}). HINT: return "
                f"torch.optim.AdamW (it is run as that CompactAdamW), or CompactAdamW(weights={layout.weights!r}, "
                f"moments={layout.moments!r})."
            )
        return optimizer
    flags = [f for f in _UNSUPPORTED_FLAGS if optimizer.defaults.get(f)]
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or flags:
        name = type(optimizer).__name__ + (f"({', '.join(f'{f}=True' for f in flags)})" if flags else "")
        raise ValueError(
            f"MegaTrainStrategy(host_state={host_state!r}) runs Adam/AdamW as CompactAdamW over its compact host "
            f"state, but configure_optimizers returned {name}. HINT: return torch.optim.AdamW or torch.optim.Adam "
            "(without amsgrad, maximize, capturable, differentiable), or use host_state='fp32' for this optimizer."
        )
    decoupled = is_decoupled(optimizer)
    for group in optimizer.param_groups:  # Adam's L2 or AdamW's decoupled decay, whatever the group says
        group["decoupled_weight_decay"] = decoupled
    d = optimizer.defaults
    # the same group dicts: schedulers built on ``optimizer`` keep setting their lr (Optimizer.add_param_group keeps
    # each dict and only adds the keys it lacks: weights, moments, seed)
    return CompactAdamW(optimizer.param_groups, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                        weight_decay=d["weight_decay"], decoupled_weight_decay=decoupled, weights=layout.weights,
                        moments=layout.moments)


class CompactUpdate:
    """``CompactAdamW``'s update of its host parameters for one step, applied group by group, with the interface of
    ``host_optimizer.HostUpdate`` (see [Note: compact state in the engine]).

    Args:
        optimizer: the ``CompactAdamW``.
        grad_scale: clipping's factor (0-dim), multiplied into each grad inside the kernel; None: 1.
        skip: ids of parameters not to update.
        snapshot: a ``hyper_snapshot`` taken earlier (the step's own, when the update is built on the overlap worker).
    """

    def __init__(
        self,
        optimizer: CompactAdamW,
        grad_scale: Tensor | None = None,
        skip: frozenset[int] = frozenset(),
        snapshot: Hyper | None = None,
    ) -> None:
        self.optimizer = optimizer
        self._group_of, self._hyper = snapshot or hyper_snapshot(optimizer)
        self._index = _stream_index(optimizer)
        self._grads = {id(p): p.grad for g in optimizer.param_groups for p in g["params"]
                       if p.grad is not None and id(p) not in skip}
        self._grad_scale = 1.0 if grad_scale is None else float(grad_scale)
        self.started = 0  # parameters whose update has begun: after a failure, 0 means nothing was written

    def _h(self, p: Tensor) -> dict:
        return self._hyper[id(self._group_of[id(p)])]

    def _present(self, params: Sequence[Tensor]) -> list[Tensor]:
        return [p for p in params if id(p) in self._grads]

    def prepare(self, groups: Iterable[Sequence[Tensor]]) -> None:
        """Create the states a first update of ``groups``' parameters creates and check every tensor the kernel
        reads, before any parameter is updated; a failure removes the states it created.

        Raises:
            RuntimeError: a parameter, gradient or state the kernel cannot update (named in the message).
        """
        allocate_states(self.optimizer, [p for group in groups for p in self._present(group)],
                        lambda p: new_state(p, self._h(p)["weights"], self._h(p)["moments"]), check=self._check)

    def _check(self, p: Tensor) -> None:
        h = self._h(p)
        problems = state_problems(p, self._grads[id(p)], self.optimizer.state[p], h["weights"], h["moments"])
        if problems:
            raise RuntimeError(f"a host parameter {describe(p)} cannot take the CompactAdamW update: "
                               + "; ".join(problems))

    def __call__(self, params: list[Tensor]) -> None:
        """Update ``params`` (part of what :meth:`prepare` was given) as ``CompactAdamW.step()`` would."""
        for p in self._present(params):
            self.started += 1
            self.optimizer.update_param(p, self._grads[id(p)], self._h(p), self._index[id(p)], self._grad_scale)


def _stream_index(optimizer: CompactAdamW) -> dict[int, int]:
    """Each parameter's stochastic rounding stream: its position in the param groups, as ``step()`` counts."""
    return {id(p): k for k, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}


def compact_device_update(
    optimizer: CompactAdamW, grad_scale: Tensor | None = None
) -> Callable[[list[Tensor], list[Tensor], list[Tensor | None]], None]:
    """``optimizer``'s update of device mirrors with its hyperparameters of *now* (engine/device_state.py, [Note:
    compact device groups]), the interface of ``host_optimizer.fused_device_update``.

    ``update(params, mirrors, grads)``: for each host parameter ``p`` (the key of its state) its device mirror in the
    layout's weight dtype and its device grad (``None``: no gradient, skipped, as ``step()`` skips ``p``), with
    ``optimizer.state[p]`` already holding device tensors (the step count on the CPU). Each is updated as
    ``CompactAdamW.step()`` updates ``p``, with ``p``'s stochastic rounding stream; ``grad_scale`` (clipping's factor, a
    host 0-dim tensor: the host knows it before a compact device step) multiplies each grad inside the kernel.
    """
    group_of, hyper = hyper_snapshot(optimizer)
    index = _stream_index(optimizer)
    scale = 1.0 if grad_scale is None else float(grad_scale)

    def update(params: list[Tensor], mirrors: list[Tensor], grads: list[Tensor | None]) -> None:
        for p, mirror, grad in zip(params, mirrors, grads):
            if grad is not None and id(p) in group_of:
                optimizer.update_param(p, grad, hyper[id(group_of[id(p)])], index[id(p)], scale, weights=mirror)

    return update
