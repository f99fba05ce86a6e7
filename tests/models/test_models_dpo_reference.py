"""DPOModule's reference log-probabilities in a Trainer: kept in checkpoints with their data's fingerprint (a resumed
run does not recompute them from moved weights, nor uses them for other data), in a ``reference_cache`` file keyed by
model, seed, precision and data, and the errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_megatrain import MegaTrainStrategy
from lightning_megatrain.data import PairCollator
from lightning_megatrain.models.reference import compute_reference, fingerprint, load_cache

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


def test_resuming_on_other_pairs_of_the_same_size_is_refused(tmp_path):
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit_dpo("auto", tmp_path, steps=1, callbacks=[checkpoints], enable_checkpointing=True)
    with pytest.raises(ValueError, match=r"reference log-probabilities restored for the 'train' split were computed "
                                         r"on other pairs \(data fingerprint .*\): the dataset, its seed or split"):
        fit_dpo("auto", tmp_path, steps=2, datamodule=demo_pairs(tmp_path, seed=7),  # 16 + 4 other pairs
                ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))


class _SanityCheck(Callback):
    def on_sanity_check_end(self, trainer, pl_module):
        self.splits = set(pl_module.reference_logps)


def test_the_sanity_check_computes_every_split_before_validating(tmp_path):
    sanity = _SanityCheck()
    module, trainer = fit_dpo(MegaTrainStrategy(cpu_adam="torch"), tmp_path, steps=2, callbacks=[sanity],
                              num_sanity_val_steps=2, limit_val_batches=None, val_check_interval=2)
    assert sanity.splits == {"train", "val"}
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    assert set(module.reference_fingerprints) == {"train", "val"}


def test_reference_cache_is_written_then_read(tmp_path, monkeypatch):
    cache = tmp_path / "reference.pt"
    first, _ = fit_dpo("auto", tmp_path, steps=1, module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))
    assert cache.is_file()
    monkeypatch.setattr("lightning_megatrain.models.dpo.compute_reference",
                        lambda *a, **k: pytest.fail("the cached reference was recomputed"))
    second, _ = fit_dpo("auto", tmp_path, steps=1, module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))
    for split, table in first.reference_logps.items():
        assert torch.equal(second.reference_logps[split], table)


def test_reference_cache_is_read_with_other_batch_shapes(tmp_path, monkeypatch):
    cache = tmp_path / "reference.pt"
    first, _ = fit_dpo("auto", tmp_path, steps=1, module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))
    monkeypatch.setattr("lightning_megatrain.models.dpo.compute_reference",
                        lambda *a, **k: pytest.fail("the cached reference was recomputed"))
    data = demo_pairs(tmp_path, micro_batch_size=3, pad_to_multiple_of=16)  # the same pairs, padded otherwise
    second, _ = fit_dpo("auto", tmp_path, steps=1, datamodule=data,
                        module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))
    for split, table in first.reference_logps.items():
        assert torch.equal(second.reference_logps[split], table)


def test_reference_cache_is_written_by_global_rank_zero_only(tmp_path, monkeypatch):
    cache = tmp_path / "reference.pt"
    monkeypatch.setattr(Trainer, "is_global_zero", property(lambda self: False))
    module, _ = fit_dpo("auto", tmp_path, steps=1, module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))
    assert set(module.reference_logps) == {"train", "val"} and not cache.exists()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"data": {"cutoff_len": 40}}, r"reference_cache='.*reference.pt' holds other 'train' pairs \(data "
                                       r"fingerprint .*\): the dataset, split, tokenizer or cutoff_len changed"),
        ({"config": {"hidden_size": 16}}, r"reference_cache='.*reference.pt' was computed with model='\{.*\}', this "
                                          r"run has model='\{.*\}'; delete it"),
        ({"seed": 1}, r"reference_cache='.*reference.pt' was computed with seed=0, this run has seed=1; delete it"),
        ({"trainer": {"precision": "bf16-mixed"}}, r"reference_cache='.*reference.pt' was computed with "
                                                   r"precision='32-true', this run has precision='bf16-mixed'"),
    ],
)
def test_reference_cache_of_another_run_is_refused(tmp_path, change, match):
    cache = tmp_path / "reference.pt"
    fit_dpo("auto", tmp_path, steps=1, module=FusedAdamDPO(config=TINY_CONFIG, reference_cache=str(cache)))
    module = FusedAdamDPO(config={**TINY_CONFIG, **change.get("config", {})}, reference_cache=str(cache))
    with pytest.raises(ValueError, match=match):
        fit_dpo("auto", tmp_path, steps=1, datamodule=demo_pairs(tmp_path, **change.get("data", {})), module=module,
                seed=change.get("seed", 0), **change.get("trainer", {}))


def test_a_cache_of_another_version_is_refused(tmp_path):
    cache = tmp_path / "reference.pt"
    torch.save({"version": 1, "model": "m"}, cache)
    with pytest.raises(ValueError, match=r"reference_cache='.*reference.pt' is not a version-2 reference cache; "
                                         r"delete it"):
        load_cache(cache, {"model": "m", "seed": None, "precision": "32-true", "fingerprints": {}})


def _scorer(logps_per_batch):
    """A stand-in for a module: its strategy's ``predict_step`` gives each pair of a batch ``logps_per_batch``."""
    def predict_step(batch, batch_idx):
        pairs = len(batch["pair_index"])
        return {"chosen_logps": torch.full((pairs,), logps_per_batch), "rejected_logps": torch.zeros(pairs)}

    module = torch.nn.Module()
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(batch_to_device=lambda batch: batch,
                                                              predict_step=predict_step))
    return module


def test_compute_reference_refuses_batches_without_pair_index_and_pairs_left_without_a_value():
    no_index = DataLoader([0, 1], batch_size=2, collate_fn=lambda items: {"input_ids": torch.tensor(items)})
    with pytest.raises(ValueError, match=r"the 'train' loader's batches have no 'pair_index'; collate pairs with "
                                         r"PairCollator"):
        compute_reference(_scorer(-1.0), {"train": no_index})
    first_only = DataLoader([0, 1], batch_size=2, collate_fn=lambda items: {"pair_index": torch.tensor([0])})
    with pytest.raises(ValueError, match=r"1 of 2 'val' pairs got no value; each pair_index of the split must appear "
                                         r"once in 0..1"):
        compute_reference(_scorer(-1.0), {"val": first_only})


def test_fingerprint_hashes_pairs_unpadded_and_other_items_by_their_batches(tmp_path):
    data = demo_pairs(tmp_path)
    data.setup("fit")
    loaders = [DataLoader(data.train_dataset, batch_size=size, collate_fn=PairCollator(0, multiple))
               for size, multiple in ((2, None), (5, 64))]
    assert fingerprint(loaders[0]) == fingerprint(loaders[1])
    assert fingerprint(loaders[0]) != fingerprint(DataLoader(data.train_dataset[1:], collate_fn=PairCollator(0)))
    rows = lambda first: DataLoader([first, 2], batch_size=2, collate_fn=lambda items: {"ids": torch.tensor(items)})
    assert fingerprint(rows(1)) != fingerprint(rows(3))


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
