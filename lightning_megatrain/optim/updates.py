"""Which optimizers the engine steps itself, and the host update it runs for each (engine/optimizer_step.py).

The host Adam/AdamW that :func:`~lightning_megatrain.optim.host_optimizer.to_host_optimizer` produces runs
:class:`~lightning_megatrain.optim.host_optimizer.HostUpdate`; :class:`~lightning_megatrain.optim.muon.Muon` runs
:class:`~lightning_megatrain.optim.muon.MuonUpdate`; ``CompactAdamW`` (yours, or Adam/AdamW under a compact
``host_state``) runs :class:`~lightning_megatrain.optim.compact_update.CompactUpdate`. All are all or nothing,
overlappable and take clipping's factor ([Note: all-or-nothing steps], [Note: overlapped optimizer step]);
:func:`device_update` is the device groups' update of each Adam kind (engine/device_state.py); any other
optimizer steps as given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_megatrain.mapped import any_mapped
from lightning_megatrain.optim.compact_adam import CompactAdamW, HostStateLayout
from lightning_megatrain.optim.compact_update import CompactUpdate, compact_device_update
from lightning_megatrain.optim.host_optimizer import HostUpdate, Hyper, fused_device_update, overlappable
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


def device_update(
    optimizer: torch.optim.Optimizer, grad_scale: Tensor | None, found_inf: Tensor | None
) -> Callable[[list[Tensor], list[Tensor], list[Tensor | None]], None]:
    """The update of the device groups' mirrors (engine/device_state.py): ``CompactAdamW``'s own under a compact
    ``host_state`` (its factor and finite decision known on the host: ``found_inf`` None), else torch's fused
    Adam/AdamW (``found_inf`` read on the device)."""
    if isinstance(optimizer, CompactAdamW):
        assert found_inf is None, "a compact device step takes the finite decision on the host ([Note: late grads])"
        return compact_device_update(optimizer, grad_scale)
    return fused_device_update(optimizer, grad_scale, found_inf)


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
    (:func:`state_bytes_per_param`), or only one loaded from a checkpoint and still mapped, not yet read into
    memory of its own ([Note: mapped checkpoint tensors] in mapped.py)."""
    total = 0.0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            per_param = state_bytes_per_param(optimizer, group)
            total += sum(per_param * p.numel() for p in group["params"]
                         if p.requires_grad and id(p) in held
                         and (not optimizer.state.get(p) or any_mapped(optimizer.state[p])))
    return int(total)
