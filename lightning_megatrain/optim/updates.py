"""Which optimizers the engine steps itself, and the host update it runs for each (engine/optimizer_step.py).

The host Adam/AdamW that :func:`~lightning_megatrain.optim.host_optimizer.to_host_optimizer` produces runs
:class:`~lightning_megatrain.optim.host_optimizer.HostUpdate`; :class:`~lightning_megatrain.optim.muon.Muon` runs
:class:`~lightning_megatrain.optim.muon.MuonUpdate`. Both are all or nothing, overlappable and take clipping's factor
([Note: all-or-nothing steps], [Note: overlapped optimizer step]); any other optimizer steps as given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_megatrain.optim.host_optimizer import HostUpdate, Hyper, overlappable
from lightning_megatrain.optim.muon import Muon, MuonUpdate

Update = HostUpdate | MuonUpdate


def engine_steps(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the engine runs ``optimizer``'s update itself (:func:`host_update` has one for it)."""
    return overlappable(optimizer) or isinstance(optimizer, Muon)


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
    return HostUpdate(optimizer, grad_scale, skip=skip, snapshot=snapshot)
