"""A quiet one-step CPU ``Trainer`` for the strategy tests."""

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
