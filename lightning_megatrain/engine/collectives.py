"""The process group as the engine uses it (:class:`Ranks`): this rank, the world, the ranks per host, the group
for each kind of tensor, and the collectives engine/sharding.py issues over them ([Note: sharded host state])."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

log = logging.getLogger(__name__)

# torch >= 2.10 names them *_single; the older names still work (with a deprecation warning) before that
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Ranks:
    """The process group as the engine uses it: this rank, the world size, and the group for each kind of tensor.

    Args:
        rank, world: this process's global rank and the number of processes.
        host_group: a gloo group for host tensors when the default group cannot carry them (NCCL); ``None``: the
            default group.
        per_host: the ranks on this process's host (``devices``), which share its RAM: the host checks count them
            all (engine/first_batch.py).
    """

    def __init__(self, rank: int, world: int, host_group: Any | None = None, per_host: int = 1) -> None:
        self.rank = rank
        self.world = world
        self.host_group = host_group
        self.per_host = per_host
        self._reduce_scatter_ok: dict[str, bool] = {}  # per device type: the backend has reduce_scatter

    @classmethod
    def from_default_group(cls, per_host: int = 1) -> Ranks:
        """This process's ranks in the initialized default group, ``per_host`` of them on each host; makes the host
        gloo group (a collective call: every rank runs it, at setup)."""
        host_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(dist.get_rank(), dist.get_world_size(), host_group, per_host)

    def barrier(self) -> None:
        """Return once every rank has called it (a one-element all-reduce on the host group)."""
        self.all_reduce_(torch.zeros(1))

    def refuse_together(self, check: Callable[[], None]) -> None:
        """Run ``check``, which raises RuntimeError to refuse, on every rank, and refuse on every rank where any
        refuses: a rank that raised alone would leave the others waiting in their next collective. A rank whose own
        check passed says that another refused (whose error has the numbers)."""
        try:
            check()
            error = None
        except RuntimeError as e:
            error = e
        refused = self.all_reduce_(torch.tensor([float(error is not None)]), op=dist.ReduceOp.MAX)[0]
        if error is not None:
            raise error
        if refused:
            raise RuntimeError("MegaTrainStrategy: another rank refused to start (its error says why); every rank "
                               "stops with it")

    def _group(self, t: Tensor) -> Any | None:
        return self.host_group if t.device.type == "cpu" else None

    def all_reduce_(self, t: Tensor, op: Any = dist.ReduceOp.SUM) -> Tensor:
        """``t`` reduced over the ranks, in place."""
        dist.all_reduce(t, op=op, group=self._group(t))
        return t

    def all_gather_(self, padded: Tensor) -> None:
        """Fill ``padded`` (1D, ``world * S``) with every rank's shard; this rank's is read from its own slice."""
        own = padded.view(self.world, -1)[self.rank]
        _all_gather(padded, own, group=self._group(padded))

    def all_gather(self, out: Tensor, own: Tensor) -> None:
        """Fill ``out`` (1D, ``world * S``) with every rank's ``own`` (``[S]``, on the same device)."""
        _all_gather(out, own, group=self._group(out))

    def reduce_scatter(self, padded: Tensor) -> Tensor:
        """This rank's shard (``[S]``) of the sum over ranks of ``padded`` (1D, ``world * S``)."""
        kind = padded.device.type
        if self._reduce_scatter_ok.get(kind, True):
            out = torch.empty(padded.numel() // self.world, dtype=padded.dtype, device=padded.device)
            try:
                _reduce_scatter(out, padded, group=self._group(padded))
                self._reduce_scatter_ok[kind] = True
                return out
            except (RuntimeError, NotImplementedError) as error:
                # Older gloo builds have no reduce_scatter: the same sum through all_reduce, keeping our slice
                # (N times the traffic). Every rank fails alike, before any data moves, so they all switch.
                if kind in self._reduce_scatter_ok:
                    raise
                log.info("MegaTrain: reduce_scatter unavailable on %s (%s): using all_reduce", kind, error)
                self._reduce_scatter_ok[kind] = False
        summed = self.all_reduce_(padded.clone())
        return summed.view(self.world, -1)[self.rank].clone()
