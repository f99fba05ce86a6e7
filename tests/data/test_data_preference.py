"""Preference pairs (LLaMA-Factory ``ranking: true``): both forms, shared prompts, response-only labels, the
chosen-then-rejected batch, and the errors that name the option and the fix."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lightning_megatrain.data import (
    IGNORE_INDEX,
    DatasetFormatError,
    PreferenceDataModule,
    SFTDataModule,
)

ALPACA = {"ranking": True, "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                       "rejected": "rejected", "system": "system", "history": "history"}}
SHAREGPT = {"ranking": True, "formatting": "sharegpt",
            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "system": "system"}}
OPENAI = {"ranking": True, "formatting": "sharegpt", "columns": {"messages": "messages", "chosen": "better",
                                                                 "rejected": "worse"},
          "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                   "system_tag": "system"}}


def _trained(tokenizer, example) -> str:
    """The text of the trained tokens of one sequence (labels other than -100 equal their input ids)."""
    ids = [token for token, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE_INDEX]
    assert [label for label in example.labels if label != IGNORE_INDEX] == ids
    return tokenizer.decode(ids)


def _check_pair(tokenizer, pair, prompt_text: str, chosen: str, rejected: str) -> None:
    """Both sequences are the same prompt tokens then one response; only the response and its end are trained."""
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    for example, answer in ((pair.chosen, chosen), (pair.rejected, rejected)):
        assert example.input_ids[: len(prompt)] == prompt
        assert example.labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)
        assert example.input_ids[len(prompt) :] == tokenizer(f"{answer}<|end|>", add_special_tokens=False)["input_ids"]
        assert _trained(tokenizer, example) == f"{answer}<|end|>"


def test_alpaca_pairs_share_the_prompt_and_train_only_the_response(write_dataset, tokenizer):
    rows = [
        {"instruction": "Add.", "input": "2 3", "chosen": "5", "rejected": "6", "system": "Be exact.",
         "history": [["Hi", "Hello"]]},
        {"instruction": "Say hi.", "input": "", "chosen": "hi", "rejected": "bye"},
    ]
    module = PreferenceDataModule("al", dataset_dir=str(write_dataset("al", rows, ALPACA)), system="Default.")
    module.setup("fit")
    first, second = module.train_dataset
    assert (first.index, second.index) == (0, 1)
    # the history's assistant turn is context, not trained
    _check_pair(tokenizer, first, "<|bos|><|system|>\nBe exact.<|end|><|user|>\nHi<|end|><|assistant|>\nHello<|end|>"
                "<|user|>\nAdd.\n2 3<|end|><|assistant|>\n", "5", "6")
    _check_pair(tokenizer, second, "<|bos|><|system|>\nDefault.<|end|><|user|>\nSay hi.<|end|><|assistant|>\n",
                "hi", "bye")


def test_sharegpt_pairs_answer_the_last_user_turn(write_dataset, tokenizer):
    rows = [{
        "conversations": [{"from": "human", "value": "2 + 2?"}, {"from": "gpt", "value": "4."},
                          {"from": "human", "value": "Double it."}],
        "system": "Brief.",
        "chosen": {"from": "gpt", "value": "8."},
        "rejected": {"from": "gpt", "value": "6."},
    }]
    module = PreferenceDataModule("sg", dataset_dir=str(write_dataset("sg", rows, SHAREGPT)))
    module.setup("fit")
    (pair,) = module.train_dataset
    _check_pair(tokenizer, pair, "<|bos|><|system|>\nBrief.<|end|><|user|>\n2 + 2?<|end|><|assistant|>\n4.<|end|>"
                "<|user|>\nDouble it.<|end|><|assistant|>\n", "8.", "6.")


def test_openai_tags_and_renamed_columns(write_dataset, tokenizer):
    rows = [{"messages": [{"role": "system", "content": "S."}, {"role": "user", "content": "Q?"}],
             "better": {"role": "assistant", "content": "yes"}, "worse": {"role": "assistant", "content": "no"}}]
    module = PreferenceDataModule("oa", dataset_dir=str(write_dataset("oa", rows, OPENAI)))
    module.setup("fit")
    _check_pair(tokenizer, module.train_dataset[0], "<|bos|><|system|>\nS.<|end|><|user|>\nQ?<|end|><|assistant|>\n",
                "yes", "no")


def test_batch_is_chosen_rows_then_rejected_rows_with_pair_index(write_dataset):
    rows = [{"instruction": f"Question {i}?", "chosen": "Right " * (i + 1), "rejected": "Wrong."} for i in range(5)]
    module = PreferenceDataModule("al", dataset_dir=str(write_dataset("al", rows, ALPACA)), micro_batch_size=3)
    module.setup("fit")
    pairs = module.train_dataset
    for loader in (module.train_dataloader(), module.reference_dataloaders()["train"]):
        seen = []
        for batch in loader:
            index = batch["pair_index"].tolist()
            rows_per_side = len(index)
            assert batch["input_ids"].shape[0] == 2 * rows_per_side
            for row, pair_index in enumerate(index):
                pair = pairs[pair_index]
                for side, example in ((row, pair.chosen), (row + rows_per_side, pair.rejected)):
                    n = len(example)
                    assert batch["input_ids"][side, :n].tolist() == example.input_ids
                    assert batch["labels"][side, :n].tolist() == example.labels
                    assert batch["attention_mask"][side].sum() == n
                    assert (batch["labels"][side, n:] == IGNORE_INDEX).all()
            seen += index
        assert sorted(seen) == list(range(5))
    in_order = torch.cat([batch["pair_index"] for batch in module.reference_dataloaders()["train"]])
    assert in_order.tolist() == list(range(5))


def test_val_pairs_are_indexed_in_their_own_split(write_dataset):
    rows = [{"instruction": f"Q{i}?", "chosen": "a", "rejected": "b"} for i in range(10)]
    module = PreferenceDataModule("al", dataset_dir=str(write_dataset("al", rows, ALPACA)), val_size=3)
    module.setup("fit")
    assert [pair.index for pair in module.val_dataset] == [0, 1, 2]
    assert [pair.index for pair in module.train_dataset] == list(range(7))
    assert set(module.reference_dataloaders()) == {"train", "val"}


def test_a_file_with_chosen_and_rejected_columns_is_read_as_pairs(tmp_path, tokenizer):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"instruction": "Q?", "chosen": "yes", "rejected": "no"}) + "\n")
    module = PreferenceDataModule(str(path))
    module.setup("fit")
    _check_pair(tokenizer, module.train_dataset[0], "<|bos|><|user|>\nQ?<|end|><|assistant|>\n", "yes", "no")
    with pytest.raises(ValueError, match=r"dataset='.*pairs.jsonl' is a preference dataset .* `megatrain dpo`"):
        SFTDataModule(str(path)).setup("fit")


def test_truncated_pairs_are_dropped_with_a_warning(write_dataset, caplog):
    rows = [{"instruction": "Q?", "chosen": "short", "rejected": "short"},
            {"instruction": "Long question " * 40, "chosen": "a", "rejected": "b"}]
    module = PreferenceDataModule("al", dataset_dir=str(write_dataset("al", rows, ALPACA)), cutoff_len=32)
    module.setup("fit")
    assert len(module.train_dataset) == 1
    assert "Dropped 1 pair(s)" in caplog.text


def test_the_bundled_demo_pairs_load():
    module = PreferenceDataModule("demo_dpo_alpaca,demo_dpo_sharegpt", val_size=10)
    with pytest.raises(RuntimeError, match=r"PreferenceDataModule.setup\(\) must run before reference_dataloaders\(\)"):
        module.reference_dataloaders()
    module.setup("fit")
    assert len(module.train_dataset) + len(module.val_dataset) == 180
    for pair in module.train_dataset:
        assert pair.chosen.input_ids != pair.rejected.input_ids


@pytest.mark.parametrize(
    ("rows", "entry", "match"),
    [
        ([{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
           "chosen": {"from": "gpt", "value": "x"}, "rejected": {"from": "gpt", "value": "y"}}], SHAREGPT,
         r"row 0: column 'conversations' ends with an assistant turn; .* must end with the user turn"),
        ([{"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "human", "value": "x"},
           "rejected": {"from": "gpt", "value": "y"}}], SHAREGPT,
         r"row 0: column 'chosen' \(the chosen response\) has role 'human'; expected 'gpt'"),
        ([{"conversations": [{"from": "human", "value": "q"}], "chosen": "x",
           "rejected": {"from": "gpt", "value": "y"}}], SHAREGPT,
         r"row 0: column 'chosen' \(the chosen response\) must be a message object"),
        ([{"instruction": "q", "chosen": "x"}], ALPACA, r"row 0: missing column 'rejected' \(the rejected response\)"),
        ([{"instruction": "q", "chosen": "x", "rejected": " "}], ALPACA, r"row 0: message 1 is an empty assistant"),
    ],
)
def test_malformed_pairs_are_reported_by_row(write_dataset, rows, entry, match):
    module = PreferenceDataModule("bad", dataset_dir=str(write_dataset("bad", rows, entry)))
    with pytest.raises(DatasetFormatError, match=match):
        module.setup("fit")


def test_each_datamodule_refuses_the_other_kind(write_dataset):
    folder = str(write_dataset("pairs", [{"instruction": "q", "chosen": "a", "rejected": "b"}], ALPACA))
    write_dataset("sft", [{"instruction": "q", "output": "a"}])
    with pytest.raises(ValueError, match=r"(?s)SFTDataModule: 1 invalid argument.*dataset='pairs' is a preference "
                                         r"dataset .* train it with `megatrain dpo`"):
        SFTDataModule("pairs", dataset_dir=folder)
    with pytest.raises(ValueError, match=r"(?s)PreferenceDataModule: 1 invalid argument.*dataset='sft' is not a "
                                         r"preference dataset: .*'ranking': true"):
        PreferenceDataModule("sft", dataset_dir=folder)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"ranking": "yes"}, r"entry 'x': ranking='yes' must be true \(a preference dataset\) or false"),
        ({"columns": {"prompt": "instruction", "chosen": "c"}},
         r"entry 'x': 'chosen'/'rejected' columns are for preference datasets; add 'ranking': true"),
    ],
)
def test_registry_checks_ranking_entries(write_dataset, entry, match):
    folder = str(write_dataset("x", [{"instruction": "q", "output": "a"}], entry))
    with pytest.raises(ValueError, match=match):
        SFTDataModule("x", dataset_dir=folder)


def test_a_tokenizer_without_chat_template_is_refused_with_the_preference_fix(tmp_path, tokenizer):
    plain = tmp_path / "plain"
    tokenizer.save_pretrained(plain)
    config = plain / "tokenizer_config.json"
    config.write_text(re.sub(r'\s*"chat_template": ".*?",\n', "\n", config.read_text()))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"has no chat_template, which PreferenceDataModule needs to render each "
                                         r"prompt and response; .* or pass template \(a .jinja file\)$"):
        PreferenceDataModule(tokenizer=str(plain))
