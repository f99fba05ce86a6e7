"""Sharded host state over several ranks: each rank owns 1/N of every flat group's master, grad and optimizer state.

[Note: sharded host state]
With ``world_size = N > 1`` (``Trainer(devices=N, num_nodes=M)``, one process per device, engine/../ranks.py) every
:class:`FlatGroup` (one per decoder layer, one for the residents) is padded with zeros to ``N * S`` elements and
cut into N contiguous *shards* of ``S``: rank ``r`` owns elements ``[r*S, (r+1)*S)``. Who holds what:

- *owned master*: elements ``[r*S, (r+1)*S)`` of the group on rank r, the authoritative fp32 value of those
  elements; only rank r's optimizer updates it. For a decoder layer it is all the rank holds of the layer's master
  (an ``[S]`` host buffer): the layer is gathered whole only while it computes, and its parameters are NaN
  placeholders otherwise (engine/sharded_layers.py, [Note: sharded layer masters]). The residents' group stays whole
  on every rank: a ``padded`` buffer ``[N * S]`` whose owned part is rank r's and whose rest is the *gathered copy*
  of the other ranks' owned masters, refreshed by an all-gather after every optimizer step
  (:meth:`ShardedState.gather`); the residents' parameters are views of it.
- *pieces*: the part of each parameter that falls inside rank r's shard, one 1D ``nn.Parameter`` per parameter it
  overlaps, a view of the owned master. The optimizer's param groups hold the pieces instead of the parameters
  (:func:`shard_optimizer` in engine/shard_states.py), so every host optimizer (the fused Adam/AdamW host update,
  elementwise torch optimizers) steps exactly its shard, with each piece's hyperparameters those of its parameter.
- *owned grad*: a fp32 ``[S]`` buffer per group; each piece's ``.grad`` is its view. The parameters' own ``.grad``
  stay ``None`` during training: the gradient of the whole model exists on no rank (4/N bytes/param instead of 4).
- *optimizer state*: per piece, so 1/N of the Adam moments (8/N bytes/param).

Per rank: 16/N host bytes per layer parameter and 4 + 12/N per resident one, plus the layer being computed (gathered
whole) and, on the CPU backend at the end of backward, the residents' grads (on CUDA they stay on the device).

Collectives, in the same order on every rank (no rank ever decides alone whether to call one):

- *forward, recompute, validation, per layer* (:class:`~lightning_megatrain.engine.sharded_layers.ShardedTransfer`):
  the layer's owned masters are all-gathered into a buffer of the whole layer ([Note: sharded layer masters]).
- *backward, per layer* (the same ``ShardedTransfer``'s ``drain``): the layer's weight grads, packed into one padded
  fp32 buffer where they were computed (host on the CPU, the device on CUDA; absent grads as zeros), are
  reduce-scattered (sum) over the default group, divided by N (DDP's mean over ranks: with equal micro-batches per
  rank, the gradient of the global batch's mean loss) and added into the owned grad on the host. A parameter absent on
  every rank keeps ``grad=None`` on its pieces (one small all-reduce of presence flags per layer). Micro-batches of an
  accumulation each reduce-scatter (as DDP without ``no_sync``): the sum is linear, so the owned grads end as one
  reduction of the accumulated grads would leave them.
- *end of backward, residents* (engine/sharded_step.py, ``ShardedOptimizerStep.finalize_gradients``): the
  residents' grads (the parameters' ``.grad`` on the CPU backend, the compute copies' grads on the GPU) accumulate
  locally over the micro-batches and are reduce-scattered once (on CUDA from the device over NCCL, only the owned
  share copied to the host: ``ShardedState.device``; on the CPU over gloo).
- *clipping and the finite check*: the squared norm of the owned grads is all-reduced (sum) into the global one;
  the loss is all-reduced too, so every rank takes the same skip decision (host group, a few bytes).
- *after the update*: the residents' owned master is all-gathered into ``padded`` (on CUDA through the device and
  NCCL, on the CPU in place over gloo).

With ``overlap_optimizer`` each rank runs its host step on the worker thread (engine/overlap.py, [Note: overlapped
optimizer step]) over its owned shares, in the order the next forward reads them: the residents', then the layers'.
The worker issues no collective: every one stays on the training thread, in the same order on every rank. A reader
waits for the owned share of its group (the engine's gate maps a group to its share): the residents' all-gather
after the update waits for the residents' share only, and each layer's all-gather in the next forward for that
layer's share on this rank, so a rank's upload of layer i starts once its own update of layer i is done and the
all-gather completes once every rank's is. The next backward waits for the whole step, as with one rank.

Process groups: the default group carries the device tensors (NCCL on CUDA, gloo on the CPU); the host tensors go
over a gloo group made at setup when the default is NCCL (:class:`Ranks`). On the CPU both are the same gloo group.
On CUDA the layer grads are reduce-scattered on the device over NCCL and the owned share goes to the host through the
gradient drain, asynchronously ([Note: gradient drain]); each rank uploads its owned master of a layer and the GPUs
all-gather the layer over NCCL into the slot ([Note: sharded layer masters]); the residents' grads and masters take
the device too, synchronously, once per step (the grads reduced from the device, the owned masters uploaded and
gathered, both copied back), and the residents are uploaded whole from ``padded`` as with one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.collectives import Ranks
from lightning_megatrain.engine.host_store import FlatGroup
from lightning_megatrain.engine.pinned import HostRegistry
from lightning_megatrain.engine.shard_states import load_optimizer_state, sharded_state
from lightning_megatrain.engine.sharded_layers import nan_placeholder


def sharded_config(config: EngineConfig, world: int) -> EngineConfig:
    """``config`` for ``world`` > 1 ranks: the options they do not support yet refused when given, off when "auto";
    ``keep_layers`` and ``segment_layers`` fixed (0 and 1) when "auto", the same on every rank. ``overlap_optimizer``
    is kept: each rank steps its owned shares on the worker while the next forward gathers the layers already
    stepped ([Note: sharded host state]).

    Raises:
        ValueError: ``update_during_backward=True``, ``gpu_optimizer_groups`` > 0, a compact ``host_state`` or
            ``checkpoint_format="sharded"`` (every problem in one message).
    """
    problems = []
    if config.update_during_backward is True:
        problems.append("update_during_backward=True: each rank steps its shard after the reduce-scatter at the end "
                        "of backward; use 'auto' or False")
    groups = config.gpu_optimizer_groups
    if groups != "auto" and groups > 0:
        problems.append(f"gpu_optimizer_groups={groups}: device groups are not sharded yet; use 'auto' or 0")
    if config.checkpoint_format != "file":
        problems.append(f"checkpoint_format={config.checkpoint_format!r}: several ranks write their own files "
                        "([Note: checkpoints of several ranks]); use checkpoint_format='file'")
    if config.host_state != "fp32":
        problems.append(f"host_state={config.host_state!r}: the shards are fp32 masters, grads and Adam moments; "
                        "use host_state='fp32'")
    if problems:
        raise ValueError(f"MegaTrainStrategy with {world} ranks does not support:\n- " + "\n- ".join(problems))
    # every rank must issue the same collectives: a kept layer skips its gather in backward and a segment replays
    # its layers, so "auto", which each rank would decide from its own free memory and batch, is fixed instead
    segment_layers, _, sub_segment_layers = config.checkpoints_unplanned()
    return config.replace(
        update_during_backward=False,
        gpu_optimizer_groups=0,
        keep_layers=0 if config.keep_layers == "auto" else config.keep_layers,
        attention_memo=False if config.attention_memo == "auto" else config.attention_memo,  # planned for one rank
        segment_layers=segment_layers,
        sub_segment_layers=sub_segment_layers,
    )


@dataclass
class GroupShard:
    """One flat group on one rank: this rank's share of its master and, for a group kept whole, the whole padded
    master (see the module note)."""

    group: FlatGroup  # every parameter; master = padded[:numel] (whole), or the NaN placeholder (sharded)
    owned: FlatGroup  # the pieces; master = this rank's [S] elements (the owned master); grad [S] fp32 host
    padded: Tensor | None  # whole: 1D fp32 host [world * S], the owned master and the gathered copy; sharded: None
    size: int  # S: elements per rank
    piece_param: list[int]  # per piece: the index of its parameter in group.params
    piece_start: list[int]  # per piece: its first element within its parameter (flattened)

    @property
    def sharded(self) -> bool:
        """Whether the rank holds only its owned master (a layer), not the whole group (the residents)."""
        return self.padded is None


def _host_empty(numel: int, registry: HostRegistry | None, fill: Any) -> Tensor:
    """A 1D fp32 host buffer filled by ``fill`` (page-locked when there is a registry)."""
    if registry is not None:
        return registry.empty(numel, torch.float32, init=fill)
    flat = torch.empty(numel, dtype=torch.float32)
    fill(flat)
    return flat


def shard_group(group: FlatGroup, ranks: Ranks, registry: HostRegistry | None, whole: bool = False) -> GroupShard:
    """Cut this rank's share out of ``group``'s master and its pieces (see the module note). ``whole``: the group is
    padded to ``world * S`` and stays whole on the rank, its parameters views of it (the residents); else the rank
    keeps its owned master only and the parameters become views of a NaN placeholder (engine/sharded_layers.py,
    [Note: sharded layer masters]). The old master is freed (unregistered first where pinned)."""
    world, rank = ranks.world, ranks.rank
    size = -(-group.numel // world)
    lo, hi = rank * size, (rank + 1) * size
    old = group.master

    def fill_padded(flat: Tensor) -> None:
        flat[: group.numel].copy_(old)
        flat[group.numel :].zero_()

    def fill_owned(flat: Tensor) -> None:
        n = max(0, min(hi, group.numel) - lo)
        flat[:n].copy_(old[lo : lo + n])
        flat[n:].zero_()

    padded = _host_empty(world * size, registry, fill_padded) if whole else None
    owned_master = padded[lo:hi] if padded is not None else _host_empty(size, registry, fill_owned)
    storage = padded if padded is not None else nan_placeholder(group.numel)
    for p, offset in zip(group.params, group.offsets):
        p.data = storage[offset : offset + p.numel()].view(p.shape)
    group.master = storage[: group.numel]
    if registry is not None and old.numel():
        registry.free(old)
    group.release_grad(registry.free if registry is not None else None)  # no p.grad views it: grads are owned
    pieces, offsets, piece_param, piece_start = [], [], [], []
    for k, (p, offset) in enumerate(zip(group.params, group.offsets)):
        a, b = max(offset, lo), min(offset + p.numel(), hi)
        if a < b:  # a view of the owned master: shares its storage
            pieces.append(nn.Parameter(owned_master[a - lo : b - lo], requires_grad=p.requires_grad))
            offsets.append(a - lo)
            piece_param.append(k)
            piece_start.append(a - offset)

    def new_grad() -> Tensor:
        # zeros: the last rank's pieces may end before S, and the drain writes only the pieces (the padding stays 0
        # for the flat norm and the device-side sums, engine/drain.py)
        if registry is None:
            return torch.zeros(size, dtype=torch.float32)
        return registry.empty(size, torch.float32, init=torch.Tensor.zero_)

    owned = FlatGroup(params=pieces, offsets=offsets, master=owned_master, new_grad=new_grad)
    return GroupShard(group, owned, padded, size, piece_param, piece_start)


class ShardedState:
    """Every flat group's :class:`GroupShard` on this rank, and the collectives over them (see the module note).

    Args:
        groups: the layers' flat groups, then the residents' (``engine.flat_groups``).
        ranks: the process group.
        registry: page-locked allocations (CUDA), or ``None``.
        names: ``id(parameter) -> name`` for every parameter of the module.
        whole: the groups every rank keeps whole (the residents); the others are sharded.
        device: where the whole groups' grads are reduced and their masters gathered: the compute device (CUDA:
            over NCCL: the masters through pinned host buffers, the grads from the device), or ``None`` for the host
            (gloo).
    """

    def __init__(self, groups: list[FlatGroup], ranks: Ranks, registry: HostRegistry | None, names: dict[int, str],
                 whole: list[FlatGroup | None] = (), device: torch.device | None = None) -> None:
        self.ranks = ranks
        # Gloo over the host's loopback moved the 3B shape's 1.6 GB of residents at about 1 GB/s on the H200 x2
        # host (2.5 s of a 6 s step, benchmarks/results/*ranks*profile*): on CUDA they go over PCIe and NCCL.
        self.device = device if device is not None and device.type != "cpu" else None
        self.names = names  # id(parameter) -> its qualified name in the module, for checkpoints
        kept = {id(g) for g in whole if g is not None}
        self.shards = [shard_group(g, ranks, registry, whole=id(g) in kept) for g in groups]
        self._by_group = {id(s.group): s for s in self.shards}
        # filled by engine/shard_states.py shard_optimizer: id(piece) -> (parameter name, start, end, piece shape),
        # and id(optimizer) -> each param group's parameter names before sharding
        self.piece_keys: dict[int, tuple[str, int, int, torch.Size]] = {}
        self.layouts: dict[int, list[list[str]]] = {}

    def shard_of(self, group: FlatGroup) -> GroupShard:
        return self._by_group[id(group)]

    def adopt(self, previous: ShardedState | None) -> None:
        """Take the owned masters of ``previous`` (the last setup's shares of the same module: ``fit`` then
        ``validate``/``test``/``fit`` on one Trainer) for every sharded group of the same parameters: the module's
        layers are placeholders after the last teardown, so the masters packed from them at this setup are NaN."""
        if previous is None or previous.ranks.world != self.ranks.world:
            return
        before = {tuple(id(p) for p in s.group.params): s for s in previous.shards if s.sharded}
        for shard in self.shards:
            old = before.get(tuple(id(p) for p in shard.group.params))
            if shard.sharded and old is not None and old.size == shard.size:
                shard.owned.master.copy_(old.owned.master)

    @property
    def owned_groups(self) -> list[FlatGroup]:
        """The owned shares, in the order of ``groups``: what the optimizer step clips and steps."""
        return [s.owned for s in self.shards]

    @property
    def sharded_params(self) -> list[nn.Parameter]:
        """The parameters whose masters are sharded: NaN placeholders outside their layer's compute."""
        return [p for s in self.shards if s.sharded for p in s.group.params]

    def reduce_grads(self, shard: GroupShard, grads: list[Tensor | None]) -> None:
        """Reduce-scatter one group's grads (one per parameter, ``None`` = none on this rank) over the ranks and add
        the mean into the owned grads (see the module note), synchronously. A collective: every rank calls it for the
        same group. (A layer's grads on CUDA take the asynchronous drain instead: engine/sharded_layers.py.)"""
        mine, pieces = self.reduced_pieces(shard, grads)
        owned = shard.owned
        fresh = all(v is not None for v in pieces) and all(p.grad is None for p in owned.params)
        if mine.device.type != "cpu" and fresh:
            owned.grad.copy_(mine)  # one D2H straight into the pinned owned grad (waits for the reduction)
            owned.attach_grads()
            return
        mine = mine.cpu()  # [S] fp32 host
        owned.accumulate([None if v is None else mine[o : o + v.numel()] for v, o in zip(pieces, owned.offsets)],
                         packed=mine)

    def reduced_pieces(self, shard: GroupShard, grads: list[Tensor | None]) -> tuple[Tensor, list[Tensor | None]]:
        """The mean over ranks of one group's grads, this rank's share: ``[S]`` fp32 where the grads are, and its
        view per owned piece (``None`` for a parameter no rank has a gradient of). A collective (see
        :meth:`reduce_grads`). Reads the device only on a rank where some parameter has no gradient (an expert no
        token reached): the presence flags are all-reduced on every rank, and a rank with every grad knows they are
        all set."""
        device = self.device or next((g.device for g in grads if g is not None), torch.device("cpu"))
        group = shard.group
        padded = torch.zeros(self.ranks.world * shard.size, dtype=torch.float32, device=device)  # [N * S]
        # [P] 1.0 where this rank has the grad. Made by kernels only: assigning a Python number to one element of a
        # CUDA tensor (``present[k] = 0.0``) copies it from pageable host memory, which synchronizes the host with the
        # stream (the x2 profile's 1,020 syncs per step: one per parameter per layer and micro-batch); a slice's
        # ``zero_`` does not
        present = torch.ones(len(group.params), dtype=torch.float32, device=device)
        for k, (p, offset, g) in enumerate(zip(group.params, group.offsets, grads)):
            if g is not None:
                padded[offset : offset + p.numel()].copy_(g.reshape(-1), non_blocking=True)  # a host grad: H2D
            else:
                present[k : k + 1].zero_()
        self.ranks.all_reduce_(present)
        mine = self.ranks.reduce_scatter(padded).div_(self.ranks.world)  # [S]
        flags = [1.0] * len(grads) if all(g is not None for g in grads) else present.cpu().tolist()
        owned = shard.owned
        return mine, [mine[o : o + p.numel()] if flags[k] else None
                      for p, o, k in zip(owned.params, owned.offsets, shard.piece_param)]

    def gather(self, wait: Callable[[FlatGroup], None] | None = None) -> None:
        """Refresh the whole groups' gathered copy from the owners (after an optimizer step or a load); a sharded
        group is gathered when its layer runs (engine/sharded_layers.py). ``wait(group)``: blocks until this rank's
        update of the group's owned share is done (an overlapped step; see the note)."""
        for shard in self.shards:
            if shard.sharded:
                continue
            if wait is not None:
                wait(shard.group)
            if self.device is None:
                self.ranks.all_gather_(shard.padded)
                continue
            gathered = torch.empty(shard.padded.numel(), dtype=torch.float32, device=self.device)  # [N * S]
            own = shard.owned.master.to(self.device, non_blocking=True)  # [S], from pinned memory
            self.ranks.all_gather(gathered, own)
            shard.padded.copy_(gathered)  # waits: the next step's residents upload from it

    def gather_whole(self, shard: GroupShard) -> Tensor:
        """A new 1D fp32 host buffer ``[world * S]`` holding ``shard``'s group whole: its master is ``[:numel]``. A
        collective on the host group."""
        out = torch.empty(self.ranks.world * shard.size, dtype=torch.float32)
        self.ranks.all_gather(out, shard.owned.master)
        return out

    def gathered_params(self) -> dict[str, Tensor]:
        """Every parameter whole, by name, as new host tensors: a collective (every rank calls it), and 4 bytes per
        parameter on each rank while the result lives. What ``module.state_dict()`` cannot give with several ranks
        (a sharded layer's parameters are placeholders there)."""
        out = {}
        for shard in self.shards:
            flat = shard.padded if not shard.sharded else self.gather_whole(shard)
            for p, offset in zip(shard.group.params, shard.group.offsets):
                out[self.names[id(p)]] = flat[offset : offset + p.numel()].view(p.shape).clone()
        return out

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state for a checkpoint (engine/shard_states.py, [Note: sharded
        checkpoints])."""
        return sharded_state(optimizer, self)

    def load_state(self, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
        """The torch state dict of this rank's pieces from a checkpoint's optimizer state, saved by any number of
        ranks ([Note: checkpoints of several ranks])."""
        shapes = {self.names[id(p)]: p.shape for s in self.shards for p in s.group.params}
        return load_optimizer_state(
            optimizer, saved, self.layouts[id(optimizer)], shapes, lambda piece: self.piece_keys[id(piece)]
        )

    def host_bytes(self) -> dict[str, int]:
        """The masters this rank holds (the owned masters of the sharded groups, the whole groups padded) and the
        owned grads allocated so far."""
        masters = sum(s.owned.master.nbytes if s.sharded else s.padded.nbytes for s in self.shards)
        return {"masters": masters, "owned_grads": sum(s.owned.grad_nbytes for s in self.shards)}
