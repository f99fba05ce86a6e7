"""The optimizer step of one rank of several: :class:`OptimizerStep` over the rank's owned shares of the flat groups
(engine/sharding.py, [Note: sharded host state]), with the decisions every rank must take alike made together."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.grad_norm import host_norm_sq
from lightning_megatrain.engine.host_store import FlatGroup
from lightning_megatrain.engine.optimizer_step import OptimizerStep
from lightning_megatrain.engine.overlap import OverlappedStep
from lightning_megatrain.engine.shard_states import shard_optimizer
from lightning_megatrain.engine.sharding import ShardedState


class ShardedOptimizerStep(OptimizerStep):
    """:class:`OptimizerStep` over the owned shares (engine/optimizer_step.py), with the residents' reduction, the
    global norm and a skip decision every rank shares (see the module note).

    Args:
        state: the shards; the base class gets ``state.owned_groups`` as its groups.
        resident_group: the residents' full group, whose grads are reduced at the end of backward (None: none).
        others: the base class's remaining arguments (config, device, transfer, residents, and ``overlap``: the
            worker stepping the owned shares, when ``overlap_optimizer``).
    """

    def __init__(self, state: ShardedState, resident_group: FlatGroup | None, config: EngineConfig,
                 device: torch.device, transfer: Any, residents: Any, overlap: OverlappedStep | None = None) -> None:
        super().__init__(config, device, state.owned_groups, overlap, transfer, residents)
        self.state = state
        self._resident = state.shard_of(resident_group) if resident_group is not None else None

    def to_host_optimizers(self, optimizers, schedulers):
        host = super().to_host_optimizers(optimizers, schedulers)
        for optimizer in host:
            shard_optimizer(optimizer, self.state)
        return host

    def _finalize(self, grads_read: bool) -> None:
        super()._finalize(grads_read)
        self._reduce_residents()

    def _drain_residents(self) -> None:
        """Nothing: on CUDA the residents' grads are reduce-scattered from the device (:meth:`_reduce_residents`),
        never drained whole to the host."""

    def _reduce_residents(self) -> None:
        """Reduce the residents' local grads into the owned grads where some rank holds any, when the grads are
        finalized (at the end of backward, or by clipping first under manual optimization): on CUDA the compute
        copies' grads, accumulated on the device over the micro-batches, go straight into the reduce-scatter and
        only this rank's mean crosses PCIe (engine/sharding.py ``reduce_grads``); on the CPU the parameters' own.
        Whether to reduce is one flag all-reduced (every rank takes the same branch); once reduced, no grad is left."""
        if self._resident is None:
            return
        params = self._resident.group.params
        grads = self.residents.grads() if self.residents is not None else [p.grad for p in params]
        local = any(g is not None for g in grads)
        anywhere = self.state.ranks.all_reduce_(torch.tensor([float(local)]), op=dist.ReduceOp.MAX)
        if anywhere[0]:
            self.state.reduce_grads(self._resident, grads)
        if self.residents is not None:
            self.residents.clear_grads()
        for p in params:
            p.grad = None

    def _host_norm_sq(self) -> Tensor:
        """The squared global grad norm: the owned grads' squared norms summed over the ranks."""
        return self.state.ranks.all_reduce_(host_norm_sq(self.groups).reshape(1).clone())[0]

    def clip_grad_norm_(self, params: list[Tensor], max_norm: float, defer: bool = False) -> bool:
        # every rank lands and reduces its grads before the norm (manual optimization clips before optimizer.step())
        self.finalize_gradients(grads_read=True)
        # decided together: which rank's pieces show the optimizer missing a parameter depends on the shards, and a
        # rank that raised alone would leave the others in the norm's all-reduce
        whole = self.state.ranks.all_reduce_(torch.tensor([float(self.clips_whole(params))]), op=dist.ReduceOp.MIN)
        if not whole[0] or not super().clip_grad_norm_(params, max_norm, defer):
            raise RuntimeError(
                "MegaTrainStrategy with several ranks clips the global norm of the optimizer's whole shard only, but "
                "the optimizer being clipped holds part of the model's parameters. HINT: one optimizer over "
                "self.parameters(), or devices=1."
            )
        return True

    def check_finite(self, loss: Tensor | None, index: int) -> bool:
        # the same decision on every rank: the global norm (clipping's, or _host_norm_sq's) and the mean loss
        if isinstance(loss, Tensor):
            ranks = self.state.ranks
            loss = ranks.all_reduce_(loss.detach().float().sum().reshape(1).cpu())[0] / ranks.world
        return super().check_finite(loss, index)
