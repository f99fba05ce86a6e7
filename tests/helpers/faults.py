"""Faults for the all-or-nothing step tests (engine/optimizer_step.py, [Note: all-or-nothing steps]): a module whose
loss or gradients turn NaN at chosen micro-batches, snapshots of every parameter and optimizer state, and a short fit.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_megatrain import MegaTrainStrategy

from helpers.parity import MICRO_BATCH, ParityLM, make_data
from helpers.trainers import cpu_trainer


class _NaNGrad(torch.autograd.Function):
    """The identity forward; NaN gradients backward (a finite loss whose gradients are not)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class Faulty(ParityLM):
    """llama_tied (no dropout: runs with different batches stay comparable bit for bit) whose loss is NaN at the
    micro-batches in ``nan_loss``, whose gradients are NaN at those in ``nan_grad``, trained on the parity data without
    the micro-batches in ``drop``."""

    def __init__(self, nan_loss=(), nan_grad=(), drop=()):
        super().__init__("llama_tied")
        self.nan_loss, self.nan_grad, self.drop = set(nan_loss), set(nan_grad), set(drop)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx in self.nan_loss:
            loss = loss * float("nan")
        if batch_idx in self.nan_grad:
            loss = _NaNGrad.apply(loss)
        return loss

    def train_dataloader(self):
        data = make_data()
        keep = [i for i in range(len(data)) if i // MICRO_BATCH not in self.drop]
        return DataLoader(data[keep], batch_size=MICRO_BATCH, shuffle=False)


def state_of(trainer, module) -> dict:
    """Every parameter and every optimizer state entry, copied."""
    trainer.strategy.wait_for_optimizer()
    (optimizer,) = trainer.optimizers
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    states = {
        n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
        for n, p in module.named_parameters()
        if p in optimizer.state
    }
    return {"params": params, "states": states}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys() and a["states"].keys() == b["states"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    for name, state in a["states"].items():
        assert state.keys() == b["states"][name].keys(), name
        for key, value in state.items():
            other = b["states"][name][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (name, key)


class Snapshots(L.Callback):
    """The parameters and optimizer states after each optimizer step (``on_train_batch_end`` of its last
    micro-batch) and at train end."""

    def __init__(self):
        self.after_batch: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after_batch[batch_idx] = state_of(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self.final = state_of(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception):
        self.at_exception = state_of(trainer, pl_module)


def fit(module, steps, accumulate=1, clip=None, callbacks=(), checkpointing=False, accelerator="cpu", **strategy):
    """Train ``module`` for ``steps`` optimizer steps under ``MegaTrainStrategy(**strategy)``; the Trainer."""
    L.seed_everything(0)
    strategy = MegaTrainStrategy(**strategy)
    trainer = cpu_trainer(strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate,
                          gradient_clip_val=clip, callbacks=list(callbacks), enable_checkpointing=checkpointing,
                          accelerator=accelerator)
    trainer.fit(module)
    return trainer
