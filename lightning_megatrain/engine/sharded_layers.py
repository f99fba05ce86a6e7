"""The decoder layers' masters over several ranks: each rank keeps its share, the layer is gathered whole to run.

[Note: sharded layer masters]
With ``world_size = N > 1`` rank r keeps only its *owned master* of each decoder layer's flat group (``[S]`` fp32,
``S = ceil(numel / N)``; engine/sharding.py, [Note: sharded host state]). The layer's weights exist whole only while
it computes, in a *gathered buffer* made by :class:`ShardedTransfer` each time the streamed Function acquires the
layer (forward, the recompute in backward, a segment's replay, validation and predict):

- on the CPU (gloo): ``acquire(i)`` all-gathers the N owned masters of layer i into a new host buffer
  ``[N * S]`` and returns its first ``numel`` elements (cast to the compute dtype if it is not fp32); the layer's
  parameters are bound to views of it for that call only ([Note: streamed layer]); the buffer is freed when the
  layer's compute (and a kept layer's graph) lets go of it;
- on CUDA (NCCL): the slot's upload (engine/transfer.py, [Note: slot lifecycle]) copies this rank's owned master
  over its own PCIe link into its part of a device gather buffer ``[N * S]`` and all-gathers the layer there over
  NCCL, on the H2D stream, before the slot's ``ready`` event; the slot is then filled from it as from a master.

In backward the layer's grads go the other way (``drain``): reduce-scattered over the ranks where they were computed,
and this rank's mean added into its owned grad. On CUDA that reduce-scatter runs on the compute stream right after
the layer's backward (NCCL's stream waits for it, the compute stream for NCCL's), and the ``[S]`` mean takes the
gradient drain the layers take with one rank ([Note: gradient drain]: D2H stream, pinned owned grad, the drain
worker), so the training thread never waits for the host. The drain is built over the owned shares and carries
fp32 (the mean is fp32), its slabs too.

Every acquire is a collective, so every rank must run the same layers in the same order: training, validation and
test do (Lightning's ``DistributedSampler`` pads every rank to as many batches; predict's does not pad, so uneven
predict batches are refused at predict start, ranks.py); a layer called on one rank only
(inside ``rank_zero_only`` code) waits forever. Outside the layer's compute, each parameter of a sharded layer is a
*placeholder*: a NaN of the parameter's shape and dtype with stride 0 (one element of storage), so reading it gives
NaN and writing into it raises. ``module.state_dict()`` therefore shows NaN for the layers: checkpoints save each
rank's owned masters in its shard file (engine/shard_states.py, [Note: checkpoints of several ranks]), and
``ShardedState.gathered_params()`` (a collective) gives every parameter whole. The residents (embeddings, final norm,
head) stay whole on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_megatrain.engine.host_store import FlatGroup

if TYPE_CHECKING:
    from lightning_megatrain.engine.sharding import GroupShard, ShardedState


def nan_placeholder(numel: int) -> Tensor:
    """A 1D fp32 host tensor of ``numel`` NaN elements sharing one element of storage (stride 0): what a sharded
    layer's master and parameters view outside its compute (see the note)."""
    return torch.full((1,), float("nan"), dtype=torch.float32).expand(numel)


class ShardedTransfer:
    """A transfer backend over the sharded layers (engine/transfer.py): ``acquire`` gathers a layer whole (see the
    note), ``drain`` reduce-scatters each layer's grads into the owned grads; everything else is the wrapped
    backend's.

    Args:
        inner: the :class:`HostTransfer` or :class:`CudaTransfer` of the layers.
        state: the shards.
        layer_groups: the layers' flat groups, by layer index.
    """

    def __init__(self, inner: Any, state: ShardedState, layer_groups: list[FlatGroup]) -> None:
        self._inner = inner
        self._state = state
        self._shards = [state.shard_of(g) for g in layer_groups]
        self._on_host = inner.device.type == "cpu"
        self._device_buffer: Tensor | None = None  # CUDA: [N * max S] fp32, the all-gather's output, on the H2D stream
        if not self._on_host:
            inner.upload = self._upload  # the slots' upload hook (engine/transfer.py)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def acquire(self, index: int) -> Tensor:
        """Layer ``index``'s weights whole, 1D in the compute dtype (a collective; see the note)."""
        if not self._on_host:
            return self._inner.acquire(index)  # the slot's upload gathers (_upload)
        shard = self._shards[index]
        self._inner.gate(shard.group)  # an overlapped step may still be updating this rank's owned share
        flat = self._state.gather_whole(shard)[: shard.group.numel]  # [numel] fp32 host, a new buffer
        dtype = self._inner.compute_dtype
        return flat if flat.dtype == dtype else flat.to(dtype)

    def _upload(self, index: int, staging: Tensor) -> None:
        """Fill ``staging[:numel]`` with layer ``index`` whole, on the current (H2D) stream: this
        rank's owned master H2D into its part of the device gather buffer, the NCCL all-gather of the layer there,
        then one device copy into the slot (see the note)."""
        shard: GroupShard = self._shards[index]
        ranks = self._state.ranks
        if self._device_buffer is None:
            largest = max(s.size for s in self._shards)
            self._device_buffer = torch.empty(ranks.world * largest, dtype=torch.float32, device=staging.device)
        gathered = self._device_buffer[: ranks.world * shard.size]
        own = gathered[ranks.rank * shard.size : (ranks.rank + 1) * shard.size]
        own.copy_(shard.owned.master, non_blocking=True)  # pinned owned master, this rank's PCIe link
        ranks.all_gather(gathered, own)  # NCCL: the current stream waits for it
        staging[: shard.group.numel].copy_(gathered[: shard.group.numel])

    def drain(self, index: int, grads: list[Tensor | None]) -> None:
        """Reduce-scatter layer ``index``'s grads and add this rank's mean into its owned grads: synchronously on the
        CPU; on CUDA the reduce-scatter runs behind the layer's backward on the compute stream and the wrapped
        backend's drain, built over the owned shares, carries the ``[S]`` mean to the host like a layer's grads (one
        D2H into the pinned owned grad, or a device-side sum with the earlier micro-batches': [Note: gradient
        drain])."""
        shard = self._shards[index]
        if self._on_host:
            self._state.reduce_grads(shard, grads)
            return
        _, pieces = self._state.reduced_pieces(shard, grads)
        self._inner.drain(index, pieces)

    def take_host_added(self) -> bool:
        """The owned grads' norm is taken on the host (each rank's part of the global norm, all-reduced)."""
        return True
