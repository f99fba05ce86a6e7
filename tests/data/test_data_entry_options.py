"""LLaMA-Factory ``dataset_info.json`` entry options beyond the columns: ``num_samples`` and ``split``."""

from __future__ import annotations

from collections import Counter

import pytest

from lightning_megatrain.data import SFTDataModule
from lightning_megatrain.data.registry import resolve_datasets
from lightning_megatrain.data.sampling import sample_indices

ROWS = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(5)]


def _prompts(module: SFTDataModule) -> list[str]:
    return [conversation.messages[0]["content"] for conversation, _ in module._conversations()]


def test_sample_indices_takes_every_row_once_then_repeats_deterministically():
    assert sorted(sample_indices(5, 5, seed=1)) == list(range(5))
    fewer = sample_indices(5, 3, seed=1)
    assert len(set(fewer)) == 3
    more = sample_indices(5, 12, seed=1)
    assert len(more) == 12 and set(more) == set(range(5))  # every row at least once
    assert more == sample_indices(5, 12, seed=1)
    assert more != sample_indices(5, 12, seed=2)


@pytest.mark.parametrize("num_samples", [3, 12])
def test_num_samples_takes_that_many_rows_seeded(write_dataset, num_samples):
    dataset_dir = write_dataset("set", ROWS, {"num_samples": num_samples})
    other = write_dataset("other", ROWS)
    prompts = _prompts(SFTDataModule("set,other", dataset_dir=str(dataset_dir), seed=7))
    sampled, rest = prompts[:num_samples], prompts[num_samples:]
    assert len(sampled) == num_samples and rest == [row["instruction"] for row in ROWS]  # other set untouched
    assert set(Counter(sampled)) <= {row["instruction"] for row in ROWS}
    if num_samples > len(ROWS):
        assert set(sampled) == {row["instruction"] for row in ROWS}
    assert _prompts(SFTDataModule("set", dataset_dir=str(other), seed=7)) == sampled
    assert _prompts(SFTDataModule("set", dataset_dir=str(other), seed=8)) != sampled


@pytest.mark.parametrize("value", [0, -1, 2.5, "3", True])
def test_num_samples_must_be_a_positive_int(write_dataset, value):
    dataset_dir = write_dataset("set", ROWS, {"num_samples": value})
    specs, problems = resolve_datasets("set", dataset_dir)
    assert specs == [] and len(problems) == 1
    assert f"num_samples={value!r} must be an int >= 1" in problems[0]


def test_split_train_is_accepted(write_dataset):
    dataset_dir = write_dataset("set", ROWS, {"split": "train"})
    assert len(_prompts(SFTDataModule("set", dataset_dir=str(dataset_dir)))) == len(ROWS)


@pytest.mark.parametrize("split", ["validation", "test", None])
def test_split_other_than_train_is_refused_with_the_alternative(write_dataset, split):
    dataset_dir = write_dataset("set", ROWS, {"split": split})
    with pytest.raises(ValueError, match=rf"entry 'set': split={split!r}: a local file or folder has only the "
                                         r"'train' split .*register the other split's file as its own entry"):
        SFTDataModule("set", dataset_dir=str(dataset_dir))
