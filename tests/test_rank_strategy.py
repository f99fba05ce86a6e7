"""ranks.py's Lightning contract without processes: one device behaves as Lightning's single-device strategy,
``devices=N`` configures Lightning's own launcher and distributed sampler."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from lightning_megatrain import MegaTrainStrategy


def _trainer(devices: int) -> Trainer:
    return Trainer(strategy=MegaTrainStrategy(), accelerator="cpu", devices=devices, logger=False)


def test_one_device_is_single_device():
    strategy = _trainer(1).strategy
    assert strategy.launcher is None and not strategy.is_distributed and strategy.ranks is None
    assert strategy.world_size == 1 and strategy.global_rank == 0 and strategy.is_global_zero
    assert strategy.root_device == torch.device("cpu")
    x = torch.ones(2)
    assert strategy.reduce(x) is x and strategy.all_gather(x) is x and strategy.broadcast("a") == "a"
    strategy.barrier()  # no process group: a no-op


def test_several_devices_use_lightnings_launcher_and_sampler():
    trainer = _trainer(3)
    strategy = trainer.strategy
    assert isinstance(strategy.launcher, _SubprocessScriptLauncher) and strategy.is_distributed
    assert strategy.world_size == 3 and strategy.num_processes == 3
    assert trainer.distributed_sampler_kwargs == {"num_replicas": 3, "rank": 0}
    assert trainer._accelerator_connector.is_distributed
