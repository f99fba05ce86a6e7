"""The checkpoint hooks of :class:`~lightning_megatrain.strategy.MegaTrainStrategy`: a save reads the host parameters
and optimizer states once the step in flight has updated them, with several ranks each rank's share going to its
shard file; a load reads either format (sharded_load.py; [Note: sharded checkpoints] in sharded_checkpoint.py) into
the host masters and the host optimizers, a chunk at a time ([Note: mapped checkpoint tensors] in mapped.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_megatrain.engine.shard_states import (
    PARAMS,
    load_module_state,
    load_optimizer_states,
    sharded_names,
    sharded_params,
)
from lightning_megatrain.mapped import read_into
from lightning_megatrain.ranks import RankStrategy
from lightning_megatrain.sharded_load import load_either_format

if TYPE_CHECKING:
    from lightning_megatrain.engine import MegaTrainEngine
    from lightning_megatrain.engine.sharding import ShardedState


class CheckpointStrategy(RankStrategy):
    """:class:`RankStrategy` with MegaTrain's checkpoint hooks (see the module docstring); the base of
    ``MegaTrainStrategy``, which sets the attributes annotated here."""

    engine: MegaTrainEngine | None  # built by MegaTrainStrategy.setup; None before it and after teardown
    _sharding: ShardedState | None  # this rank's shares with several ranks, kept past teardown

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.wait_for_optimizer()
        if self.engine is not None:
            self.engine.refuse_torn("save the parameters")  # a failed step left part of its update applied
        state = super().lightning_module_state_dict()
        if self._sharding is not None:  # the layers' owned masters go to each rank's shard file (sharded_params)
            names = sharded_names(self.lightning_module, self._sharding)
            state = {k: v for k, v in state.items() if k not in names}
        return state

    @override
    def sharded_params(self) -> dict[str, Any] | None:
        return sharded_params(self._sharding) if self._sharding is not None else None

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        self.wait_for_optimizer()
        if self._sharding is not None:  # this rank's slices and the manifest ([Note: checkpoints of several ranks])
            return self._sharding.optimizer_state(optimizer)
        # gpu_optimizer_groups' states stay on the GPU: the save writes them a piece at a time ([Note: atomic
        # checkpoints], [Note: sharded checkpoints])
        return super().optimizer_state(optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # ckpt_path="last" skips a checkpoint that does not load (checkpoint_io.py, [Note: resuming from a readable
        # checkpoint]); a sharded directory's meta.pt through the base class ([Note: sharded checkpoints])
        load = super().load_checkpoint
        module = self.lightning_module
        return load_either_format(lambda file: load(file, weights_only=weights_only), checkpoint_path, module,
                                  self.resume_agreement())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.wait_for_optimizer()
        if self._sharding is not None or PARAMS in checkpoint:  # several ranks save or load the layers' masters
            # sharded ([Note: sharded layer masters]); with several ranks the rest loads non-strict, checked there
            checkpoint = load_module_state(self.lightning_module, checkpoint, self._sharding, strict)
            strict = strict and self._sharding is None
        read_into(checkpoint["state_dict"], self.lightning_module.state_dict())  # a mapped checkpoint's, in place
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.engine is not None:
            self.engine.reload_masters()

    def wait_for_optimizer(self) -> None:
        """Block until the host parameters and optimizer states hold the last optimizer step: the overlapped host
        step finished and ``gpu_optimizer_groups`` written back. Lightning's own readers (checkpoints, validation,
        epoch and train end) and every user hook that may read parameters already wait (hooks.py, [Note: user
        hooks]); call it before reading parameters elsewhere (inside ``training_step``, from another thread)."""
        if self.engine is not None:
            self.engine.wait_for_optimizer()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # The base class would move the states to root_device; they belong with the host masters.
        self.wait_for_optimizer()
        # any number of ranks from any number of ranks ([Note: checkpoints of several ranks])
        load_optimizer_states(self.optimizers, checkpoint["optimizer_states"], self._sharding, self.lightning_module)
        if self.engine is not None:  # mapped states into place once the device groups are known ([Note: mapped
            self.engine.settle_loaded_states(self.optimizers)  # checkpoint tensors] in mapped.py)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore into the packed host masters and the host optimizer, which exist only after setup.
        return True
