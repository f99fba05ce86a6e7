"""Map the optimizer from ``configure_optimizers`` to a fast host (CPU) implementation of the same update.

Adam/AdamW become DeepSpeed's ``DeepSpeedCPUAdam`` (AVX, measured 3.6 Gparam/s on 16 cores) when DeepSpeed is
installed (the optional extra: ``pip install lightning-megatrain[deepspeed]``; imported only here, on first use) and
its extension builds, else torch's fused AdamW on CPU (3.1 Gparam/s; the for-loop default manages 0.73). The new
optimizer is built on the *same* param-group dicts, so LR schedulers created in ``configure_optimizers`` keep driving
it. Any other optimizer runs as given on the host masters.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adam import adam as adam_functional  # what Adam/AdamW.step() call after _init_group

from lightning_megatrain.config import CpuAdamMode
from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS, describe
from lightning_megatrain.optim.deepspeed_adam import deepspeed_host_adam, deepspeed_update

log = logging.getLogger(__name__)

# Adam/AdamW options that the fast paths do not implement: with any of these set the optimizer runs as given.
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")

_deepspeed_failure: str | None = None  # remembered so a failed build is tried and reported once per process
_warned = False


def _is_adam(optimizer: Optimizer) -> bool:
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)


def is_decoupled(optimizer: Optimizer) -> bool:
    if hasattr(optimizer, "ds_opt_adam"):
        return bool(optimizer.adam_w_mode)
    return isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.defaults.get("decoupled_weight_decay", False))


def _torch_fused(optimizer: Optimizer) -> Optimizer:
    # Flipping the flags in place keeps the object (and the schedulers bound to it): torch then runs _fused_adamw.
    optimizer.defaults.update(fused=True, foreach=False)
    for group in optimizer.param_groups:
        group.update(fused=True, foreach=False)
    return optimizer


def to_host_optimizer(optimizer: Optimizer, mode: CpuAdamMode = "auto") -> Optimizer:
    """Return the host optimizer that replaces ``optimizer`` (possibly ``optimizer`` itself).

    Args:
        optimizer: what ``configure_optimizers`` returned; its parameters are the host fp32 masters.
        mode: ``"auto"`` tries DeepSpeedCPUAdam and falls back to torch fused AdamW with one warning;
            ``"deepspeed"`` requires DeepSpeedCPUAdam; ``"torch"`` always uses torch fused AdamW.

    Raises:
        RuntimeError: ``mode="deepspeed"`` and DeepSpeed is not installed or its CPUAdam extension does not build.
    """
    global _deepspeed_failure, _warned
    if not _is_adam(optimizer) or any(optimizer.defaults.get(flag) for flag in _UNSUPPORTED_FLAGS):
        return optimizer
    if mode != "torch" and _deepspeed_failure is None:
        try:
            host = deepspeed_host_adam(optimizer)
            log.info("MegaTrain: %s -> DeepSpeedCPUAdam", type(optimizer).__name__)
            return host
        except Exception as e:  # ImportError, or the JIT build failing (no g++ / Python headers)
            _deepspeed_failure = f"{type(e).__name__}: {e}"
    if mode == "deepspeed":
        raise RuntimeError(
            f"MegaTrainStrategy(cpu_adam='deepspeed') could not build DeepSpeedCPUAdam ({_deepspeed_failure}). "
            "HINT: DeepSpeed is an optional extra: `pip install lightning-megatrain[deepspeed]`; its CPUAdam "
            "extension builds on first use and needs g++ and the Python headers. Or use cpu_adam='auto' to fall "
            "back to torch's fused AdamW."
        )
    if mode == "auto" and not _warned:
        _warned = True
        warnings.warn(
            f"MegaTrain: DeepSpeedCPUAdam is unavailable ({_deepspeed_failure}); using torch fused AdamW on the "
            "CPU instead (about 15% slower; `pip install lightning-megatrain[deepspeed]` for DeepSpeedCPUAdam).",
            stacklevel=2,
        )
    return _torch_fused(optimizer)


# Param-group keys that say how an update is computed, not what it computes. A checkpoint written by another host
# implementation (DeepSpeedCPUAdam, torch's fused AdamW, plain Lightning's AdamW) must not bring its own: a torch
# checkpoint lacks DeepSpeedCPUAdam's "bias_correction" (KeyError at the first step), a DeepSpeed one sets torch's
# "fused" to None (the step silently loses its fused, overlappable path).
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable", "bias_correction")


def load_host_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)`` across host implementations: hyperparameters, moments and step
    counts from the checkpoint; the implementation flags (and the step counter's type) this optimizer's own.

    Raises:
        ValueError: the state was saved in another ``host_state`` layout (its moments would not fit the kernel).
    """
    saved, wanted = _layout_name(state_dict["param_groups"]), _layout_name(optimizer.param_groups)
    if saved != wanted:
        raise ValueError(
            f"The checkpoint's optimizer state was saved with MegaTrainStrategy(host_state={saved!r}), this run stores "
            f"host_state={wanted!r}: its moments are in another format. HINT: resume with host_state={saved!r}, or "
            "load only the weights (the module's load_state_dict on the checkpoint's 'state_dict') and start the "
            "optimizer afresh."
        )
    own = [{k: g[k] for k in _IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    if hasattr(optimizer, "ds_opt_adam"):  # DeepSpeedCPUAdam counts steps in a Python int
        state = {k: {**v, "step": int(v["step"])} if "step" in v else v for k, v in state_dict["state"].items()}
        state_dict = {**state_dict, "state": state}
    optimizer.load_state_dict(state_dict)
    for group, flags in zip(optimizer.param_groups, own):
        group.update(flags)


def _layout_name(groups: Sequence[dict[str, Any]]) -> str:
    """The ``host_state`` whose formats a CompactAdamW's param groups carry (``"fp32"`` for any other optimizer), or
    its formats where no layout has them."""
    formats = {(g.get("weights"), g.get("moments")) for g in groups}
    names = [name for name, layout in HOST_STATE_LAYOUTS.items()
             if name != "fp32" and {(layout.weights, layout.moments)} == formats]
    return "fp32" if formats <= {(None, None)} else names[0] if names else f"formats {sorted(formats)}"


def rebind_scheduler(scheduler: Any, optimizer: Optimizer) -> None:
    """Point an LR scheduler built on the replaced optimizer at the host optimizer.

    Both share the same param-group dicts, so the learning rates already follow; this also gives the host
    optimizer's ``step`` the call tracking torch's schedulers install at construction (``_wrapped_by_lr_sched`` /
    ``_opt_called``), without which every ``scheduler.step()`` warns that ``optimizer.step()`` was overridden.
    """
    scheduler.optimizer = optimizer
    if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        return
    step = optimizer.step

    @functools.wraps(step)
    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked_step  # type: ignore[method-assign]


def overlappable(optimizer: Optimizer) -> bool:
    """One of the two host Adam implementations :func:`to_host_optimizer` produces (DeepSpeed or torch fused)."""
    if hasattr(optimizer, "ds_opt_adam"):
        return True
    return _is_adam(optimizer) and all(g.get("fused") for g in optimizer.param_groups)


Hyper = tuple[dict[int, dict], dict[int, dict]]


def hyper_snapshot(optimizer: Optimizer) -> Hyper:
    """(param id -> its param group, group id -> the group's hyperparameters now). Tensor hyperparameters are
    copied: torch's LR schedulers set a tensor ``lr`` in place, possibly while an overlapped update still reads it."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    hyper = {id(g): {k: _frozen(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups}
    return group_of, hyper


def _frozen(value: Any) -> Any:
    """``value`` as it is now: a tensor (or a tuple holding tensors, such as ``betas``) copied."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _fused_adam(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[dict],
    h: dict,
    decoupled: bool,
    unscale: Tensor | None,
    found_inf: Tensor | None = None,
) -> None:
    """torch's fused Adam/AdamW kernel over tensors of one device and one param group (``Adam.step``'s call).

    ``found_inf`` (0-dim fp32, 1.0 = skip): the kernel then leaves parameters, moments and step counts untouched.
    """
    adam_functional(
        params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
        [s["step"] for s in states], fused=True, decoupled_weight_decay=decoupled, amsgrad=False,
        beta1=h["betas"][0], beta2=h["betas"][1], lr=h["lr"], weight_decay=h["weight_decay"],
        eps=h["eps"], maximize=False, grad_scale=unscale, found_inf=found_inf,
    )


def _unscale(grad_scale: Tensor | None) -> Tensor | None:
    """The fused kernel's ``grad_scale`` argument (it divides grads by it) for a clip factor to multiply by."""
    return None if grad_scale is None else (1.0 / grad_scale).to(torch.float32)


def _new_state(p: Tensor, deepspeed: bool) -> dict[str, Any]:
    """A parameter's Adam state before its first update: what ``Adam._init_group`` creates for ``fused=True``, or
    DeepSpeedCPUAdam's ``step()`` (a Python int step count)."""
    if deepspeed:
        zeros = functools.partial(torch.zeros_like, p.data, dtype=torch.float32)
        return {"step": 0, "exp_avg": zeros(), "exp_avg_sq": zeros()}
    zeros = functools.partial(torch.zeros_like, p, memory_format=torch.preserve_format)
    return {"step": torch.zeros((), dtype=torch.float32), "exp_avg": zeros(), "exp_avg_sq": zeros()}


def allocate_states(
    optimizer: Optimizer,
    params: Iterable[Tensor],
    new_state: Callable[[Tensor], dict[str, Any]] | None = None,
    check: Callable[[Tensor], None] | None = None,
) -> Callable[[], None]:
    """Create the missing states of ``params`` (``new_state(p)``; default: Adam's, 8 bytes per parameter), then
    ``check(p)`` each parameter (raising for what its update cannot take), and return the undo, which removes the
    created states again; a failure of either undoes itself."""
    params = list(params)
    deepspeed = hasattr(optimizer, "ds_opt_adam")
    new_state = new_state or functools.partial(_new_state, deepspeed=deepspeed)
    created: list[tuple[Tensor, dict | None]] = []  # (parameter, its entry before: None or an empty dict)

    def undo() -> None:
        for p, before in created:
            if before is None:
                optimizer.state.pop(p, None)
            else:
                optimizer.state[p] = before

    try:
        for p in params:
            before = optimizer.state.get(p)  # .get: the state defaultdict would insert an empty entry
            if not before:
                created.append((p, before))
                optimizer.state[p] = new_state(p)
        for p in params if check is not None else ():
            check(p)
    except BaseException:
        undo()
        raise
    return undo


class HostUpdate:
    """``optimizer``'s update of its host parameters for one step, with its state of *now*, applied group by group.

    The overlapped step (engine/overlap.py) applies it layer by layer on a worker thread while the LR scheduler may
    already have moved ``lr`` on for the next step; each call updates the given parameters exactly as
    ``optimizer.step()`` would (same kernel, same state entries, so checkpoints are interchangeable). Gradients are
    read now too (a ``zero_grad`` may drop ``p.grad`` before the update of ``p`` runs) and multiplied by
    ``grad_scale`` (deferred clipping) right before their update; parameters without one, not in the optimizer, or
    in ``skip`` (ids of parameters updated on the device, engine/device_state.py) are skipped. ``snapshot`` is a
    :func:`hyper_snapshot` taken earlier (the step's own, when the update is built later, on the worker).

    :meth:`prepare` runs first, over every group, and does all that can fail for a reason other than a crash (it
    allocates the states a first update creates and checks every tensor the kernel reads); a call then only runs
    the kernel on what it checked (engine/optimizer_step.py, [Note: all-or-nothing steps]). For the two host
    implementations :func:`overlappable` names (DeepSpeed, or torch fused).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        grad_scale: Tensor | None = None,
        skip: frozenset[int] = frozenset(),
        snapshot: Hyper | None = None,
    ) -> None:
        assert overlappable(optimizer), "HostUpdate takes the DeepSpeed or torch fused Adam/AdamW only"
        self.optimizer = optimizer
        self.deepspeed = hasattr(optimizer, "ds_opt_adam")
        self._group_of, self._hyper = snapshot or hyper_snapshot(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._grads = {id(p): p.grad for p in params if p.grad is not None and id(p) not in skip}
        self._grad_scale = grad_scale
        # The fused kernel divides each grad by ``grad_scale`` in place, inside the update's own pass over memory: the
        # clipping costs no separate pass (the AMP unscale argument; grads end up scaled exactly as clipping leaves
        # them).
        self._unscale = None if self.deepspeed else _unscale(grad_scale)
        self._decoupled = is_decoupled(optimizer)
        self.started = 0  # parameters whose update has begun: after a failure, 0 means nothing was written

    def _present(self, params: Sequence[Tensor]) -> list[Tensor]:
        return [p for p in params if id(p) in self._grads]

    def prepare(self, groups: Iterable[Sequence[Tensor]]) -> None:
        """Create the Adam states a first update of ``groups``' parameters creates, and check every gradient and
        state the kernel will read; before any parameter is updated. A failure removes the states it created.

        Raises:
            RuntimeError: a gradient or state that is not a dense tensor of its parameter's shape, dtype and device
                (the kernel would fail on it).
        """
        allocate_states(self.optimizer, [p for group in groups for p in self._present(group)], check=self._check)

    def _check(self, p: Tensor) -> None:
        state = self.optimizer.state[p]
        tensors = {"gradient": self._grads[id(p)], "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        check_like(p, tensors, "Adam", contiguous=self.deepspeed)
        step = state["step"]
        if not (isinstance(step, int) if self.deepspeed else isinstance(step, Tensor) and step.numel() == 1):
            raise RuntimeError(f"the Adam step count of a host parameter {describe(p)} is {step!r}")

    def __call__(self, params: list[Tensor]) -> None:
        """Update ``params`` (part of what :meth:`prepare` was given) as ``optimizer.step()`` would."""
        present = self._present(params)
        if self.deepspeed:  # DeepSpeedCPUAdam: its step() body, one parameter at a time
            for p in present:
                self.started += 1
                grad = self._grads[id(p)]
                if self._grad_scale is not None:
                    grad.mul_(self._grad_scale)
                state = self.optimizer.state[p]
                state["step"] += 1
                deepspeed_update(self.optimizer, self._hyper[id(self._group_of[id(p)])], p, grad, state)
            return
        by_group: dict[int, list[Tensor]] = {}
        for p in present:
            by_group.setdefault(id(self._group_of[id(p)]), []).append(p)
        for key, ps in by_group.items():
            self.started += len(ps)
            states = [self.optimizer.state[p] for p in ps]
            _fused_adam(ps, [self._grads[id(p)] for p in ps], states, self._hyper[key], self._decoupled, self._unscale)


def check_like(p: Tensor, tensors: dict[str, Tensor], kernel: str, contiguous: bool = False) -> None:
    """Check that each of ``tensors`` (a gradient or state of the host parameter ``p``, by name) is a dense tensor
    of ``p``'s shape, dtype and device (and contiguous, where ``contiguous``), as ``kernel``'s update needs.

    Raises:
        RuntimeError: one is not, named in the message.
    """
    for name, t in tensors.items():
        dense = t.layout == torch.strided and (t.is_contiguous() or not contiguous)
        if not (dense and t.shape == p.shape and t.dtype == p.dtype and t.device == p.device):
            raise RuntimeError(
                f"the {name} of a host parameter {describe(p)} is {describe(t)}"
                f"{'' if dense else ' (not a dense contiguous tensor)'}: the {kernel} kernel cannot update it"
            )


def fused_device_update(
    optimizer: Optimizer, grad_scale: Tensor | None = None, found_inf: Tensor | None = None
) -> Callable[[list[Tensor], list[Tensor], list[Tensor | None]], None]:
    """The Adam/AdamW update of device mirrors, with ``optimizer``'s hyperparameters of *now*.

    ``update(params, mirrors, grads)``: for each host parameter ``p`` (the key of its state in ``optimizer``) its
    device fp32 mirror and device grad (``None``: no gradient, skipped, as ``optimizer.step()`` skips ``p``), with
    ``optimizer.state[p]`` already holding device tensors (engine/device_state.py). Runs torch's fused kernel on the
    current stream; grads are divided in place by ``1/grad_scale`` (deferred clipping; a host or a device 0-dim
    tensor) inside it. ``found_inf`` (a device 0-dim fp32 tensor, 1.0 = skip) is read by the kernel when it runs:
    the step's non-finite decision, taken on the device ([Note: all-or-nothing steps] in engine/optimizer_step.py).
    """
    group_of, hyper = hyper_snapshot(optimizer)
    decoupled = is_decoupled(optimizer)
    unscale = _unscale(grad_scale)
    on_device: dict[torch.device, Tensor] = {}  # the factor on the mirrors' device: once per step, not per group

    def update(params: list[Tensor], mirrors: list[Tensor], grads: list[Tensor | None]) -> None:
        by_group: dict[int, list[int]] = {}
        for k, (p, g) in enumerate(zip(params, grads)):
            if g is not None and id(p) in group_of:
                by_group.setdefault(id(group_of[id(p)]), []).append(k)
        device_unscale = None
        if unscale is not None and mirrors:
            device = mirrors[0].device
            if device not in on_device:
                # a host factor becomes a fill queued on the stream (.to(device) would be a blocking copy from
                # pageable memory); a device one (late grads) is used as it is
                on_device[device] = (torch.full((), float(unscale), dtype=torch.float32, device=device)
                                     if unscale.device.type == "cpu" else unscale.to(device))
            device_unscale = on_device[device]
        for key, ks in by_group.items():
            _fused_adam(
                [mirrors[k] for k in ks], [grads[k] for k in ks], [optimizer.state[params[k]] for k in ks],
                hyper[key], decoupled, device_unscale, found_inf,
            )

    return update
