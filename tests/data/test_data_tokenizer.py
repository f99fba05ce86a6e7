"""The shipped demo tokenizer and demo data: offline loading, round trips, reproducible generation."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from lightning_megatrain.data import DEMO_DIR, DEMO_TOKENIZER_DIR, build_demo_tokenizer
from lightning_megatrain.data.demo.make_demo import write_demo
from lightning_megatrain.data.tokenizer import SPECIAL_TOKENS

TEXTS = [
    "What is 17 + 25?\n17 + 25 = 42.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines",
    "Ünïcödé, 中文, emoji 🙂 and symbols <>{}[]",
    "",
]


def test_shipped_tokenizer_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER_DIR)
    assert len(tokenizer) == 1024
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert tokenizer.chat_template and "<|assistant|>" in tokenizer.chat_template
    assert sorted((DEMO_TOKENIZER_DIR).iterdir()) == [DEMO_TOKENIZER_DIR / "tokenizer.json",
                                                      DEMO_TOKENIZER_DIR / "tokenizer_config.json"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer):
    for token in SPECIAL_TOKENS:
        ids = tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"]
        assert len(ids) == 3 and tokenizer.convert_ids_to_tokens(ids[1]) == token
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|bos|><|user|>\nhi<|end|><|assistant|>\n"


def test_build_demo_tokenizer_on_custom_corpus(tmp_path):
    corpus = ["alpha beta gamma delta"] * 20 + ["one two three four five"] * 20
    built = build_demo_tokenizer(tmp_path / "tok", corpus=corpus, vocab_size=300)
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert len(loaded) == len(built) <= 300
    assert loaded.tokenize("alpha beta") == ["alpha", "Ġbeta"]  # merges were learned from the corpus
    assert loaded.decode(loaded("gamma 🙂")["input_ids"]) == "gamma 🙂"


def test_demo_files_are_the_generator_output(tmp_path):
    write_demo(tmp_path)
    for name in ("dataset_info.json", "demo_alpaca.json", "demo_sharegpt.json", "demo_messages.jsonl",
                 "demo_dpo_alpaca.json", "demo_dpo_sharegpt.json"):
        assert (tmp_path / name).read_bytes() == (DEMO_DIR / name).read_bytes(), name
    fresh = json.loads((tmp_path / "tokenizer" / "tokenizer.json").read_text())
    shipped = json.loads((DEMO_TOKENIZER_DIR / "tokenizer.json").read_text())
    assert fresh["model"]["vocab"] == shipped["model"]["vocab"]
    assert fresh["model"]["merges"] == shipped["model"]["merges"]
    total = sum(path.stat().st_size for path in DEMO_DIR.rglob("*") if path.is_file())
    assert total < 300 * 1024
