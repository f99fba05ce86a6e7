"""CUDA: ``CausalLMModule`` validating under ``strategy="megatrain"`` with its metric states on the GPU.

Skipped without CUDA (CI); run on the GPU machine with ``python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_causal_lm_module_validates_on_the_gpu(tmp_path):
    # CausalLMModule's TokenMean states must follow the loss to the GPU (the module stays on the host)
    from lightning_megatrain.models import CausalLMModule

    config = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    module = CausalLMModule(config=config)
    data = torch.utils.data.DataLoader([{"input_ids": torch.randint(3, 128, (16,))} for _ in range(8)], batch_size=2)
    class Check(L.Callback):
        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self.device = pl_module.val_loss_mean.device  # Lightning's teardown moves the module to the CPU after

    check = Check()
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy="megatrain", max_steps=2, limit_val_batches=2,
                        val_check_interval=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, callbacks=[check])
    trainer.fit(module, data, data)
    assert check.device.type == "cuda"
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
