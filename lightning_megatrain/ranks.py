"""The Lightning contract for one or several ranks: launcher, process group, sampler, barrier, broadcast, reduce.

:class:`RankStrategy` is the base of ``MegaTrainStrategy``. With one device (``world_size == 1``) it behaves as
Lightning's ``SingleDeviceStrategy``: no launcher, no process group, and ``barrier``/``broadcast``/``reduce`` are the
identity. With ``devices=N`` (and ``num_nodes=M``) it does what ``DDPStrategy`` does for the processes: Lightning's
``_SubprocessScriptLauncher`` starts them (or ``torchrun``/SLURM did, which the cluster environment detects),
``setup_environment`` joins the process group (NCCL for CUDA devices, gloo on the CPU), the Trainer adds a
``DistributedSampler`` (``distributed_sampler_kwargs``), and barrier, broadcast and reduce go through
``torch.distributed``. No model wrapper: the engine does the gradient reduction itself, per layer, on the shards it
owns (engine/sharding.py, [Note: sharded host state]). A checkpoint is written by rank 0, with each rank's layer
masters and optimizer slices in a shard file of its own beside it; no checkpoint is saved after an exception; the
ranks resume from one checkpoint (engine/shard_states.py, [Note: checkpoints of several ranks]).
"""

from __future__ import annotations

import logging
import warnings
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_megatrain.checkpoint_io import Agreement
from lightning_megatrain.config import Auto
from lightning_megatrain.cpu_binding import Binding, bind_rank
from lightning_megatrain.engine.collectives import Ranks
from lightning_megatrain.engine.shard_states import shard_path, split_checkpoint

log = logging.getLogger(__name__)


def binds_cpus(option: bool | Auto, environment: ClusterEnvironment) -> bool:
    """Whether ``cpu_binding=option`` binds the ranks started under ``environment``: ``"auto"`` under Lightning's own
    (its launcher, or ranks started by hand as it starts them), not under torchrun's or SLURM's, which bind with their
    own flags ([Note: rank CPU binding])."""
    return type(environment) is LightningEnvironment if option == "auto" else bool(option)


class RankStrategy(ParallelStrategy):
    """One process per device, single-device behaviour when there is one (see the module docstring).

    Args:
        accelerator, checkpoint_io, precision_plugin: as for any Lightning strategy.
        cluster_environment: set by the Trainer (``LightningEnvironment``, ``TorchElasticEnvironment``, SLURM ...).
        process_group_backend: ``None`` (default): ``"nccl"`` for CUDA devices, ``"gloo"`` for the CPU.
        timeout: of the process group's collectives (Lightning's default: 30 minutes).
        cpu_binding: bind each rank of a host to cores of its own, near its GPU (cpu_binding.py, [Note: rank CPU
            binding]); ``"auto"`` (default): under Lightning's own cluster environment (its launcher started the
            ranks, or they were started by hand as it starts them), not under torchrun or SLURM, which bind with
            their own flags; ``True``: always; ``False``: never. One rank is never bound.

    Raises:
        ValueError: ``cpu_binding`` not True, False or "auto".
    """

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_binding: bool | Auto = "auto",
    ) -> None:
        if not isinstance(cpu_binding, bool) and cpu_binding != "auto":
            raise ValueError(f"cpu_binding={cpu_binding!r}: need 'auto', True or False")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=None,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._cpu_binding = cpu_binding
        self.cpu_bound: Binding | None = None  # this rank's cores, once bound (setup_environment)
        self.ranks: Ranks | None = None  # the engine's view of the process group, when world_size > 1
        self._saved: list[str] = []  # checkpoints this run saved on every rank, oldest first (removed ones dropped)

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            return torch.device("cpu")
        return torch.device(self.parallel_devices[self.local_rank if self.distributed else 0])

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def distributed(self) -> bool:
        """Whether this run has more than one process (``devices * num_nodes > 1``)."""
        return self.num_nodes * self.num_processes > 1

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's accelerator connector: a ``DistributedSampler`` is added when True."""
        return self.distributed

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """Global rank and world size from the node rank, the local rank and the devices (as ``DDPStrategy``)."""
        if not self.distributed:
            return
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        # one process per device, started by Lightning unless the cluster environment started them (torchrun, SLURM)
        if self.distributed:
            assert self.cluster_environment is not None
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if not self.distributed:
            return
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        if binds_cpus(self._cpu_binding, self.cluster_environment) and self.num_processes > 1:
            self.cpu_bound = bind_rank(self.local_rank, list(self.parallel_devices or []))
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        self.ranks = Ranks.from_default_group(per_host=self.num_processes)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.distributed or not _distributed_is_initialized():
            return
        if self._interrupted():  # the other ranks may never get here ([Note: checkpoints of several ranks])
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not self.distributed or not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not self.distributed or not isinstance(tensor, Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if not self.distributed:
            return tensor
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @property
    @override
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        # several ranks: rank 0 writes the checkpoint with manifests, every rank its shard file; none after an
        # exception ([Note: checkpoints of several ranks])
        if self.distributed and self._interrupted():
            warnings.warn(self._unsaved_after_exception(filepath), stacklevel=2)
            return
        main, shard = split_checkpoint(checkpoint, filepath, self.sharded_params())
        if shard:
            self.checkpoint_io.save_checkpoint(shard, shard_path(filepath, self.global_rank, self.world_size))
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(main, filepath, storage_options=storage_options)
        self.barrier("save_checkpoint")  # past it, every rank's file of this save is in place
        self._saved = [p for p in self._saved if p != str(filepath)] + [str(filepath)]

    def sharded_params(self) -> dict[str, Any] | None:
        """This rank's share of the parameters for its shard file (engine/shard_states.py ``sharded_params``); None:
        the parameters are whole in the checkpoint's ``state_dict``."""
        return None

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        self._saved = [p for p in self._saved if p != str(filepath)]
        if self.distributed:
            self.checkpoint_io.remove_checkpoint(shard_path(filepath, self.global_rank, self.world_size))

    def resume_agreement(self) -> Agreement:
        """How the ranks agree on the checkpoint they resume from (checkpoint_io.py, [Note: resuming from a readable
        checkpoint]): rank 0's choice broadcast, every rank's outcome gathered, over the host group (gloo)."""
        if not self.distributed or self.ranks is None:
            return Agreement()
        group = self.ranks.host_group

        def decide(obj: Any) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=0, group=group)
            return box[0]

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, obj, group=group)
            return out

        return Agreement(self.world_size, decide, gather)

    def _interrupted(self) -> bool:
        """Whether an exception is being handled (Lightning's ``_interrupt`` sets the status before it calls the
        ``on_exception`` hooks)."""
        trainer = getattr(self._lightning_module, "_trainer", None)
        return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED

    def _unsaved_after_exception(self, filepath: _PATH) -> str:
        trainer = getattr(self._lightning_module, "_trainer", None)
        if self._saved:
            last = f"The last complete checkpoint of this run is {self._saved[-1]}"
        elif trainer is not None and trainer.ckpt_path is not None:
            last = f"This run saved no checkpoint; it resumed from {trainer.ckpt_path}"
        else:
            last = "This run saved no checkpoint"
        return (
            f"MegaTrainStrategy with {self.world_size} ranks did not save {filepath} after an exception: a checkpoint "
            f"needs every rank's shard file, and rank {self.global_rank} cannot reach the other ranks now (they may be "
            f"inside a collective, or past the step it failed at). {last}. HINT: resume with ckpt_path='last' or that "
            "checkpoint; save more often (ModelCheckpoint(every_n_train_steps=...)) to lose fewer steps."
        )

    @override
    def on_predict_start(self) -> None:
        # Lightning splits predict data without padding (UnrepeatedDistributedSamplerWrapper): a rank with fewer
        # batches would leave the others waiting in a layer's gather ([Note: sharded layer masters])
        super().on_predict_start()
        if not self.distributed or self.ranks is None:
            return
        counts: list[Any] = [None] * self.world_size
        mine = list(self.lightning_module.trainer.num_predict_batches)  # per predict dataloader, after the limits
        dist.all_gather_object(counts, mine, group=self.ranks.host_group)
        if any(c != counts[0] for c in counts):
            raise ValueError(
                f"MegaTrainStrategy with {self.world_size} ranks runs each layer on every rank together (a layer is "
                f"gathered from all ranks), but the predict batches per rank differ: {counts} (Lightning splits "
                "predict data over the ranks without padding). HINT: use a number of predict samples divisible by "
                "the number of ranks times the batch size, or predict with devices=1."
            )

    @override
    def teardown(self) -> None:
        if self.distributed and self.cluster_environment is not None:
            self.cluster_environment.teardown()
        # ParallelStrategy.teardown asserts a cluster environment, which a one-device run may lack
        super(ParallelStrategy, self).teardown()
