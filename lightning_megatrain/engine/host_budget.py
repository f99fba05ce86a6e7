"""The host's budget for the first step's allocations: the host bytes the groups' grads and the optimizers' states
still take, what the process may still allocate, and the setup's refusal where ``gpu_optimizer_groups="auto"`` could
not move enough of that state to the GPU. engine/placement.py decides with these numbers ([Note: auto placement]);
planner/pool.py splits the state between both memories ([Note: memory pool])."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from lightning_megatrain._hardware import GIB, placeable_host_bytes
from lightning_megatrain.engine.device_state import gpu_bytes_per_param
from lightning_megatrain.engine.host_store import check_host_bytes_to_come, smaller_state_hint
from lightning_megatrain.optim.compact_adam import CompactAdamW
from lightning_megatrain.optim.host_optimizer import overlappable
from lightning_megatrain.optim.updates import host_state_bytes

if TYPE_CHECKING:
    from lightning_megatrain.engine.host_store import FlatGroup


def host_bytes_to_come(host_groups: Sequence[FlatGroup], optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Host bytes the host groups still allocate before their first step ends: their grads not yet allocated
    and the optimizer states their parameters have none of yet (optim/updates.py ``host_state_bytes``: Adam 8 B per
    parameter, Muon's matrices 4, 8-bit moments about 2)."""
    held = frozenset(id(p) for g in host_groups for p in g.params)
    return sum(g.grad_dtype.itemsize * g.numel - g.grad_nbytes for g in host_groups) + host_state_bytes(
        optimizers, held)


def checkpoint_host_budget(host_groups: Sequence[FlatGroup], optimizers: Sequence[torch.optim.Optimizer],
                           per_host: int = 1, reserve: int = 0) -> int:
    """Host bytes free for offloaded layer-input checkpoints (engine/placement.py ``choose_checkpoints``'
    ``host_bytes``): what the process may still allocate less the host reserve (``_hardware.placeable_host_bytes``,
    [Note: host reserve]) and ``reserve`` (what the host's other ranks keep free), shared evenly by the ``per_host``
    ranks of this host, less :func:`host_bytes_to_come`."""
    free = placeable_host_bytes()
    if free is None:
        return 1 << 62  # nothing to check against
    return (free[0] - reserve) // per_host - host_bytes_to_come(host_groups, optimizers)


def host_bytes_to_come_split(forward_groups: Sequence[FlatGroup], optimizers: Sequence[torch.optim.Optimizer],
                             n: int, grads_read: bool) -> int:
    """:func:`host_bytes_to_come` with the first ``n`` of ``forward_groups`` (the residents, then the layers) as
    device groups: the host groups' grads and states, and the device groups' grads (in the host grads' dtype) where
    code reads ``p.grad`` ([Note: memory pool] in planner/pool.py). A device group's optimizer state, a compact
    layout's Kahan compensation included, lives on the GPU ([Note: compact device groups]): of it the host keeps
    the master only, allocated at setup."""
    device = forward_groups[:n]
    read = sum(g.grad_dtype.itemsize * g.numel - g.grad_nbytes for g in device) if grads_read else 0
    return host_bytes_to_come(forward_groups[n:], optimizers) + read


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def host_short(to_come: Callable[[int], int], host_free: int) -> str:
    """A refusal's first words: the host bytes the groups' state still takes (``to_come(0)``) and those free."""
    return (f"the host cannot hold every group's grads and optimizer states ({_gib(to_come(0))} more, "
            f"{_gib(host_free)} free)")


def host_free_checked() -> int | None:
    """Host bytes the process may still allocate less the host reserve (``_hardware.placeable_host_bytes``, [Note: host
    reserve]), None where unknown or where ``MEGATRAIN_SKIP_MEMORY_CHECK=1`` turns the host checks off
    (engine/host_store.py)."""
    free = placeable_host_bytes()
    return None if free is None or os.environ.get("MEGATRAIN_SKIP_MEMORY_CHECK") == "1" else free[0]


def device_steppable(optimizer: torch.optim.Optimizer, host_state: str) -> bool:
    """Whether device groups can step ``optimizer``: torch's fused Adam/AdamW (or DeepSpeed's), or ``CompactAdamW``
    under a compact ``host_state`` (the device groups then hold its layout; under ``"fp32"`` they hold fp32 Adam
    moments, which a user's own CompactAdamW cannot step). engine/optimizer_setup.py refuses the rest."""
    return overlappable(optimizer) or (isinstance(optimizer, CompactAdamW) and host_state != "fp32")


def check_split_possible(forward_groups: Sequence[FlatGroup], optimizers: Sequence[torch.optim.Optimizer],
                         device: torch.device, compute_dtype: torch.dtype, host_state: str) -> None:
    """The setup's host check while ``gpu_optimizer_groups="auto"`` is undecided (the engine's ``check_host_state``):
    where the host cannot hold every group's state, refuse now, not at the first micro-batch, when device groups
    cannot take enough of it: a CPU compute device, an optimizer other than one Adam/AdamW (:func:`device_steppable`),
    or less GPU memory free than the fewest groups the host needs take in the ``host_state`` layout
    (engine/device_state.py ``gpu_bytes_per_param``) before any working set. The split itself is decided at the first
    micro-batch (engine/placement.py ``choose_gpu_optimizer_groups``).

    Raises:
        RuntimeError: with both memories' numbers (engine/host_store.py ``check_host_bytes_to_come``'s message where
            device groups cannot run).
    """
    to_come = lambda n: host_bytes_to_come_split(forward_groups, optimizers, n, False)  # noqa: E731
    free = host_free_checked()
    if free is None or to_come(0) <= free:
        return
    if device.type != "cuda" or len(optimizers) != 1 or not device_steppable(optimizers[0], host_state):
        check_host_bytes_to_come(to_come(0), host_state)  # refuses, with the numbers
        return
    n = fewest_host_groups(to_come, free)
    groups = forward_groups[:n]
    need = round(sum(gpu_bytes_per_param(compute_dtype.itemsize, resident=k == 0, host_state=host_state) * g.numel
                     for k, g in enumerate(groups)))
    gpu_free, _ = torch.cuda.mem_get_info(device)
    if to_come(n) > free or need > gpu_free:
        raise RuntimeError(
            f"MegaTrainStrategy: {host_short(to_come, free)}; it would with {n} groups "
            f"({sum(g.numel for g in groups) / 1e9:.2f}B params) keeping theirs on {device} (gpu_optimizer_groups), "
            f"which need {_gib(need)} there before any activations, but {_gib(gpu_free)} is free. HINT: "
            f"{smaller_state_hint(host_state)}a smaller model, more host RAM or a larger GPU."
        )


def fewest_host_groups(to_come: Callable[[int], int], host_free: int) -> int:
    """The fewest device groups with which the host holds ``to_come(n)`` (the GPU is not checked): a lower bound of
    the split, for hints and the setup's check; the count of every group where even that is too many."""
    n = 0
    while to_come(n) > host_free and n < 1 << 16 and to_come(n + 1) < to_come(n):
        n += 1
    return n
