"""CUDA: exact resume with the defaults. A run resumed mid-epoch from a checkpoint gives bitwise the losses and
weights of the uninterrupted run, under ``strategy="megatrain"`` with no options (compiled layers, the overlapped
host step and its default host Adam, ``keep_layers`` and ``gpu_optimizer_groups`` chosen by the engine) and with
DeepSpeedCPUAdam asked for by name, in bf16-mixed.

SDPA runs its math backend here: the fused attention backwards may add in a varying order, and then two
uninterrupted runs would differ as well. Skipped without CUDA (CI); run on the GPU machine with
``python -m pytest -m gpu tests/strategy/test_gpu_exact_resume.py``.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.data import SFTDataModule
from lightning_megatrain.models import CausalLMModule

from helpers.trainers import StepLosses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 5  # epochs of 3 batches: step 2 is mid-epoch
CONFIG = dict(model_type="llama", vocab_size=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64,
              intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False)



def _fit(root, strategy, ckpt_path=None):
    L.seed_everything(0)
    module = CausalLMModule(config=CONFIG, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, betas=(0.9, 0.999))
    data = SFTDataModule(dataset="demo_messages", cutoff_len=48, micro_batch_size=34, seed=3)
    losses = StepLosses()
    every_step = ModelCheckpoint(dirpath=root, filename="step{step}", auto_insert_metric_name=False,
                                 every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(strategy=strategy(), accelerator="cuda", devices=1, precision="bf16-mixed",
                        max_steps=STEPS, max_epochs=-1, gradient_clip_val=1.0, default_root_dir=root,
                        callbacks=[every_step, losses], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return losses.by_step, {n: p.detach().cpu().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("strategy", [lambda: "megatrain", lambda: MegaTrainStrategy(cpu_adam="deepspeed")],
                         ids=["defaults", "deepspeed"])
def test_resume_mid_epoch_is_bitwise_the_uninterrupted_run(tmp_path, strategy):
    with sdpa_kernel(SDPBackend.MATH):
        losses, weights = _fit(tmp_path / "a", strategy)
        again_losses, again_weights = _fit(tmp_path / "b", strategy)
        # the bar below needs deterministic kernels: two uninterrupted runs must agree first
        assert again_losses == losses
        assert all(torch.equal(again_weights[n], w) for n, w in weights.items())
        resumed_losses, resumed_weights = _fit(tmp_path / "c", strategy, ckpt_path=tmp_path / "a" / "step2.ckpt")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert resumed_losses == {k: v for k, v in losses.items() if k > 2}
    for name, w in weights.items():
        assert torch.equal(resumed_weights[name], w), name
