"""What the engine decides at the first training micro-batch, whose shape the decisions need: the split of the state
between host and GPU (``gpu_optimizer_groups="auto"``), the attention memos (``attention_memo="auto"``) and where
the layer-input checkpoints go (``segment_layers``, ``sub_segment_layers``, ``device_checkpoints``), the checkpoints
placed again for any longer micro-batch (where the memos may only be switched off); and what waits for that split
(the host-state check, loaded optimizer states). The decisions themselves are engine/placement.py's ([Note: auto
placement]); :class:`FirstBatchPlacement` applies them to the engine, which inherits it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_megatrain._hardware import other_processes_slack
from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine.device_state import DeviceGroup, settle_states
from lightning_megatrain.engine.host_budget import (
    check_split_possible,
    checkpoint_host_budget,
    device_steppable,
    host_bytes_to_come,
    host_bytes_to_come_split,
    host_free_checked,
)
from lightning_megatrain.engine.host_store import FlatGroup, check_host_bytes_to_come
from lightning_megatrain.engine.memo_choice import choose_attention_memo
from lightning_megatrain.engine.placement import (
    PlacementLimits,
    choose_checkpoints,
    choose_gpu_optimizer_groups,
    module_hf_config,
    token_shape,
)

if TYPE_CHECKING:
    from lightning_megatrain.engine.backward_updates import BackwardUpdates
    from lightning_megatrain.engine.sharding import ShardedState
    from lightning_megatrain.engine.streamed import StreamedLayers
    from lightning_megatrain.engine.transfer import Transfer

log = logging.getLogger(__name__)


class FirstBatchPlacement:
    """The first-micro-batch decisions of :class:`~lightning_megatrain.engine.engine.MegaTrainEngine`, which
    inherits them; the attributes below are the engine's (set in its ``__init__`` and ``setup``)."""

    module: nn.Module
    device: torch.device
    compute_dtype: torch.dtype
    config: EngineConfig
    groups: list[FlatGroup]
    resident_group: FlatGroup | None
    device_groups: list[DeviceGroup]
    sharding: ShardedState | None
    transfer: Transfer | None
    streamed: StreamedLayers | None
    backward_updates: BackwardUpdates | None
    placement_pending: bool
    _unsettled: list[torch.optim.Optimizer]
    _grads_deferred: bool
    _checkpoint_options: tuple[Any, Any, Any]  # segment_layers, device_checkpoints, sub_segment_layers as given
    _memo_option: Any  # attention_memo as given
    _placed_tokens: int
    on_cuda: bool
    flat_groups: list[FlatGroup]
    # and its methods _place_device_groups and wait_for_optimizer

    def place_for_batch(
        self,
        batch: Any,
        *,
        grad_accum: int,
        optimizers: Sequence[torch.optim.Optimizer],
        custom_clipping: bool,
        chunked_loss: bool,
        grads_read: bool = False,
    ) -> None:
        """Decide ``gpu_optimizer_groups="auto"`` for the first training micro-batch and place them, then place (or
        check) the layer-input checkpoints (engine/placement.py, [Note: auto placement]); logs each choice. Called
        once, before that micro-batch's forward. ``grads_read``: code reads ``p.grad`` before the step (the device
        groups' grads then reach the host too). Raises before any allocation of the micro-batch when no split of the
        state between host and GPU, or no placement of its checkpoints, fits, with the numbers."""
        self.placement_pending = False
        if self.config.gpu_optimizer_groups == "auto":
            self._choose_device_groups(batch, grad_accum, optimizers, custom_clipping, chunked_loss, grads_read)
            self.settle_loaded_states(self._unsettled)
        if self.on_cuda:
            self.place_checkpoints(batch, grad_accum, optimizers, chunked_loss)

    def checkpoints_outgrown(self, batch: Any) -> bool:
        """Whether ``batch`` has more tokens than the micro-batch the checkpoints were placed for (shapes only)."""
        shape = token_shape(batch) if self._placed_tokens else None
        return shape is not None and shape[0] * shape[1] > self._placed_tokens

    def _choose_device_groups(self, batch, grad_accum, optimizers, custom_clipping, chunked_loss, grads_read) -> None:
        forward = [self.resident_group, *self.groups]
        free = host_free_checked()
        n, why = choose_gpu_optimizer_groups(
            self.module,
            batch,
            config=self.config,
            device=self.device,
            compute_dtype=self.compute_dtype,
            grad_accum=grad_accum,
            steppable=len(optimizers) == 1 and device_steppable(optimizers[0], self.config.host_state),
            custom_clipping=custom_clipping,
            chunked_loss=chunked_loss,
            host_free=free,
            to_come=lambda k: host_bytes_to_come_split(forward, optimizers, k, grads_read),
        )
        log.info("MegaTrain: gpu_optimizer_groups=%d (auto: %s)", n, why)
        self.config = self.config.replace(gpu_optimizer_groups=n)
        self._place_device_groups(n)
        if self._grads_deferred:  # the host groups' grads, deferred at setup, now that the split is decided
            self._grads_deferred = False
            for group in forward[n:]:
                group.grad  # noqa: B018  (allocates the buffer: FlatGroup.grad)

    def settle_loaded_states(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Optimizer states just loaded from a checkpoint into their places (engine/device_state.py
        ``settle_states``): now, or, while ``gpu_optimizer_groups="auto"`` is undecided, once :meth:`place_for_batch`
        has placed the device groups, so that the host never holds theirs ([Note: mapped checkpoint tensors])."""
        self._unsettled = list(optimizers) if self.config.gpu_optimizer_groups == "auto" else []
        for optimizer in () if self._unsettled else optimizers:
            settle_states(optimizer, self.device_groups)

    def check_host_state(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Refuse before the first step when host RAM cannot hold the host groups' grads and the optimizers' states
        still to come (the setup's check counted masters and grads only: the optimizers did not exist yet).

        Raises:
            RuntimeError: with the numbers (engine/host_store.py ``check_host_bytes_to_come``).
        """
        if self.placement_pending and self.config.gpu_optimizer_groups == "auto":  # split at the first micro-batch
            check_split_possible([self.resident_group, *self.groups], optimizers, self.device, self.compute_dtype,
                                 self.config.host_state)
            return
        host_groups = self._host_groups()
        if self.sharding is None:
            check_host_bytes_to_come(host_bytes_to_come(host_groups, optimizers), self.config.host_state)
            return
        # The ranks of a host share its RAM: each checks that all of them fit, measured once every rank's setup has
        # allocated what it holds, and all refuse if one does (a rank stopping alone leaves the others in a
        # collective). On the CPU backend the residents' grads, whole on every rank until their reduce-scatter, come
        # too (on CUDA they stay on the device: engine/sharded_step.py).
        ranks, residents = self.sharding.ranks, self.resident_group
        to_come = host_bytes_to_come(host_groups, optimizers)
        if residents is not None and not self.on_cuda:
            to_come += residents.grad_dtype.itemsize * residents.numel
        ranks.barrier()
        ranks.refuse_together(lambda: check_host_bytes_to_come(to_come, self.config.host_state, ranks.per_host,
                                                               self._other_ranks_reserve()))

    def _ranks_per_host(self) -> int:
        """The ranks sharing this host's RAM (1 without several ranks)."""
        return 1 if self.sharding is None else self.sharding.ranks.per_host

    def _other_ranks_reserve(self) -> int:
        """Host bytes this host's other ranks keep free for their growth after placement: on CUDA (the compiler's
        workers, the driver: [Note: host reserve]), each as this process does; none on the CPU backend."""
        return other_processes_slack(self._ranks_per_host()) if self.on_cuda else 0

    def _host_groups(self) -> list[FlatGroup]:
        """The groups whose grads and optimizer states live in host memory: every flat group but the device groups;
        with several ranks, this rank's shares of them ([Note: sharded host state])."""
        if self.sharding is not None:
            return self.sharding.owned_groups
        return [g for g in self.flat_groups if all(d.group is not g for d in self.device_groups)]

    def _choose_memo(self, hf_config, shape, grad_accum, given, limits, again: bool) -> None:
        """``attention_memo="auto"`` for this micro-batch (engine/memo_choice.py ``choose_attention_memo``), switched on
        at the first placement only: ``keep_layers="auto"`` measured the GPU memory its kept layers may take at the
        first micro-batch, with or without the memos, and memos added later would come on top of them. A later
        placement may switch them off (they no longer fit or pay), except while a forward's memos still wait for its
        backward (manual optimization holding a graph across steps)."""
        if again and self.config.attention_memo is False:
            memo, why = False, ("off since the first micro-batch: the kept layers' GPU memory was measured there "
                                "without memos")
        else:
            memo, why = choose_attention_memo(
                hf_config, *shape, grad_accum, config=self.config.replace(attention_memo="auto", **given),
                limits=limits)
            pending = self.streamed.memo is not None and self.streamed.memo.pending
            if not memo and pending:
                memo, why = True, f"kept on while a forward's memos wait for its backward ({why})"
        log.info("MegaTrain: attention_memo=%s (auto: %s)", memo, why)
        self.config = self.config.replace(attention_memo=memo)
        self.streamed.use_memo(memo)

    def place_checkpoints(self, batch, grad_accum, optimizers, chunked_loss) -> None:
        """``attention_memo``, then ``segment_layers``, ``device_checkpoints`` and ``sub_segment_layers`` for the
        training micro-batch ``batch``: decided where "auto", the checkpoints checked against the free host and GPU
        memory where given ([Note: recompute segments]). Runs at the first micro-batch and again at any longer one
        (:meth:`checkpoints_outgrown`)."""
        shape = token_shape(batch)
        hf_config = module_hf_config(self.module)
        given = dict(zip(("segment_layers", "device_checkpoints", "sub_segment_layers"), self._checkpoint_options))
        auto = [name for name, value in given.items() if value == "auto"]
        if shape is None or hf_config is None:
            k, n, m = self.config.replace(**given).checkpoints_unplanned()
            why = "no [B, T] token ids in the batch" if shape is None else "no HF config in the module to plan with"
            if self.config.attention_memo == "auto":
                log.info("MegaTrain: attention_memo=False (auto: %s)", why)
                self.config = self.config.replace(attention_memo=False)
        else:
            host_groups = self._host_groups()
            again = self._placed_tokens > 0
            if again:
                log.info("MegaTrain: a micro-batch of %d x %d tokens, more than the %d the layer-input checkpoints "
                         "were placed for: placing them again", *shape, self._placed_tokens)
                self.wait_for_optimizer()  # an overlapped step may still be allocating host Adam states
            self._placed_tokens = shape[0] * shape[1]
            # the stash pool's pinned buffers, too small for a longer micro-batch, are freed before new ones are made;
            # the snapshots of the updates during backward give their memory back and size themselves again after
            pool = self.transfer.host_bytes().get("offload_cache", 0)
            if self.backward_updates is not None:
                pool += self.backward_updates.release()
            host_bytes = checkpoint_host_budget(host_groups, optimizers, self._ranks_per_host(),
                                                self._other_ranks_reserve()) + pool
            limits = PlacementLimits(self.compute_dtype, chunked_loss, torch.cuda.mem_get_info(self.device)[1],
                                     host_bytes)
            if self._memo_option == "auto":  # the memos first: the checkpoints are placed beside them
                self._choose_memo(hf_config, shape, grad_accum, given, limits, again)
            k, n, m, why = choose_checkpoints(hf_config, *shape, grad_accum, config=self.config.replace(**given),
                                              limits=limits)
        log.info("MegaTrain: segment_layers=%d, sub_segment_layers=%d, device_checkpoints=%d (%s: %s)", k, m, n,
                 "auto" if auto else "as given, checked", why)
        self.config = self.config.replace(segment_layers=k, device_checkpoints=n, sub_segment_layers=m)
        self.streamed.segments.configure(k, n, m)
