"""One tiny Llama fitted on CUDA with a checkpoint after every step, for the GPU exact-resume test and
benchmarks/determinism.py: bf16-mixed, clipping at 1.0, the demo messages in batches of 34 rows (3 per epoch, so step 2
is mid-epoch)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatrain.data import SFTDataModule
from lightning_megatrain.models import CausalLMModule

from helpers.trainers import StepLosses

CONFIG = dict(model_type="llama", vocab_size=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=64,
              intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False)


def fit_tiny_llama(root: str | Path, strategy: Callable[[], object], steps: int = 5,
                   ckpt_path: str | Path | None = None, fresh: bool = True,
                   ) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """(loss by step, final weights) of a fit under ``strategy()`` that checkpoints to ``root/step{N}.ckpt``; with
    ``fresh`` dynamo's compiled graphs are cleared first, as a new process starts."""
    if fresh:
        torch._dynamo.reset()
    L.seed_everything(0)
    module = CausalLMModule(config=CONFIG, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, betas=(0.9, 0.999))
    data = SFTDataModule(dataset="demo_messages", cutoff_len=48, micro_batch_size=34, seed=3)
    losses = StepLosses()
    every_step = ModelCheckpoint(dirpath=root, filename="step{step}", auto_insert_metric_name=False,
                                 every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(strategy=strategy(), accelerator="cuda", devices=1, precision="bf16-mixed",
                        max_steps=steps, max_epochs=-1, gradient_clip_val=1.0, default_root_dir=root,
                        callbacks=[every_step, losses], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return losses.by_step, {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
