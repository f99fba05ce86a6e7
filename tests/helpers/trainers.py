"""A quiet one-step CPU ``Trainer`` for the strategy tests, and a callback recording each step's loss."""

from __future__ import annotations

import lightning as L


def cpu_trainer(**kwargs) -> L.Trainer:
    """``L.Trainer`` on one CPU device for one step, without logger, checkpoints, progress bar or model summary;
    ``kwargs`` override any of these."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


class StepLosses(L.Callback):
    """The loss after each optimizer step, by ``trainer.global_step`` (``by_step``); reads the loss only, so the
    overlapped step stays overlapped (``megatrain_reads_state = False``)."""

    megatrain_reads_state = False

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.by_step[trainer.global_step] = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
