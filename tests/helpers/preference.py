"""A tiny DPO run on the bundled demo preference pairs (CPU, fp32), for the strategy and reference tests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_megatrain.data import DEMO_DIR, PreferenceDataModule
from lightning_megatrain.models import DPOModule

# A tiny Llama over the demo tokenizer's 1024 tokens (ids 0/1/2 = pad/bos/eos).
TINY_CONFIG = {
    "model_type": "llama", "vocab_size": 1024, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


class FusedAdamDPO(DPOModule):
    """``DPOModule`` with torch's fused AdamW: the kernel ``MegaTrainStrategy(cpu_adam="torch")`` runs, so the two
    strategies update identically (tests/strategy/test_parity.py's exact-kernel comparison)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def demo_pairs(folder: Path, pairs: int = 20, **kwargs: Any) -> PreferenceDataModule:
    """``pairs`` of the bundled alpaca pairs (registered in ``folder`` with ``num_samples``), 2 per micro-batch, 4 of
    them held out."""
    entry = json.loads((DEMO_DIR / "dataset_info.json").read_text())["demo_dpo_alpaca"]
    entry = {**entry, "file_name": str(DEMO_DIR / entry["file_name"]), "num_samples": pairs}
    (folder / "dataset_info.json").write_text(json.dumps({"pairs": entry}))
    return PreferenceDataModule("pairs", dataset_dir=str(folder), **{"micro_batch_size": 2, "val_size": 4,
                                                                      "cutoff_len": 128, **kwargs})


def fit_dpo(
    strategy: Any,
    folder: Path,
    *,
    steps: int = 2,
    callbacks: Sequence[Callback] = (),
    datamodule: PreferenceDataModule | None = None,
    module: DPOModule | None = None,
    ckpt_path: str | None = None,
    seed: int = 0,
    **trainer_kwargs: Any,
) -> tuple[DPOModule, Trainer]:
    """Fit ``module`` (default: a ``FusedAdamDPO`` of the tiny Llama) on ``datamodule`` (default :func:`demo_pairs`
    registered in ``folder``) for ``steps`` optimizer steps under ``strategy``, after ``seed_everything(seed)``."""
    seed_everything(seed, verbose=False)
    module = module if module is not None else FusedAdamDPO(config=TINY_CONFIG)
    trainer = Trainer(**{
        "accelerator": "cpu", "devices": 1, "strategy": strategy, "max_steps": steps, "precision": "32-true",
        "callbacks": list(callbacks), "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0,
        # deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG set before CUDA starts (as helpers.parity.run)
        "deterministic": trainer_kwargs.get("accelerator", "cpu") == "cpu", **trainer_kwargs,
    })
    trainer.fit(module, datamodule=datamodule if datamodule is not None else demo_pairs(folder), ckpt_path=ckpt_path)
    return module, trainer
