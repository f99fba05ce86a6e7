"""Row conversion to canonical messages, malformed-row errors, dataset_info and argument validation."""

from __future__ import annotations

import re

import pytest

from lightning_megatrain.data import DEMO_DIR, DatasetFormatError, SFTDataModule
from lightning_megatrain.data.formats import convert_rows
from lightning_megatrain.data.registry import OPENAI_TAGS, DatasetSpec, infer_spec, resolve_datasets

SHAREGPT = {"formatting": "sharegpt", "columns": {"messages": "conversations", "system": "system"}}
MESSAGES = {
    "formatting": "sharegpt",
    "columns": {"messages": "messages"},
    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
             "system_tag": "system"},
}
ALPACA_FULL = {"columns": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                           "history": "history"}}


def _messages(module: SFTDataModule) -> list[list[dict[str, str]]]:
    """Canonical conversations of a module, in file order."""
    return [conversation.messages for conversation, _ in module._conversations()]


def test_alpaca_rows_become_canonical_messages(write_dataset):
    rows = [
        {"instruction": "Add the numbers.", "input": "2 3", "output": "5", "system": "Be exact.",
         "history": [["Hi", "Hello"]]},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
    ]
    module = SFTDataModule("al", dataset_dir=str(write_dataset("al", rows, ALPACA_FULL)), system="Default.")
    assert _messages(module) == [
        [
            {"role": "system", "content": "Be exact."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Add the numbers.\n2 3"},
            {"role": "assistant", "content": "5"},
        ],
        [
            {"role": "system", "content": "Default."},
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "hi"},
        ],
    ]


def test_sharegpt_system_from_message_column_or_default(write_dataset):
    turns = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    rows = [
        {"conversations": [{"from": "system", "value": "in-list"}, *turns], "system": "ignored column"},
        {"conversations": turns, "system": "column"},
        {"conversations": turns},
    ]
    module = SFTDataModule("sg", dataset_dir=str(write_dataset("sg", rows, SHAREGPT)), system="default")
    systems = [messages[0] for messages in _messages(module)]
    assert systems == [{"role": "system", "content": c} for c in ("in-list", "column", "default")]
    assert all(messages[1:] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
               for messages in _messages(module))


def test_openai_messages_pass_through(write_dataset):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "a2"}]
    module = SFTDataModule("oa", dataset_dir=str(write_dataset("oa", [{"messages": messages}], MESSAGES, ".jsonl")))
    assert _messages(module) == [messages]


def test_demo_datasets_convert_without_errors():
    counts = {name: len(_messages(SFTDataModule(name))) for name in ("demo_alpaca", "demo_sharegpt", "demo_messages")}
    assert counts == {"demo_alpaca": 200, "demo_sharegpt": 100, "demo_messages": 100}


GOOD_SHAREGPT = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
MALFORMED = [
    ("alpaca", {"instruction": "q"}, r"row 1: missing column 'output' \(the response\)"),
    ("alpaca", {"output": "a"}, r"row 1: missing column 'instruction' \(the prompt\)"),
    ("alpaca", {"instruction": "q", "output": 7},
     r"row 1: column 'output' \(the response\) must be a string, found int"),
    ("alpaca", {"instruction": "q", "output": "a", "history": [["only one"]]},
     r"row 1: history item 0 must be a \[query, response\] pair"),
    ("sharegpt", {"system": "s"}, r"row 1: missing column 'conversations' \(the messages\)"),
    ("sharegpt", {"conversations": []}, r"row 1: empty conversation"),
    ("sharegpt", {"conversations": [{"from": "system", "value": "s"}]}, r"row 1: no assistant turn to train on"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q2"},
                                    {"from": "gpt", "value": "a"}]},
     r"row 1: two 'user' turns in a row \(messages 0 and 1\)"),
    ("sharegpt", {"conversations": [*GOOD_SHAREGPT, {"from": "gpt", "value": "again"}]},
     r"row 1: two 'assistant' turns in a row \(messages 1 and 2\)"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}]}, r"row 1: no assistant turn to train on"),
    ("sharegpt", {"conversations": [*GOOD_SHAREGPT, {"from": "human", "value": "dangling"}]},
     r"row 1: conversation ends with a 'user' turn \(message 2\)"),
    ("sharegpt", {"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]},
     r"row 1: message 0 is an 'assistant' turn; the first turn after the system prompt must be 'user'"),
    ("sharegpt", {"conversations": [*GOOD_SHAREGPT, {"from": "system", "value": "late"}]},
     r"row 1: message 2 is a 'system' turn; a system prompt is only allowed first"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]},
     r"row 1: message 1 has unknown role 'bot'"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "observation", "value": "a"}]},
     r"row 1: message 1 is a tool result \('tool' / 'observation'\) after a 'user' turn \(message 0\)"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"value": "a"}]},
     r"row 1: message 1 has no 'from' key"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": None}]},
     r"row 1: message 1 content must be a string, found NoneType"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]},
     r"row 1: message 1 is an empty assistant response"),
    ("sharegpt", {"conversations": "not a list"}, r"row 1: column 'conversations' must be a list of messages"),
]


@pytest.mark.parametrize(("formatting", "bad_row", "message"), MALFORMED, ids=[m[2][7:40] for m in MALFORMED])
def test_malformed_row_raises_in_setup_naming_file_and_row(write_dataset, formatting, bad_row, message):
    good = {"instruction": "q", "output": "a"} if formatting == "alpaca" else {"conversations": GOOD_SHAREGPT}
    entry = SHAREGPT if formatting == "sharegpt" else ALPACA_FULL
    dataset_dir = write_dataset("bad", [good, bad_row], entry)
    module = SFTDataModule("bad", dataset_dir=str(dataset_dir))  # construction does not read rows
    with pytest.raises(DatasetFormatError, match=re.escape(str(dataset_dir / "bad.json")) + r".*\n.*" + message):
        module.setup("fit")
    assert module.train_dataset is None


def test_all_malformed_rows_are_reported_together(write_dataset):
    rows = [{"instruction": "q"}, {"instruction": "q", "output": "a"}, {"output": "a"}]
    module = SFTDataModule("bad", dataset_dir=str(write_dataset("bad", rows)))
    with pytest.raises(DatasetFormatError, match=r"2 malformed row\(s\) of 3:\n  row 0: .*\n  row 2: ") as info:
        module.setup()
    assert "row 1" not in str(info.value)


def test_infer_spec_from_first_row_columns(tmp_path):
    spec = DatasetSpec("x", tmp_path, None)
    openai = infer_spec(spec, {"messages": [{"role": "user", "content": "q"}], "tools": "[]"})
    assert (openai.formatting, openai.tags, openai.columns["tools"]) == ("sharegpt", OPENAI_TAGS, "tools")
    sharegpt = infer_spec(spec, {"conversations": '[{"from": "human", "value": "q"}]', "system": "s"})
    assert (sharegpt.formatting, sharegpt.tags["role_tag"]) == ("sharegpt", "from")
    assert sharegpt.columns["system"] == "system"
    alpaca = infer_spec(spec, {"instruction": "q", "output": "a"})
    assert (alpaca.formatting, alpaca.columns["query"], alpaca.columns["response"]) == ("alpaca", None, "output")
    assert infer_spec(spec, {"text": "doc"}).columns["prompt"] == "text"
    with pytest.raises(ValueError, match=r"cannot infer the format from columns \['answer', 'question'\]"):
        infer_spec(spec, {"question": "q", "answer": "a"})


def test_prompt_only_rows_need_pt_mode(tmp_path):
    spec = infer_spec(DatasetSpec("t", tmp_path, None), {"text": "doc"})
    with pytest.raises(DatasetFormatError, match=r"row 0: no response column is configured .*mode='pt'"):
        convert_rows([{"text": "doc"}], spec, tmp_path / "t.json")
    assert convert_rows([{"text": "doc"}], spec, tmp_path / "t.json", mode="pt")[0].messages == [
        {"role": "user", "content": "doc"}
    ]


def test_dataset_info_problems_are_listed_together(write_dataset, tmp_path):
    write_dataset("hub", [], {"hf_hub_url": "org/set"})
    write_dataset("fmt", [], {"formatting": "xml"})
    write_dataset("col", [], {"columns": {"prompt": "q", "chosen": "c"}})
    write_dataset("tag", [], {"tags": {"role_tag": "r"}})
    (tmp_path / "col.json").unlink()
    specs, problems = resolve_datasets("hub,fmt,col,tag,nope,missing.json", tmp_path)
    assert specs == []
    text = "\n".join(problems)
    for expected in (
        r"entry 'hub': loads from a hub/script \(\['hf_hub_url'\]\), which is not supported",
        r"entry 'fmt': formatting='xml' is not one of \['alpaca', 'sharegpt'\]",
        r"entry 'col': 'chosen'/'rejected' columns are for preference datasets; add 'ranking': true",
        r"entry 'col': .*col.json: no such file or folder",
        r"entry 'tag': 'tags' only apply to formatting='sharegpt'",
        r"dataset='nope': not registered in .*dataset_info.json \(registered: col, fmt, hub, tag\)",
        r"dataset='missing.json': missing.json: no such file or folder",
    ):
        assert re.search(expected, text), expected


def test_constructor_reports_every_bad_argument_in_one_error(tmp_path):
    with pytest.raises(ValueError) as info:
        SFTDataModule(
            dataset="unknown_set",
            tokenizer=str(tmp_path / "no_tokenizer"),
            mode="rlhf",
            cutoff_len=1,
            train_on_prompt="yes",
            packing=1,
            micro_batch_size=0,
            val_size=1.5,
            num_workers=-1,
            seed="0",
            system=3,
            pad_to_multiple_of=0,
        )
    text = str(info.value)
    assert text.startswith("SFTDataModule: 12 invalid argument(s):")
    for expected in (
        "mode='rlhf': must be one of ['sft', 'pt']",
        "cutoff_len=1: must be an int >= 2",
        "train_on_prompt='yes': must be True or False",
        "packing=1: must be True or False",
        "micro_batch_size=0: must be an int >= 1",
        "val_size=1.5: a float is a fraction and must be in [0, 1)",
        "num_workers=-1: must be an int >= 0",
        "seed='0': must be an int",
        "system=3: must be a string or None",
        "pad_to_multiple_of=0: must be None or an int >= 1",
        f"dataset='unknown_set': not registered in {DEMO_DIR / 'dataset_info.json'}",
        "tokenizer=",
        "not a folder; pass a local tokenizer folder",
    ):
        assert expected in text, expected


def test_tokenizer_without_chat_template_is_rejected_for_sft(tmp_path, tokenizer):
    plain = tmp_path / "plain"
    tokenizer.save_pretrained(plain)
    config = plain / "tokenizer_config.json"
    config.write_text(re.sub(r'\s*"chat_template": ".*?",\n', "\n", config.read_text()))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"has no chat_template, which mode='sft' needs"):
        SFTDataModule(tokenizer=str(plain))
    assert SFTDataModule(tokenizer=str(plain), mode="pt").tokenizer.chat_template is None
