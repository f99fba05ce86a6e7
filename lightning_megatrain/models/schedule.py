"""The optimizer ``CausalLMModule`` configures: AdamW with decay / no-decay groups and a per-step linear warmup then
cosine decay of the learning rate."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine_factor(
    step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to ``min_lr_ratio``.

    ``(step + 1) / warmup_steps`` for ``step < warmup_steps``; afterwards
    ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = min(1, (step - warmup_steps) / max(1, total_steps - warmup_steps))``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_warmup_cosine(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    total_steps: float,
    *,
    learning_rate: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    warmup_steps: int,
    min_lr_ratio: float,
) -> dict[str, Any]:
    """``configure_optimizers``' return value: AdamW over the parameters that require grad, ``weight_decay`` for the
    matrices and none for biases and 1-D parameters, and :func:`warmup_cosine_factor` stepped every optimizer step
    over ``total_steps`` (``trainer.estimated_stepping_batches``).

    Raises:
        ValueError: ``total_steps`` is not finite.
    """
    decay, no_decay = [], []
    for name, param in named_parameters:
        if param.requires_grad:
            (no_decay if param.ndim < 2 or name.endswith("bias") else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=learning_rate,
        betas=betas,
        eps=eps,
    )
    if not math.isfinite(total_steps):
        raise ValueError(
            "The cosine schedule needs a finite number of optimizer steps, but "
            f"trainer.estimated_stepping_batches={total_steps}; set Trainer(max_steps=...) "
            "or max_epochs."
        )
    schedule = partial(
        warmup_cosine_factor,
        warmup_steps=warmup_steps,
        total_steps=int(total_steps),
        min_lr_ratio=min_lr_ratio,
    )
    return {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
    }
