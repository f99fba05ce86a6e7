"""``skip_bad_rows``: opt-in dropping of malformed rows, counted in one warning; the default stays strict."""

from __future__ import annotations

import logging

import pytest

from lightning_megatrain.data import DatasetFormatError, SFTDataModule

GOOD = {"instruction": "q", "output": "a"}


def test_default_is_strict(write_dataset):
    module = SFTDataModule("set", dataset_dir=str(write_dataset("set", [GOOD, {"instruction": "q"}])))
    with pytest.raises(DatasetFormatError, match=r"1 malformed row\(s\) of 2"):
        module.setup()


def test_bad_rows_are_dropped_with_one_warning(write_dataset, caplog):
    bad = [{"instruction": "q"}, {"output": "a"}, {"instruction": 3, "output": "a"}, "not an object"]
    dataset_dir = write_dataset("set", [GOOD, *bad[:2], GOOD, *bad[2:]], suffix=".jsonl")
    with (dataset_dir / "set.jsonl").open("a", encoding="utf-8") as handle:
        handle.write("{broken json\n")
    extra = [{"instruction": "q"}] * 7
    write_dataset("more", [GOOD, *extra])
    module = SFTDataModule("set,more", dataset_dir=str(dataset_dir), skip_bad_rows=True)
    with caplog.at_level(logging.WARNING, logger="lightning_megatrain.data.datamodule"):
        module.setup()
    assert len(module.train_dataset) == 3
    warnings = [r.getMessage() for r in caplog.records if "skip_bad_rows" in r.getMessage()]
    assert len(warnings) == 1
    message = warnings[0]
    assert message.startswith("skip_bad_rows=True: skipped 12 malformed row(s) (3 kept); the first 5:")
    assert "set.jsonl, line 7: not valid JSON" in message
    assert "set.jsonl, row 5 is a str, expected an object" in message
    assert "set.jsonl, row 1: missing column 'output'" in message
    assert "more.json" not in message  # only the first reasons are shown


def test_skip_bad_rows_must_be_a_bool():
    with pytest.raises(ValueError, match=r"skip_bad_rows='yes': must be True or False"):
        SFTDataModule(skip_bad_rows="yes")
