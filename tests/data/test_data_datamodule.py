"""SFTDataModule end to end: defaults, batch format, several datasets, test/predict data, docstring, a short fit."""

from __future__ import annotations

import inspect
import math

import lightning as L
import pytest
import torch
from torch.utils.data import SequentialSampler
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


def test_test_and_predict_dataloaders_serve_the_held_out_split_in_order():
    module = SFTDataModule("demo_alpaca", val_size=20, micro_batch_size=8)
    for stage in ("test", "predict"):
        module.setup(stage)
    val = [batch["input_ids"].tolist() for batch in module.val_dataloader()]
    for loader in (module.test_dataloader(), module.predict_dataloader()):
        assert isinstance(loader.sampler, SequentialSampler) and loader.batch_size == 8
        assert [batch["input_ids"].tolist() for batch in loader] == val
    rows = [row for batch in module.predict_dataloader() for row in batch["input_ids"].tolist()]
    assert len(rows) == 20
    assert [row[: len(example.input_ids)] for row, example in zip(rows, module.val_dataset)] == [
        example.input_ids for example in module.val_dataset
    ]  # row i of the predictions is val_dataset[i]


@pytest.mark.parametrize("stage", ["test", "predict"])
@pytest.mark.parametrize("val_size", [0, 0.001])  # none held out, or a fraction that rounds to no row
def test_test_and_predict_refuse_an_empty_held_out_split(stage, val_size):
    module = SFTDataModule("demo_alpaca", val_size=val_size)
    message = (rf"SFTDataModule: 1 invalid argument\(s\):\n  - val_size={val_size}: {stage} runs on the held-out rows, "
               r"but none are held out .*set val_size > 0")
    with pytest.raises(RuntimeError, match=rf"setup\(\) must run before {stage}_dataloader\(\)"):
        getattr(module, f"{stage}_dataloader")()
    with pytest.raises(ValueError, match=message):
        module.setup(stage)
    module.setup("fit")  # training needs no held-out rows
    with pytest.raises(ValueError, match=message):
        getattr(module, f"{stage}_dataloader")()
    with pytest.raises(ValueError, match=message):
        module.setup(stage)  # also once the data is prepared


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
