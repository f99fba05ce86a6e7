"""The global gradient norm of the engine's flat groups, and clipping's factor from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_megatrain.engine.host_store import FlatGroup


def host_norm_sq(groups: list[FlatGroup]) -> Tensor:
    """The squared global grad norm on the host (fp32 0-dim): the device norms from backward where valid, in one
    small D2H at the step boundary, where the host waits anyway; host passes elsewhere."""
    partial = [g.grad_norm_sq() for g in groups]
    on_device = [n for n in partial if n.device.type != "cpu"]
    on_host = [n for n in partial if n.device.type == "cpu"]
    if on_device:
        on_host.append(torch.stack(on_device).sum().cpu())
    return torch.stack(on_host).sum() if on_host else torch.zeros(())


def device_norm_sq(groups: list[FlatGroup], device: torch.device) -> Tensor:
    """The squared global grad norm left on the device (fp32 0-dim), while grads land ([Note: late grads]).

    Grads still landing have their norm measured on the device (a group with a host add makes the grads wait,
    :meth:`OptimizerStep.finalize_gradients`); a group without one has no grads this step, or grads final on the
    host (the residents' host add).
    """
    device_sq = [g.device_norm_sq for g in groups if g.device_norm_sq is not None]
    host_sq = [g.grad_norm_sq() for g in groups if g.device_norm_sq is None]  # zeros where there are no grads
    total_sq = torch.stack(device_sq).sum() if device_sq else torch.zeros((), device=device)
    return total_sq + float(torch.stack(host_sq).sum()) if host_sq else total_sq


def norm_sq(x: Tensor) -> Tensor:
    """Squared L2 norm of a 1D grad buffer (fp32 0-dim, on its device): a dot product in fp32, accumulated in fp32
    from a bf16 buffer (compact ``host_state``) without an fp32 copy of it."""
    if x.dtype == torch.float32:
        return torch.dot(x, x)
    return torch.linalg.vector_norm(x, dtype=torch.float32).square()


def clip_coef(norm_sq: Tensor, max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s factor, ``max_norm / (norm + 1e-6)`` clamped to 1, where ``norm_sq`` is."""
    return torch.clamp(max_norm / (norm_sq.sqrt() + 1e-6), max=1.0)
