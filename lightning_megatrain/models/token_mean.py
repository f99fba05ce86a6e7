"""The token-weighted mean loss that validation and test report, accumulated on the device without reading it."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class TokenMean(Metric):
    """Sum of each batch's mean loss times its target tokens, over the sum of the tokens (``compute``: fp32 ``[]``).

    torchmetrics' ``MeanMetric`` does the same but reads the device twice per batch on a GPU (its NaN check's
    ``.any()``, and a Python weight copied to the device); here an update only queues two additions. A NaN loss makes
    the mean NaN instead of being dropped with a warning. Sums are fp64, so the mean of a long epoch stays exact to
    fp32. States sum across ranks.
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss: Tensor, tokens: Tensor | int) -> None:
        """Add a batch: its mean loss ``[]`` and its target tokens (an int counted on the host, or a tensor ``[]``)."""
        self.total += loss.detach().double() * tokens
        self.tokens += tokens

    def compute(self) -> Tensor:
        return (self.total / self.tokens).float()
