"""SFTDataModule end to end: defaults, batch format, several datasets, docstring, a short Lightning fit."""

from __future__ import annotations

import inspect
import math

import lightning as L
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_megatrain.data import IGNORE_INDEX, SFTDataModule


def test_defaults_use_the_bundled_demo():
    module = SFTDataModule()
    module.setup("fit")
    batch = next(iter(module.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == 1 and batch["input_ids"].dtype == torch.long
    assert len(module.train_dataset) == 200 and module.val_dataloader() == []
    assert module.pad_token_id == module.tokenizer.pad_token_id == 0


def test_comma_separated_datasets_are_concatenated():
    module = SFTDataModule(" demo_alpaca , demo_sharegpt,demo_messages", val_size=0.25, packing=True, cutoff_len=512)
    module.setup()
    assert sum(map(len, module.train_dataset)) + sum(map(len, module.val_dataset)) == 400
    assert sum(map(len, module.val_dataset)) == 100
    batch = next(iter(module.val_dataloader()))
    assert set(batch) == {"input_ids", "position_ids", "labels"}


def test_setup_is_idempotent():
    module = SFTDataModule("demo_messages")
    module.setup("fit")
    first = module.train_dataset
    module.setup("validate")
    assert module.train_dataset is first


def test_docstring_documents_every_argument():
    doc = inspect.getdoc(SFTDataModule)
    args = doc.split("Args:\n", 1)[1]
    for name in inspect.signature(SFTDataModule.__init__).parameters:
        if name != "self":
            assert f"\n    {name}: " in f"\n{args}", name
    assert "Default" in args


class _TinyLM(L.LightningModule):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        self.model = LlamaForCausalLM(config)
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert (batch["labels"] != IGNORE_INDEX).any()
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, batch_size=batch["input_ids"].shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_short_lightning_fit_with_packing_and_validation():
    module = SFTDataModule("demo_messages", packing=True, cutoff_len=64, micro_batch_size=2, val_size=0.1)
    model = _TinyLM(len(module.tokenizer))
    trainer = L.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, datamodule=module)
    assert len(model.losses) == 4 and all(math.isfinite(loss) for loss in model.losses)
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))
    assert trainer.train_dataloader.sampler.epoch == 1  # Lightning advanced the shuffling epoch
