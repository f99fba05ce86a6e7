"""The optimizer step's contract with device groups, on CPU: stand-in device groups (the real ones need CUDA)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_megatrain.config import EngineConfig
from lightning_megatrain.engine import MegaTrainEngine
from lightning_megatrain.engine.optimizer_step import OptimizerStep


def _step(device_groups: list, **config) -> OptimizerStep:
    # transfer and residents are not reached by what these tests call
    step = OptimizerStep(EngineConfig(**config), torch.device("cpu"), [], None, None, None)
    step.set_device_groups(device_groups)
    return step


def _device_group() -> SimpleNamespace:
    return SimpleNamespace(group=SimpleNamespace(params=[]), clear_grads=mock.Mock())


def test_device_groups_take_adam_only_and_hook_zero_grad():
    params = [nn.Parameter(torch.zeros(2))]
    step = _step([_device_group()], gpu_optimizer_groups=1, cpu_adam="torch")
    assert step.steps_after_return  # device groups write their masters back when the host reads them
    with pytest.raises(ValueError, match=r"gpu_optimizer_groups=1\) steps Adam/AdamW on the GPU, got SGD"):
        step.to_host_optimizers([torch.optim.SGD(params, lr=0.1)], [])

    adamw = torch.optim.AdamW(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, lambda epoch: 1.0)
    (host,) = step.to_host_optimizers([adamw], [scheduler])
    assert all(group["fused"] for group in host.param_groups)  # cpu_adam="torch": torch's fused AdamW
    assert scheduler.optimizer is host and step.takes_step(host)
    host.zero_grad()  # hooked: waits for the host step in flight, then restarts the device groups' grad sums
    step.device_groups[0].clear_grads.assert_called_once_with()


def test_host_fallbacks_refused_with_device_groups():
    with pytest.raises(RuntimeError, match=r"gpu_optimizer_groups=1\) does not support gradient_clip_algorithm"):
        _step([_device_group()], gpu_optimizer_groups=1).refuse_host_fallback("gradient_clip_algorithm='value'")
    _step([]).refuse_host_fallback("gradient_clip_algorithm='value'")  # nothing on the GPU: torch's paths apply


def test_without_overlap_or_device_groups_the_step_is_lightnings():
    params = [nn.Parameter(torch.zeros(2))]
    step = _step([], cpu_adam="torch")
    (host,) = step.to_host_optimizers([torch.optim.AdamW(params, lr=0.1)], [])
    assert not step.steps_after_return and not step.takes_step(host)  # optimizer.step() runs, synchronously
    assert "zero_grad" not in vars(host)  # not hooked


def test_engine_step_exists_between_setup_and_teardown():
    engine = MegaTrainEngine(nn.Linear(1, 1), torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match=r"MegaTrainEngine.step exists between setup\(\) and teardown\(\)"):
        engine.step
    engine.wait_for_optimizer()  # a no-op before setup
