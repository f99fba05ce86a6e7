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
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adam import adam as adam_functional  # what Adam/AdamW.step() call after _init_group

from lightning_megatrain.config import CpuAdamMode

log = logging.getLogger(__name__)

# Adam/AdamW options that the fast paths do not implement: with any of these set the optimizer runs as given.
_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")

_deepspeed_failure: str | None = None  # remembered so a failed build is tried and reported once per process
_warned = False


def _is_adam(optimizer: Optimizer) -> bool:
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)


def _decoupled(optimizer: Optimizer) -> bool:
    if hasattr(optimizer, "ds_opt_adam"):
        return bool(optimizer.adam_w_mode)
    return isinstance(optimizer, torch.optim.AdamW) or bool(optimizer.defaults.get("decoupled_weight_decay", False))


def cpu_adam_build_dir() -> Path | None:
    """The folder where DeepSpeed's CPUAdam extension is about to be compiled (torch's JIT extension cache:
    ``$TORCH_EXTENSIONS_DIR/cpu_adam``, else ``~/.cache/torch_extensions/<python>_<cuda>/cpu_adam``), or None when
    nothing will be built: DeepSpeed was installed with it prebuilt, this process loaded it, or the cache holds it."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from torch.utils.cpp_extension import _get_build_directory  # the folder torch.utils.cpp_extension.load uses

    name = CPUAdamBuilder.NAME
    if installed_ops.get(name, False) or name in CPUAdamBuilder._loaded_ops:
        return None
    folder = Path(_get_build_directory(name, verbose=False))
    return None if (folder / f"{name}.so").exists() else folder


def _deepspeed_adam(optimizer: Optimizer) -> Optimizer:
    if not torch.cuda.is_available():
        # What DeepSpeed would detect, said up front: it then skips its "Setting accelerator to CPU" warning.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    folder = cpu_adam_build_dir()
    if folder is not None:  # the JIT build prints nothing and takes a minute or more
        log.info(
            "MegaTrain: building DeepSpeed's CPU Adam extension in %s (once per machine, about a minute; later runs "
            "load it from there)",
            folder,
        )

    class HostCPUAdam(DeepSpeedCPUAdam):
        def __del__(self) -> None:
            # LightningOptimizer wraps an optimizer in a dynamic subclass that shares its __dict__ (opt_id included):
            # collecting a wrapper must not free the C++ state of the optimizer still in use (segfault in step()).
            if type(self) is HostCPUAdam:
                super().__del__()

    d = optimizer.defaults
    return HostCPUAdam(
        optimizer.param_groups,
        lr=float(d["lr"]),
        betas=d["betas"],
        eps=d["eps"],
        weight_decay=d["weight_decay"],
        adamw_mode=_decoupled(optimizer),
    )


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
            host = _deepspeed_adam(optimizer)
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
    counts from the checkpoint; the implementation flags (and the step counter's type) this optimizer's own."""
    own = [{k: g[k] for k in _IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    if hasattr(optimizer, "ds_opt_adam"):  # DeepSpeedCPUAdam counts steps in a Python int
        state = {k: {**v, "step": int(v["step"])} if "step" in v else v for k, v in state_dict["state"].items()}
        state_dict = {**state_dict, "state": state}
    optimizer.load_state_dict(state_dict)
    for group, flags in zip(optimizer.param_groups, own):
        group.update(flags)


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
    """(param id -> its param group, group id -> the group's hyperparameters now)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    hyper = {id(g): {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups}
    return group_of, hyper


def _fused_adam(
    params: list[Tensor], grads: list[Tensor], states: list[dict], h: dict, decoupled: bool, unscale: Tensor | None
) -> None:
    """torch's fused Adam/AdamW kernel over tensors of one device and one param group (``Adam.step``'s call)."""
    adam_functional(
        params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [],
        [s["step"] for s in states], fused=True, decoupled_weight_decay=decoupled, amsgrad=False,
        beta1=h["betas"][0], beta2=h["betas"][1], lr=h["lr"], weight_decay=h["weight_decay"],
        eps=h["eps"], maximize=False, grad_scale=unscale,
    )


def _unscale(grad_scale: Tensor | None) -> Tensor | None:
    """The fused kernel's ``grad_scale`` argument (it divides grads by it) for a clip factor to multiply by."""
    return None if grad_scale is None else (1.0 / grad_scale).to(torch.float32)


def snapshot_update(
    optimizer: Optimizer,
    grad_scale: Tensor | None = None,
    skip: frozenset[int] = frozenset(),
    snapshot: Hyper | None = None,
) -> Callable[[list[Tensor]], None] | None:
    """``optimizer``'s update as a function of a subset of its parameters, with its state of *now*.

    The overlapped step (engine/overlap.py) applies it layer by layer on a worker thread while the LR scheduler may
    already have moved ``lr`` on for the next step; each call updates the given parameters exactly as
    ``optimizer.step()`` would (same kernel, same state entries, so checkpoints are interchangeable). Gradients are
    read now too (a ``zero_grad`` may drop ``p.grad`` before the update of ``p`` runs) and multiplied by
    ``grad_scale`` (deferred clipping) right before their update; parameters without one, not in the optimizer, or
    in ``skip`` (ids of parameters updated on the device, engine/device_state.py) are skipped. ``snapshot`` is a
    :func:`hyper_snapshot` taken earlier (the step's own, when the update is built later, on the worker). ``None``
    when :func:`overlappable` is False (the optimizer then steps synchronously).
    """
    if not overlappable(optimizer):
        return None
    group_of, hyper = snapshot or hyper_snapshot(optimizer)
    grads = {
        id(p): p.grad
        for g in optimizer.param_groups
        for p in g["params"]
        if p.grad is not None and id(p) not in skip
    }

    def present(params: list[Tensor]) -> list[Tensor]:
        return [p for p in params if id(p) in grads]

    if hasattr(optimizer, "ds_opt_adam"):  # DeepSpeedCPUAdam: its step() body, one parameter at a time

        def update_deepspeed(params: list[Tensor]) -> None:
            for p in present(params):
                if grad_scale is not None:
                    grads[id(p)].mul_(grad_scale)
                h = hyper[id(group_of[id(p)])]
                state = optimizer.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p.data, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p.data, dtype=torch.float32)
                state["step"] += 1
                beta1, beta2 = h["betas"]
                optimizer.ds_opt_adam.adam_update(
                    optimizer.opt_id, state["step"], h["lr"], beta1, beta2, h["eps"], h["weight_decay"],
                    h["bias_correction"], p.data, grads[id(p)], state["exp_avg"], state["exp_avg_sq"],
                )

        return update_deepspeed
    decoupled = _decoupled(optimizer)
    # The fused kernel divides each grad by ``grad_scale`` in place, inside the update's own pass over memory: the
    # clipping costs no separate pass (the AMP unscale argument; grads end up scaled exactly as clipping leaves them).
    unscale = _unscale(grad_scale)

    def update_fused(params: list[Tensor]) -> None:
        by_group: dict[int, list[Tensor]] = {}
        for p in present(params):
            by_group.setdefault(id(group_of[id(p)]), []).append(p)
        for key, ps in by_group.items():
            for p in ps:  # torch.optim.Adam._init_group's state for fused=True
                state = optimizer.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            _fused_adam(
                ps, [grads[id(p)] for p in ps], [optimizer.state[p] for p in ps], hyper[key], decoupled, unscale
            )

    return update_fused


def device_update(
    optimizer: Optimizer, grad_scale: Tensor | None = None
) -> Callable[[list[Tensor], list[Tensor], list[Tensor | None]], None]:
    """The Adam/AdamW update of device mirrors, with ``optimizer``'s hyperparameters of *now*.

    ``update(params, mirrors, grads)``: for each host parameter ``p`` (the key of its state in ``optimizer``) its
    device fp32 mirror and device grad (``None``: no gradient, skipped, as ``optimizer.step()`` skips ``p``), with
    ``optimizer.state[p]`` already holding device tensors (engine/device_state.py). Runs torch's fused kernel on the
    current stream; grads are divided in place by ``1/grad_scale`` (deferred clipping; a host or a device 0-dim
    tensor) inside it.
    """
    group_of, hyper = hyper_snapshot(optimizer)
    decoupled = _decoupled(optimizer)
    unscale = _unscale(grad_scale)
    on_device: dict[torch.device, Tensor] = {}  # a host factor: one (pageable) copy per step, not one per group

    def update(params: list[Tensor], mirrors: list[Tensor], grads: list[Tensor | None]) -> None:
        by_group: dict[int, list[int]] = {}
        for k, (p, g) in enumerate(zip(params, grads)):
            if g is not None and id(p) in group_of:
                by_group.setdefault(id(group_of[id(p)]), []).append(k)
        device_unscale = None
        if unscale is not None and mirrors:
            device = mirrors[0].device
            if device not in on_device:
                on_device[device] = unscale.to(device)
            device_unscale = on_device[device]
        for key, ks in by_group.items():
            _fused_adam(
                [mirrors[k] for k in ks], [grads[k] for k in ks], [optimizer.state[params[k]] for k in ks],
                hyper[key], decoupled, device_unscale,
            )

    return update
