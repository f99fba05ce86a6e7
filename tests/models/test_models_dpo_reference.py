"""DPOModule's reference log-probabilities in a Trainer: kept in checkpoints (a resumed run does not recompute them
from moved weights), in a ``reference_cache`` file keyed by model, precision and data, and the errors."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.data import PairCollator

from helpers.preference import TINY_CONFIG, FusedAdamDPO, demo_pairs, fit_dpo

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers.*",
                                        "ignore:.*smaller than the logging interval.*")


def test_resuming_reads_the_reference_from_the_checkpoint(tmp_path, monkeypatch):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first, _ = fit_dpo(MegaTrainStrategy(cpu_adam="torch"), tmp_path, steps=2, callbacks=[checkpoints],
                       enable_checkpointing=True)
    monkeypatch.setattr("lightning_megatrain.models.dpo.compute_reference",
                        lambda *a, **k: pytest.fail("the resumed run recomputed the reference"))
    last = str(tmp_path / "ckpt" / "last.ckpt")
    resumed, trainer = fit_dpo(MegaTrainStrategy(cpu_adam="torch"), tmp_path, steps=3, ckpt_path=last)
    assert trainer.global_step == 3
    assert resumed.reference_logps.keys() == first.reference_logps.keys() == {"train", "val"}
    for split, table in first.reference_logps.items():
        assert torch.equal(resumed.reference_logps[split], table)


def test_resuming_on_other_data_is_refused(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit_dpo("auto", tmp_path, steps=1, callbacks=[checkpoints], enable_checkpointing=True)
    with pytest.raises(ValueError, match=r"reference log-probabilities restored for the 'train' split cover 16 pairs, "
                                         r"the datamodule's 'train' split has 26: the data changed"):
        fit_dpo("auto", tmp_path, steps=2, datamodule=demo_pairs(tmp_path, pairs=30),
                ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))


def test_reference_cache_is_written_then_read(tmp_path, monkeypatch):
    cache = tmp_path / "reference.pt"
    first, _ = fit_dpo("auto", tmp_path, steps=1, module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))
    assert cache.is_file()
    monkeypatch.setattr("lightning_megatrain.models.dpo.compute_reference",
                        lambda *a, **k: pytest.fail("the cached reference was recomputed"))
    second, _ = fit_dpo("auto", tmp_path, steps=1, module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))
    for split, table in first.reference_logps.items():
        assert torch.equal(second.reference_logps[split], table)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"cutoff_len": 40}, r"reference_cache='.*reference.pt' holds other 'train' pairs \(data fingerprint .*\): "
                             r"the dataset, split, tokenizer or cutoff_len changed; delete it"),
        ({"hidden_size": 16}, r"reference_cache='.*reference.pt' was computed with model='\{.*\}', this run has "
                              r"model='\{.*\}'; delete it"),
    ],
)
def test_reference_cache_of_another_run_is_refused(tmp_path, change, match):
    cache = tmp_path / "reference.pt"
    fit_dpo("auto", tmp_path, steps=1, module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))
    config = {**TINY_CONFIG, **{k: v for k, v in change.items() if k != "cutoff_len"}}
    data = demo_pairs(tmp_path, **{k: v for k, v in change.items() if k == "cutoff_len"})
    with pytest.raises(ValueError, match=match):
        fit_dpo("auto", tmp_path, steps=1, datamodule=data, module=FusedAdamDPO(config=config,
                                                                                reference_cache=str(cache)))


def test_a_file_that_is_not_a_cache_is_refused(tmp_path):
    cache = tmp_path / "reference.pt"
    cache.write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"reference_cache='.*reference.pt' is not a reference cache"):
        fit_dpo("auto", tmp_path, steps=1, module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))


def test_validate_alone_computes_the_held_out_reference(tmp_path):
    module = FusedAdamDPO(config=TINY_CONFIG)
    trainer = Trainer(accelerator="cpu", devices=1, strategy="megatrain", logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    (metrics,) = trainer.validate(module, datamodule=demo_pairs(tmp_path))
    assert set(module.reference_logps) == {"val"}  # not the training pairs
    assert metrics["val_loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert metrics["val_rewards/margins"] == 0


def test_batches_without_a_reference_are_refused(tmp_path):
    data = demo_pairs(tmp_path)
    data.setup("fit")
    loader = DataLoader(data.train_dataset, batch_size=2, collate_fn=PairCollator(0))  # no datamodule to ask
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"DPOModule\(loss_type='sigmoid'\) has no reference log-probabilities for "
                                         r"this train batch: .*\(PreferenceDataModule\), give batches "
                                         r"'reference_logps' \[B, 2\], or use a loss_type that needs no reference"):
        trainer.fit(FusedAdamDPO(config=TINY_CONFIG), loader)
