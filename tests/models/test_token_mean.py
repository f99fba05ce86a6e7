"""TokenMean: validation's token-weighted mean loss, updated without reading the tensors it adds."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_megatrain.models.token_mean import TokenMean


def test_the_mean_weights_each_batch_by_its_tokens_and_reads_nothing(monkeypatch):
    metric = TokenMean()
    batches = [(torch.tensor(2.0), 3), (torch.tensor(1.0), torch.tensor(1)), (torch.tensor(0.5), 4)]
    with monkeypatch.context() as mp:  # an update must not read a tensor back (a sync on a GPU)
        for name in ("__bool__", "item", "tolist", "__float__", "__int__"):
            mp.setattr(torch.Tensor, name, lambda *a, _name=name: pytest.fail(f"update read a tensor ({_name})"))
        for loss, tokens in batches:
            metric.update(loss, tokens)
    assert float(metric.compute()) == pytest.approx((2.0 * 3 + 1.0 * 1 + 0.5 * 4) / 8)
    metric.reset()
    metric.update(torch.tensor(4.0), 2)
    assert float(metric.compute()) == 4.0


def test_a_nan_loss_makes_the_mean_nan():
    metric = TokenMean()
    metric.update(torch.tensor(1.0), 2)
    metric.update(torch.tensor(float("nan")), 2)
    assert math.isnan(float(metric.compute()))
