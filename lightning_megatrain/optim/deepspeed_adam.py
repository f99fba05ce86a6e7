"""DeepSpeed's CPU Adam (``DeepSpeedCPUAdam``, AVX) as the host optimizer: its JIT build announced, and its update
made a function of the checkpointed state alone. Imported by optim/host_optimizer.py; DeepSpeed itself is imported
only inside these functions, on first use."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

log = logging.getLogger(__name__)


def cpu_adam_build_dir(built_too: bool = False) -> Path | None:
    """The folder where DeepSpeed's CPUAdam extension is about to be compiled (torch's JIT extension cache:
    ``$TORCH_EXTENSIONS_DIR/cpu_adam``, else ``~/.cache/torch_extensions/<python>_<cuda>/cpu_adam``), or None when
    nothing will be built: DeepSpeed was installed with it prebuilt, this process loaded it, or (unless
    ``built_too``) the cache holds it."""
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from torch.utils.cpp_extension import _get_build_directory  # the folder torch.utils.cpp_extension.load uses

    name = CPUAdamBuilder.NAME
    if installed_ops.get(name, False) or name in CPUAdamBuilder._loaded_ops:
        return None
    folder = Path(_get_build_directory(name, verbose=False))
    return None if (folder / f"{name}.so").exists() and not built_too else folder


def build_lock_warning(folder: Path | None, now: float | None = None) -> str | None:
    """What to say when torch's build lock is in ``folder``: torch then waits, silently and for as long as the file
    exists, for the process that made it, which may have been killed mid-build (a stale lock hangs every later run).
    None without a lock."""
    lock = None if folder is None else folder / "lock"
    if lock is None or not lock.exists():
        return None
    age = (time.time() if now is None else now) - lock.stat().st_mtime
    return (f"MegaTrain: DeepSpeed's CPU Adam build waits for {lock} (made {age / 60:.0f} min ago): another process "
            "is building it, or one was interrupted mid-build and left the file, and then this run waits forever. "
            "HINT: if no other build runs, delete the file; or use cpu_adam='torch'.")


def deepspeed_host_adam(optimizer: Optimizer) -> Optimizer:
    """DeepSpeed's ``DeepSpeedCPUAdam`` on ``optimizer``'s param groups (its extension built on first use, said in the
    log), stepping through the engine's :class:`~lightning_megatrain.optim.host_optimizer.HostUpdate`."""
    from lightning_megatrain.optim.host_optimizer import HostUpdate, is_decoupled

    if not torch.cuda.is_available():
        # What DeepSpeed would detect, said up front: it then skips its "Setting accelerator to CPU" warning.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    stale = build_lock_warning(cpu_adam_build_dir(built_too=True))
    if stale is not None:
        log.warning(stale)
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

        # DeepSpeed's step() as the engine takes it: HostUpdate's ([Note: DeepSpeed's beta powers])
        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> Any:
            loss = None if closure is None else torch.enable_grad()(closure)()
            params = [p for g in self.param_groups for p in g["params"]]
            update = HostUpdate(self)
            update.prepare([params])
            update(params)
            return loss

    d = optimizer.defaults
    return HostCPUAdam(
        optimizer.param_groups,
        lr=float(d["lr"]),
        betas=d["betas"],
        eps=d["eps"],
        weight_decay=d["weight_decay"],
        adamw_mode=is_decoupled(optimizer),
    )


_NO_ELEMENTS = torch.empty(0)  # fp32: what DeepSpeed's adam_update takes for a call that updates nothing


def deepspeed_update(optimizer: Optimizer, h: dict, p: Tensor, grad: Tensor, state: dict) -> None:
    """DeepSpeedCPUAdam's update of ``p`` to step ``state["step"]``, its bias corrections from the step count alone.

    [Note: DeepSpeed's beta powers]
    DeepSpeed's C++ Adam object keeps beta1^t and beta2^t in fp32 between calls: a call for step t + 1 after one for
    step t multiplies them by beta, any other step recomputes them as pow(beta, t). A run resumed from a checkpoint
    gets a fresh object, so its first step took pow where the uninterrupted run had multiplied t times, and their
    weights drifted apart in the last bits (by up to 6e-7 after 20 resumed steps at lr 1e-2 in unit tests). A call for
    step 0 on no elements first resets the object, so every update takes pow(beta, t) (for t = 1: beta, as the
    product gives): the update is a function of the checkpointed step count and betas alone, as torch's Adam's is,
    and a resumed run is bitwise the uninterrupted one (tests/strategy/test_exact_resume.py).
    """
    beta1, beta2 = h["betas"]
    args = (h["lr"], beta1, beta2, h["eps"], h["weight_decay"], h["bias_correction"])
    ds, opt_id = optimizer.ds_opt_adam, optimizer.opt_id
    ds.adam_update(opt_id, 0, *args, _NO_ELEMENTS, _NO_ELEMENTS, _NO_ELEMENTS, _NO_ELEMENTS)
    ds.adam_update(opt_id, state["step"], *args, p.data, grad, state["exp_avg"], state["exp_avg_sq"])
