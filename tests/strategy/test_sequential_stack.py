"""A decoder stack held in an ``nn.Sequential`` (found by discovery, streamed like a ModuleList) trains as plain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.engine import find_layer_stack

from helpers.parity import TinyStackLM, assert_records_close, run


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))  # [B, T, W]


class Net(TinyStackLM):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Sequential(*(Block(16) for _ in range(3))))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.head(self.blocks(self.embed(batch)))  # [B, T, V]
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())



def _run(strategy):
    return run(strategy, None, module=Net)  # 3 steps, seeded, fp32 on the CPU (helpers/parity.py)


def test_sequential_stack_is_discovered():
    net = Net()
    assert find_layer_stack(net) == ("blocks", net.blocks)
    assert find_layer_stack(net, "blocks") == ("blocks", net.blocks)
    with pytest.raises(ValueError, match=r"layers='head'\) does not name a non-empty nn.ModuleList or nn.Sequential"):
        find_layer_stack(net, "head")


@pytest.mark.parametrize("layers", [None, "blocks"])
def test_sequential_stack_matches_plain(layers):
    ref = _run("auto")
    got = _run(MegaTrainStrategy(layers=layers, cpu_adam="torch"))
    assert_records_close(got, ref)
