"""Local file formats: json, jsonl, csv (pandas), parquet (pyarrow), folders and read errors."""

from __future__ import annotations

import json
import sys

import pytest

from lightning_megatrain.data import SFTDataModule
from lightning_megatrain.data.readers import read_rows

MESSAGES = [
    [{"role": "system", "content": "s"}, {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
]
ALPACA = [
    {"instruction": "Add.", "input": "1 2", "output": "3"},
    {"instruction": "Say hi.", "input": "", "output": "hi"},
]


def _input_ids(module: SFTDataModule) -> list[list[int]]:
    module.setup()
    return sorted(example.input_ids for example in module.train_dataset)


@pytest.fixture
def reference_ids(tmp_path) -> tuple[list[list[int]], list[list[int]]]:
    """Examples from the json versions of the MESSAGES and ALPACA rows."""
    (tmp_path / "m.json").write_text(json.dumps([{"messages": m} for m in MESSAGES]))
    (tmp_path / "a.json").write_text(json.dumps(ALPACA))
    return _input_ids(SFTDataModule(str(tmp_path / "m.json"))), _input_ids(SFTDataModule(str(tmp_path / "a.json")))


def test_jsonl_and_folder(tmp_path, reference_ids):
    folder = tmp_path / "parts"
    folder.mkdir()
    for index, messages in enumerate(MESSAGES):
        (folder / f"part{index}.jsonl").write_text(json.dumps({"messages": messages}) + "\n\n")
    (single,) = _input_ids(SFTDataModule(str(folder / "part0.jsonl")))
    assert single in reference_ids[0]
    assert _input_ids(SFTDataModule(str(folder))) == reference_ids[0]


def test_csv(tmp_path, reference_ids):
    pandas = pytest.importorskip("pandas", reason="csv datasets are read with pandas")
    pandas.DataFrame(ALPACA).to_csv(tmp_path / "a.csv", index=False)
    pandas.DataFrame({"messages": [json.dumps(m) for m in MESSAGES]}).to_csv(tmp_path / "m.csv", index=False)
    assert read_rows(tmp_path / "a.csv")[1] == {"instruction": "Say hi.", "input": "", "output": "hi"}
    assert _input_ids(SFTDataModule(str(tmp_path / "a.csv"))) == reference_ids[1]
    assert _input_ids(SFTDataModule(str(tmp_path / "m.csv"))) == reference_ids[0]
    history = [{**ALPACA[0], "history": ""}, {**ALPACA[1], "history": json.dumps([["2 + 2?", "4"]])}]
    pandas.DataFrame(history).to_csv(tmp_path / "h.csv", index=False)
    lengths = [len(c.messages) for c, _ in SFTDataModule(str(tmp_path / "h.csv"))._conversations()]
    assert lengths == [2, 4]  # empty cell: no history; JSON cell: one earlier exchange


def test_parquet(tmp_path, reference_ids):
    pyarrow = pytest.importorskip("pyarrow", reason="parquet datasets are read with pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet", reason="parquet datasets are read with pyarrow")
    parquet.write_table(pyarrow.Table.from_pylist([{"messages": m} for m in MESSAGES]), tmp_path / "m.parquet")
    parquet.write_table(pyarrow.Table.from_pylist(ALPACA), tmp_path / "a.parquet")
    assert read_rows(tmp_path / "m.parquet")[0]["messages"] == MESSAGES[0]
    assert _input_ids(SFTDataModule(str(tmp_path / "m.parquet"))) == reference_ids[0]
    assert _input_ids(SFTDataModule(str(tmp_path / "a.parquet"))) == reference_ids[1]


def test_missing_optional_package_has_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "a.csv").write_text("instruction,output\nq,a\n")
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pandas", None)  # makes `import pandas` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"a.csv needs the optional package 'pandas'.*pip install pandas"):
        read_rows(tmp_path / "a.csv")
    with pytest.raises(ImportError, match=r"a.parquet needs the optional package 'pyarrow'.*pip install pyarrow"):
        read_rows(tmp_path / "a.parquet")


def test_unreadable_files_name_the_problem(tmp_path):
    (tmp_path / "obj.json").write_text('{"instruction": "q"}')
    (tmp_path / "broken.json").write_text("[{")
    (tmp_path / "lines.jsonl").write_text('{"a": 1}\nnot json\n')
    (tmp_path / "scalars.json").write_text("[1, 2]")
    (tmp_path / "data.txt").write_text("x")
    cases = {
        "obj.json": r"obj.json: expected a JSON list of row objects, found dict",
        "broken.json": r"broken.json: invalid JSON",
        "lines.jsonl": r"lines.jsonl: line 2 is not valid JSON",
        "scalars.json": r"scalars.json: row 0 is a int, expected an object",
        "data.txt": r"data.txt: unsupported suffix '.txt'",
    }
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message):
            read_rows(tmp_path / name)
