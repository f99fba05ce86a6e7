"""CUDA: the "auto" recompute policy (engine/recompute.py) calibrating on the first micro-batch, then keeping layers.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from helpers.gpu import fit_cuda, gpu_strategy
from helpers.parity import ParityLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_auto_policy_keeps_every_layer_of_a_small_model_after_calibrating():
    class Check(L.Callback):
        def __init__(self):
            self.kept = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            streamed = trainer.strategy.engine.streamed
            self.kept.append((streamed.policy.calibrating, sorted(streamed.kept)))

    check = Check()
    module = ParityLM("llama_tied")
    layers = module.model.config.num_hidden_layers
    fit_cuda(gpu_strategy(), lambda: module, steps=3, callbacks=[check])
    assert check.kept[0] == (False, [])  # step 1: calibrated while recomputing every layer
    assert check.kept[1:] == [(False, list(range(layers)))] * 2
