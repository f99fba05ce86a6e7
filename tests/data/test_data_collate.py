"""Collation (padding, packing), bin packing, seeded split and deterministic shuffling."""

from __future__ import annotations

import torch
from transformers.masking_utils import find_packed_sequence_indices

from lightning_megatrain.data import IGNORE_INDEX, Example, PackedCollator, PadCollator, SFTDataModule, pack_examples
from lightning_megatrain.data.sampling import EpochShuffleSampler, ResumableLoader, split_indices

PAD = 0


def _example(ids: list[int], trained_from: int = 1) -> Example:
    return Example(ids, [IGNORE_INDEX] * trained_from + ids[trained_from:])


def test_pad_collator_right_pads_to_longest():
    batch = PadCollator(PAD)([_example([5, 6, 7]), _example([8, 9, 10, 11, 12], trained_from=3)])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.long and t.shape == (2, 5) for t in batch.values())
    assert batch["input_ids"].tolist() == [[5, 6, 7, PAD, PAD], [8, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100], [-100, -100, -100, 11, 12]]


def test_pad_to_multiple_of_rounds_up():
    batch = PadCollator(PAD, pad_to_multiple_of=4)([_example([5, 6, 7, 8, 9])])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3]
    assert batch["labels"][0, 5:].tolist() == [IGNORE_INDEX] * 3
    packed = PackedCollator(PAD, pad_to_multiple_of=4)([[_example([5, 6, 7])]])
    assert packed["input_ids"].shape == (1, 4)


def test_packed_collator_restarts_positions_and_masks_boundaries():
    rows = [[_example([11, 12, 13]), _example([21, 22]), _example([31, 32, 33, 34])],
            [_example([41, 42, 43, 44, 45], trained_from=0)]]
    batch = PackedCollator(PAD)(rows)
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no attention_mask: packing is read from positions
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34], [41, 42, 43, 44, 45, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # first token of every packed sequence is -100 (even when the example trained it), padding is -100
    assert batch["labels"].tolist() == [[-100, 12, 13, -100, 22, -100, 32, 33, 34],
                                        [-100, 42, 43, 44, 45, -100, -100, -100, -100]]
    # transformers derives the same sequence segmentation from position_ids (used by create_causal_mask)
    assert find_packed_sequence_indices(batch["position_ids"]).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2],
                                                                           [0, 0, 0, 0, 0, 1, 1, 1, 1]]


def test_pack_examples_best_fit_decreasing():
    examples = [_example(list(range(1, n + 1))) for n in (6, 4, 5, 5, 3, 7, 2)]
    rows = pack_examples(examples, capacity=10)
    assert [[len(e) for e in row] for row in rows] == [[7, 3], [6, 4], [5, 5], [2]]
    placed = sorted(id(e) for row in rows for e in row)
    assert placed == sorted(id(e) for e in examples)
    assert pack_examples(examples, capacity=10) == rows


def test_packing_datamodule_rows_fit_and_keep_every_example():
    plain = SFTDataModule("demo_messages", cutoff_len=128)
    packed = SFTDataModule("demo_messages", cutoff_len=128, packing=True, micro_batch_size=3)
    plain.setup()
    packed.setup()
    assert all(sum(len(e) for e in row) <= 128 for row in packed.train_dataset)
    assert sorted(e.input_ids for row in packed.train_dataset for e in row) == sorted(
        e.input_ids for e in plain.train_dataset)
    tokens = sum(len(e) for e in plain.train_dataset)
    assert len(packed.train_dataset) <= -(-tokens // 128) + 2  # within 2 rows of the lower bound
    batch = next(iter(packed.train_dataloader()))
    assert batch["input_ids"].shape[0] == 3 and batch["input_ids"].shape[1] <= 128
    starts = batch["position_ids"] == 0  # [B, T]
    assert (batch["labels"][starts] == IGNORE_INDEX).all()


def test_split_is_seeded_disjoint_and_sized():
    train, val = split_indices(50, 0.2, seed=3)
    assert (len(train), len(val)) == (40, 10) and sorted(train + val) == list(range(50))
    assert split_indices(50, 0.2, seed=3) == (train, val)
    assert split_indices(50, 0.2, seed=4) != (train, val)
    assert [len(part) for part in split_indices(50, 7, seed=3)] == [43, 7]
    assert split_indices(50, 0, seed=3)[1] == []


def test_val_dataloader_fixed_order_or_empty():
    module = SFTDataModule("demo_alpaca", val_size=20, micro_batch_size=8)
    module.setup()
    assert (len(module.train_dataset), len(module.val_dataset)) == (180, 20)
    first = [b["input_ids"].tolist() for b in module.val_dataloader()]
    assert first == [b["input_ids"].tolist() for b in module.val_dataloader()]
    assert len(first) == 3
    no_val = SFTDataModule("demo_alpaca")
    no_val.setup()
    assert no_val.val_dataloader() == []


def test_sampler_is_deterministic_per_seed_and_epoch():
    sampler = EpochShuffleSampler(100, seed=7)
    epoch0 = list(sampler)
    assert epoch0 == list(EpochShuffleSampler(100, seed=7)) and sorted(epoch0) == list(range(100))
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != epoch0 and sorted(epoch1) == list(range(100))
    sampler.set_epoch(0)
    assert list(sampler) == epoch0
    assert list(EpochShuffleSampler(100, seed=8)) != epoch0


def test_resumable_loader_resumes_at_the_next_batch_of_the_saved_epoch():
    """What Lightning does with the training loader: ``state_dict()`` when a checkpoint is saved after a batch,
    ``load_state_dict()`` on a new loader before the resumed run iterates (tests/strategy/test_exact_resume.py fits
    through it)."""
    from lightning.fabric.utilities.types import _Stateful

    def loader() -> ResumableLoader:
        return ResumableLoader(list(range(10)), batch_size=3, sampler=EpochShuffleSampler(10, seed=5))

    first = loader()
    assert isinstance(first, _Stateful)  # what Lightning checks before saving and restoring it
    first.sampler.set_epoch(1)
    batches = iter(first)
    epoch1 = [next(batches).tolist() for _ in range(2)]
    state = first.state_dict()
    assert state == {"epoch": 1, "batches": 2}
    epoch1 += [b.tolist() for b in batches]
    assert len(epoch1) == 4 and first.state_dict() == {"epoch": 1, "batches": 4}

    resumed = loader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(1)  # Lightning's set_epoch comes before the first batch
    assert [b.tolist() for b in resumed] == epoch1[2:]
    resumed.sampler.set_epoch(2)
    whole = loader()
    whole.sampler.set_epoch(2)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in whole]  # the next epoch starts at its first batch

    other_epoch = loader()  # a state of epoch 1 does not skip batches of another epoch (saved at an epoch's end)
    other_epoch.load_state_dict(state)
    other_epoch.sampler.set_epoch(2)
    assert [b.tolist() for b in other_epoch] == [b.tolist() for b in whole]


def _batches(module: SFTDataModule) -> list[list[list[int]]]:
    return [batch["input_ids"].tolist() for batch in module.train_dataloader()]


def test_train_batches_are_reproducible_and_seed_dependent():
    def make(seed: int, workers: int = 0) -> SFTDataModule:
        module = SFTDataModule("demo_sharegpt", micro_batch_size=4, val_size=0.1, seed=seed, num_workers=workers)
        module.setup()
        return module

    reference = _batches(make(1))
    assert reference == _batches(make(1))
    assert reference == _batches(make(1, workers=2))
    assert reference != _batches(make(2))
    module = make(1)
    loader = module.train_dataloader()
    loader.sampler.set_epoch(1)  # what Lightning does at the start of epoch 1
    assert [b["input_ids"].tolist() for b in loader] != reference
