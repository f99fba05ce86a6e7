"""Tokenization with the chat template: exact label masks, train_on_prompt, truncation, template checks, pt mode."""

from __future__ import annotations

import json
import shutil

import pytest

from lightning_megatrain.data import (
    DEMO_DIR,
    DEMO_TOKENIZER_DIR,
    IGNORE_INDEX,
    Conversation,
    SFTDataModule,
    TemplateError,
)
from lightning_megatrain.data.encoding import encode_conversation, encode_pretrain_text
from lightning_megatrain.data.formats import convert_rows
from lightning_megatrain.data.readers import read_rows
from lightning_megatrain.data.registry import resolve_datasets

CONVERSATION = Conversation([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "Double it."},
    {"role": "assistant", "content": "10."},
])


def _demo_conversations(name: str) -> list[Conversation]:
    (spec,), problems = resolve_datasets(name, DEMO_DIR)
    assert problems == []
    return convert_rows(read_rows(spec.path), spec, spec.path)


def test_hand_written_conversation_masks_every_assistant_turn(tokenizer):
    example = encode_conversation(tokenizer, CONVERSATION, cutoff_len=1024, train_on_prompt=False)
    tokens = tokenizer.convert_ids_to_tokens(example.input_ids)
    trained = [token for token, label in zip(tokens, example.labels, strict=True) if label != IGNORE_INDEX]
    answer_1 = tokenizer.tokenize("2 + 3 = 5.")
    answer_2 = tokenizer.tokenize("10.")
    assert trained == [*answer_1, "<|end|>", *answer_2, "<|end|>"]
    # position by position: every trained label equals its input id, everything else is -100
    first = tokens.index("<|assistant|>") + 2
    second = len(tokens) - len(answer_2) - 1
    expected = [IGNORE_INDEX] * len(tokens)
    for start, count in ((first, len(answer_1) + 1), (second, len(answer_2) + 1)):
        expected[start : start + count] = example.input_ids[start : start + count]
    assert example.labels == expected
    assert tokens[:3] == ["<|bos|>", "<|system|>", "Ċ"] and tokens[-1] == "<|end|>"


@pytest.mark.parametrize("name", ["demo_alpaca", "demo_sharegpt", "demo_messages"])
def test_demo_label_masks_match_independent_scan(tokenizer, expected_labels, name):
    for conversation in _demo_conversations(name):
        example = encode_conversation(tokenizer, conversation, cutoff_len=4096, train_on_prompt=False)
        full = tokenizer.apply_chat_template(conversation.messages, tokenize=False)
        assert example.input_ids == tokenizer(full, add_special_tokens=False)["input_ids"]
        assert example.labels == expected_labels(example.input_ids)
        end = tokenizer.convert_tokens_to_ids("<|end|>")
        trained_ends = sum(1 for token, label in zip(example.input_ids, example.labels, strict=True)
                           if token == end and label == end)
        assert trained_ends == sum(m["role"] == "assistant" for m in conversation.messages)


@pytest.mark.parametrize("name", ["demo_alpaca", "demo_sharegpt", "demo_messages"])
def test_datamodule_examples_match_independent_scan(expected_labels, name):
    module = SFTDataModule(name, cutoff_len=4096)
    module.setup()
    assert len(module.train_dataset) == {"demo_alpaca": 200}.get(name, 100)
    for example in module.train_dataset:
        assert example.labels == expected_labels(example.input_ids)


def test_system_prompts_and_multi_turn_are_rendered(tokenizer):
    conversations = _demo_conversations("demo_sharegpt")
    assert all(c.messages[0]["role"] == "system" for c in conversations)
    assert all(sum(m["role"] == "assistant" for m in c.messages) >= 2 for c in conversations)
    example = encode_conversation(tokenizer, conversations[0], cutoff_len=4096, train_on_prompt=False)
    text = tokenizer.decode(example.input_ids)
    assert text.startswith(f"<|bos|><|system|>\n{conversations[0].messages[0]['content']}<|end|><|user|>\n")


def test_train_on_prompt_trains_every_token(tokenizer):
    example = encode_conversation(tokenizer, CONVERSATION, cutoff_len=1024, train_on_prompt=True)
    assert example.labels == example.input_ids
    module = SFTDataModule("demo_messages", train_on_prompt=True, cutoff_len=4096)
    module.setup()
    assert all(example.labels == example.input_ids for example in module.train_dataset)


def test_truncation_keeps_the_head_and_its_mask(tokenizer, expected_labels):
    full = encode_conversation(tokenizer, CONVERSATION, cutoff_len=1024, train_on_prompt=False)
    cut = len(full) - 3
    truncated = encode_conversation(tokenizer, CONVERSATION, cutoff_len=cut, train_on_prompt=False)
    assert len(truncated) == cut
    assert truncated.input_ids == full.input_ids[:cut] and truncated.labels == full.labels[:cut]
    assert truncated.labels == expected_labels(truncated.input_ids)


def test_examples_with_nothing_left_to_train_are_dropped(tokenizer, caplog):
    prompt_length = tokenizer.convert_ids_to_tokens(
        encode_conversation(tokenizer, CONVERSATION, cutoff_len=1024, train_on_prompt=False).input_ids
    ).index("<|assistant|>") + 2
    assert encode_conversation(tokenizer, CONVERSATION, cutoff_len=prompt_length, train_on_prompt=False) is None
    assert encode_conversation(tokenizer, CONVERSATION, cutoff_len=prompt_length + 1, train_on_prompt=False)
    module = SFTDataModule("demo_sharegpt", cutoff_len=24)
    with caplog.at_level("WARNING"):
        module.setup()
    assert all(len(example) <= 24 for example in module.train_dataset)
    assert 0 < len(module.train_dataset) < 100
    assert f"Dropped {100 - len(module.train_dataset)} example(s)" in caplog.text


@pytest.mark.parametrize(("edit", "message"), [
    (lambda template: template.replace("{{ '<|assistant|>\\n' }}", "{{ '<|model|>\\n' }}"),
     r"generation prompt for assistant message \d+ .* is not how it renders that turn"),
    (lambda template: template + "{{ '<|eos|>' if messages|length > 3 else '' }}",  # text that depends on the future
     r"generation prompt ends in '<\|eos\|>', which the model's answer continues, but assistant message 4 does not "
     r"start with it"),
], ids=["other-header", "future-text"])
def test_template_without_an_exact_turn_span_is_rejected(tmp_path, edit, message):
    """The generation prompt is not how the template opens the rendered turn, or ends in text the rendered turn lacks:
    no sequence holds the turn in its inference context, so neither encoding applies (the per-turn fallback handles
    templates that only rewrite past turns)."""
    broken = tmp_path / "tok"
    shutil.copytree(DEMO_TOKENIZER_DIR, broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    config["chat_template"] = edit(config["chat_template"])
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    module = SFTDataModule("demo_sharegpt", tokenizer=str(broken))
    with pytest.raises(TemplateError, match=r"dataset 'demo_sharegpt', file .*demo_sharegpt.json, row \d+: the chat "
                                            r"template's " + message):
        module.setup()


def test_pretraining_mode_trains_all_tokens_and_chunks_long_texts(tokenizer, write_dataset):
    ids = encode_pretrain_text(tokenizer, "The quick brown fox.", cutoff_len=1024)
    (example,) = ids
    assert example.input_ids == [tokenizer.bos_token_id, *tokenizer("The quick brown fox.")["input_ids"],
                                 tokenizer.eos_token_id]
    assert example.labels == example.input_ids
    chunks = encode_pretrain_text(tokenizer, "word " * 40, cutoff_len=8)
    assert [len(c) for c in chunks[:-1]] == [8] * (len(chunks) - 1) and 2 <= len(chunks[-1]) <= 8
    assert sum((c.input_ids for c in chunks), []) == [tokenizer.bos_token_id,
                                                      *tokenizer("word " * 40)["input_ids"], tokenizer.eos_token_id]
    rows = [{"text": "hello world"}, {"text": "the lazy dog"}]
    dataset_dir = write_dataset("pt", rows, {"columns": {"prompt": "text"}})
    module = SFTDataModule("pt", dataset_dir=str(dataset_dir), mode="pt")
    module.setup()
    texts = sorted(tokenizer.decode(example.input_ids) for example in module.train_dataset)
    assert texts == ["<|bos|>hello world<|eos|>", "<|bos|>the lazy dog<|eos|>"]
