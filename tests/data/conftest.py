"""Shared fixtures for the data-module tests (CPU, offline, fast)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_megatrain.data import DEMO_TOKENIZER_DIR, IGNORE_INDEX


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    """The shipped demo tokenizer, loaded offline."""
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER_DIR, local_files_only=True)


@pytest.fixture(scope="session")
def expected_labels(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], list[int]]:
    """Labels computed independently of the library, by scanning tokens of the demo chat format.

    In the demo format an assistant turn is ``<|assistant|> \\n {content} <|end|>``: the trained tokens are
    everything after the newline up to and including the next ``<|end|>`` (or the end of a truncated row).
    """
    assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert len(newline) == 1

    def compute(input_ids: list[int]) -> list[int]:
        labels = [IGNORE_INDEX] * len(input_ids)
        position = 0
        while position < len(input_ids):
            if input_ids[position] == assistant:
                assert input_ids[position + 1 : position + 2] in ([], newline)
                position += 2
                while position < len(input_ids):
                    labels[position] = input_ids[position]
                    position += 1
                    if input_ids[position - 1] == end:
                        break
            else:
                position += 1
        return labels

    return compute


@pytest.fixture
def write_dataset(tmp_path: Path) -> Callable[..., Path]:
    """Write ``rows`` to ``tmp_path/<file_name>`` and register ``entry`` as ``name``; returns the dataset_dir.

    Call as ``write_dataset(name, rows, entry)`` where ``entry`` is a dataset_info.json entry without
    ``file_name`` (default: alpaca). Several calls accumulate entries in one dataset_info.json.
    """
    info_path = tmp_path / "dataset_info.json"

    def write(name: str, rows: list[Any], entry: dict[str, Any] | None = None, suffix: str = ".json") -> Path:
        file_name = f"{name}{suffix}"
        if suffix == ".jsonl":
            (tmp_path / file_name).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        else:
            (tmp_path / file_name).write_text(json.dumps(rows), encoding="utf-8")
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        info[name] = {"file_name": file_name, **(entry or {})}
        info_path.write_text(json.dumps(info), encoding="utf-8")
        return tmp_path

    return write
