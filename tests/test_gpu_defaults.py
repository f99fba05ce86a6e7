"""CUDA: ``MegaTrainStrategy()`` with its defaults (compiled layers, the overlapped step, device groups placed before
the first training micro-batch) against plain GPU training.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.engine import first_batch

from helpers.gpu import fit_cuda
from helpers.parity import ParityLM, assert_records_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("groups", [None, 2])
def test_cuda_defaults_parity(groups, monkeypatch, caplog):
    torch._dynamo.reset()
    # MegaTrainStrategy() on CUDA: compiled layers, the overlapped step, device groups decided before the first
    # training micro-batch (after the sanity validation ran on the engine without them); None: the planner's own
    # choice for the tiny model, 2: forced, so that the late placement path runs
    torch.backends.cuda.matmul.allow_tf32 = False
    if groups is not None:
        monkeypatch.setattr(first_batch, "choose_gpu_optimizer_groups",
                            lambda *a, **k: (groups, "forced by the test"))
    ref, _ = fit_cuda("auto", lambda: ParityLM("llama_untied"), accumulate=2, clip=1.0)

    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            config = trainer.strategy.engine.config
            self.choices = (config.compile_layers, config.overlap_optimizer, config.gpu_optimizer_groups)

    check = Check()
    with caplog.at_level("INFO", logger="lightning_megatrain"):
        got, _ = fit_cuda(MegaTrainStrategy(cpu_adam="torch"), lambda: ParityLM("llama_untied"), accumulate=2,
                           clip=1.0, callbacks=[check])
    assert check.choices[:2] == (True, True) and (groups is None or check.choices[2] == groups)
    assert all(f"{k}=" in caplog.text for k in ("compile_layers", "overlap_optimizer", "gpu_optimizer_groups"))
    assert_records_close(got, ref, rtol=1e-4, rtol_updated=1e-3)  # compiled layers: as test_cuda_compiled_layers_parity
