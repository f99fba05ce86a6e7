"""Exact resume: a run resumed from a checkpoint, mid-epoch (``SFTDataModule``'s resumable loader) or at an epoch
boundary, gives bitwise the losses and weights of the uninterrupted run, for each host Adam and with the optimizer
step overlapped or not ([Note: DeepSpeed's beta powers] in optim/host_optimizer.py; data/sampling.py's
``ResumableLoader``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.data import SFTDataModule
from lightning_megatrain.models import CausalLMModule

from helpers.trainers import StepLosses, cpu_trainer

STEPS = 5  # optimizer steps of the uninterrupted run: epochs of 3 batches (100 rows, micro-batches of 34)
CONFIG = dict(model_type="llama", vocab_size=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=64, tie_word_embeddings=False)  # no dropout: Lightning restores no RNG state



def _fit(root, cpu_adam, overlap, ckpt_path=None):
    L.seed_everything(0)
    # betas (0.9, 0.999): 0.999^3 as fp32 products is not pow(0.999, 3), so a resumed DeepSpeedCPUAdam that took one
    # where the uninterrupted run took the other differs from step 3 on ([Note: DeepSpeed's beta powers])
    module = CausalLMModule(config=CONFIG, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, betas=(0.9, 0.999))
    data = SFTDataModule(dataset="demo_messages", cutoff_len=48, micro_batch_size=34, seed=3)
    losses = StepLosses()
    every_step = ModelCheckpoint(dirpath=root, filename="step{step}", auto_insert_metric_name=False,
                                 every_n_train_steps=1, save_top_k=-1, save_last=True)
    strategy = MegaTrainStrategy(cpu_adam=cpu_adam, overlap_optimizer=overlap)
    trainer = cpu_trainer(strategy=strategy, max_steps=STEPS, max_epochs=-1, gradient_clip_val=1.0,
                          default_root_dir=root, enable_checkpointing=True, callbacks=[every_step, losses],
                          num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return losses.by_step, {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize(
    ("cpu_adam", "overlap", "starts"),
    [
        ("torch", False, (2, 3)),  # step 2: one batch into epoch 0's 3; step 3: the end of epoch 0
        ("torch", True, (2,)),
        ("deepspeed", False, (2,)),
        ("deepspeed", True, (2,)),
    ],
    ids=["torch-serial", "torch-overlapped", "deepspeed-serial", "deepspeed-overlapped"],
)
def test_resume_is_bitwise_the_uninterrupted_run(tmp_path, cpu_adam, overlap, starts, fast_cpuinfo):
    """Resumed mid-epoch (and, once, at an epoch's end), to 2 epochs' steps: the losses of every step after the
    checkpoint and the final weights equal the uninterrupted run's to the bit."""
    if cpu_adam == "deepspeed":
        from lightning_megatrain.optim import host_optimizer

        try:
            host_optimizer.to_host_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))]), "deepspeed")
        except RuntimeError as e:
            pytest.skip(f"DeepSpeedCPUAdam does not build here: {e}")
    losses, weights = _fit(tmp_path, cpu_adam, overlap)
    assert sorted(losses) == list(range(1, STEPS + 1))  # by the global step after each batch
    for start in starts:
        resumed_losses, resumed_weights = _fit(tmp_path / f"from{start}", cpu_adam, overlap,
                                               ckpt_path=tmp_path / f"step{start}.ckpt")
        assert resumed_losses == {k: v for k, v in losses.items() if k > start}, start
        for name, w in weights.items():
            assert torch.equal(resumed_weights[name], w), f"resumed from step {start}: {name}"
