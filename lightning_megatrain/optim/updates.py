"""Which optimizers the engine steps itself, and the host update it runs for each (engine/optimizer_step.py).

The host Adam/AdamW that :func:`~lightning_megatrain.optim.host_optimizer.to_host_optimizer` produces runs
:class:`~lightning_megatrain.optim.host_optimizer.HostUpdate`; :class:`~lightning_megatrain.optim.muon.Muon` runs
:class:`~lightning_megatrain.optim.muon.MuonUpdate`; ``CompactAdamW`` (yours, or Adam/AdamW under a compact
``host_state``) runs :class:`~lightning_megatrain.optim.compact_update.CompactUpdate`. All are all or nothing,
overlappable and take clipping's factor ([Note: all-or-nothing steps], [Note: overlapped optimizer step]); any other
optimizer steps as given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_megatrain.optim.compact_adam import CompactAdamW, HostStateLayout
from lightning_megatrain.optim.compact_update import CompactUpdate
from lightning_megatrain.optim.host_optimizer import HostUpdate, Hyper, overlappable
from lightning_megatrain.optim.muon import Muon, MuonUpdate

Update = HostUpdate | MuonUpdate | CompactUpdate


def engine_steps(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the engine runs ``optimizer``'s update itself (:func:`host_update` has one for it)."""
    return overlappable(optimizer) or isinstance(optimizer, (Muon, CompactAdamW))


def host_update(
    optimizer: torch.optim.Optimizer,
    grad_scale: Tensor | None,
    skip: frozenset[int],
    snapshot: Hyper | None,
    device: torch.device,
) -> Update:
    """``optimizer``'s update of its host parameters for one step (one :func:`engine_steps` takes); ``device`` is the
    engine's compute device, where Muon's Newton-Schulz iteration runs by default."""
    if isinstance(optimizer, Muon):
        return MuonUpdate(optimizer, grad_scale, skip=skip, snapshot=snapshot, device=device)
    if isinstance(optimizer, CompactAdamW):
        return CompactUpdate(optimizer, grad_scale, skip=skip, snapshot=snapshot)
    return HostUpdate(optimizer, grad_scale, skip=skip, snapshot=snapshot)


def state_bytes_per_param(optimizer: torch.optim.Optimizer, group: dict) -> float:
    """Host bytes of optimizer state per parameter of ``group`` once ``optimizer`` has stepped it: Muon's matrices
    one fp32 momentum (4), ``CompactAdamW`` its moments' format (8-bit: 2 and the block scales) and compensation,
    SGD its momentum buffer (4, or none), Adam/AdamW and any other optimizer two fp32 moments (8)."""
    if isinstance(optimizer, Muon) and group.get("use_muon"):
        return 4.0
    if isinstance(optimizer, CompactAdamW):  # the layout's moments, and the Kahan compensation it keeps in state
        layout = HostStateLayout(group["weights"], torch.float32, group["moments"])
        return layout.bytes_per_param()["optimizer states"] + (2.0 if group["weights"] == "bf16_kahan" else 0.0)
    if isinstance(optimizer, torch.optim.SGD):
        return 4.0 if group.get("momentum", 0) else 0.0
    return 8.0


def host_state_bytes(optimizers: Sequence[torch.optim.Optimizer], held: frozenset[int]) -> int:
    """Host bytes ``optimizers`` will add in state for the parameters in ``held`` (ids) that have none yet
    (:func:`state_bytes_per_param`)."""
    total = 0.0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            per_param = state_bytes_per_param(optimizer, group)
            total += sum(per_param * p.numel() for p in group["params"]
                         if p.requires_grad and id(p) in held and not optimizer.state.get(p))
    return int(total)
