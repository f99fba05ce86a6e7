"""Tool-call turns: LLaMA-Factory's function_call/observation and OpenAI's tool_calls/tool, rendered and masked."""

from __future__ import annotations

import json

import pytest
from chat_templates import CHAT_FIXTURES, build_chat_tokenizer, trained_turns

from lightning_megatrain.data import IGNORE_INDEX, Conversation, DatasetFormatError, SFTDataModule, TemplateError
from lightning_megatrain.data.encoding import encode_pair, encode_sft
from lightning_megatrain.data.formats import PreferencePair, convert_rows
from lightning_megatrain.data.registry import DEFAULT_COLUMNS, DEFAULT_TAGS, OPENAI_TAGS, DatasetSpec

WEATHER = {"name": "get_weather", "description": "Current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
RESULT = '{"temperature": 22}'
ANSWER = "It is 22 C in Paris."
# LLaMA-Factory's sharegpt layout: function_call and tools hold JSON text, tool definitions are bare
FACTORY_ROW = {
    "conversations": [
        {"from": "human", "value": "Hi."}, {"from": "gpt", "value": "Hello."},
        {"from": "human", "value": "Weather in Paris?"}, {"from": "function_call", "value": json.dumps(CALL)},
        {"from": "observation", "value": RESULT}, {"from": "gpt", "value": ANSWER},
    ],
    "system": "Be brief.",
    "tools": json.dumps([WEATHER]),
}
OPENAI_ROW = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
        {"role": "assistant", "content": ANSWER},
    ],
    "tools": [{"type": "function", "function": WEATHER}],
}
TOOL_CALL = {"type": "function", "function": CALL}
CANONICAL = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": RESULT},
    {"role": "assistant", "content": ANSWER},
]
FACTORY = DatasetSpec("lf", None, "sharegpt", {**DEFAULT_COLUMNS["sharegpt"], "system": "system", "tools": "tools"})
OPENAI = DatasetSpec("oa", None, "sharegpt", {"messages": "messages", "system": None, "tools": "tools"}, OPENAI_TAGS)


def _convert(rows, spec):
    return convert_rows(rows, spec, "rows.json")


def test_both_forms_convert_to_the_messages_hf_templates_read():
    factory, openai = _convert([FACTORY_ROW], FACTORY)[0], _convert([OPENAI_ROW], OPENAI)[0]
    assert factory.messages == CANONICAL and factory.tools == [{"type": "function", "function": WEATHER}]
    openai_call = {"id": "call_1", **TOOL_CALL}  # OpenAI's ids are kept, arguments decoded from their JSON text
    assert openai.messages == [*CANONICAL[:4], {**CANONICAL[4], "tool_calls": [openai_call]},
                               {**CANONICAL[5], "tool_call_id": "call_1"}, CANONICAL[6]]
    assert openai.tools == factory.tools


def test_parallel_calls_and_several_results():
    turns = [{"from": "human", "value": "Paris and Rome?"},
             {"from": "function_call", "value": json.dumps([CALL, {**CALL, "arguments": {"city": "Rome"}}])},
             {"from": "observation", "value": "22"}, {"from": "observation", "value": "25"},
             {"from": "gpt", "value": "22 and 25."}]
    messages = _convert([{"conversations": turns}], FACTORY)[0].messages
    assert [call["function"]["arguments"] for call in messages[1]["tool_calls"]] == [{"city": "Paris"},
                                                                                   {"city": "Rome"}]
    assert [message["role"] for message in messages] == ["user", "assistant", "tool", "tool", "assistant"]


HUMAN, GPT = {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}
FUNCTION, OBSERVATION = {"from": "function_call", "value": json.dumps(CALL)}, {"from": "observation", "value": "r"}
MALFORMED = [
    ([HUMAN, OBSERVATION, GPT], r"message 1 is a tool result \('tool' / 'observation'\) after a 'user' turn "
                                r"\(message 0\); expected an 'assistant' turn or a tool call"),
    ([HUMAN, FUNCTION, HUMAN, GPT], r"message 2 is a 'user' turn after a tool call .*; expected a tool result"),
    ([HUMAN, FUNCTION, OBSERVATION], r"conversation ends with a tool result \(message 2\) that has no assistant"),
    ([HUMAN, GPT, FUNCTION], r"message 2 is a tool call .* after an 'assistant' turn \(message 1\); expected a 'user'"),
    ([HUMAN, {"from": "function_call", "value": "get_weather(Paris)"}, OBSERVATION, GPT],
     r"message 1 \('function_call' turn\): expected the JSON of \{\"name\": \"<function>\", \"arguments\""),
    ([HUMAN, {"from": "function_call", "value": '{"arguments": {}}'}, OBSERVATION, GPT],
     r"message 1 \('function_call' turn\): tool call 0: expected \{\"name\""),
    ([HUMAN, {"from": "function_call", "value": '{"name": "f", "arguments": "[1"}'}, OBSERVATION, GPT],
     r"message 1 \('function_call' turn\): tool call 0: 'arguments' is a string that is not JSON"),
    ([HUMAN, {"from": "function_call", "value": '{"name": "f"}'}, OBSERVATION, GPT],
     r"message 1 \('function_call' turn\): tool call 0 \('f'\) has no 'arguments'"),
]


@pytest.mark.parametrize(("turns", "message"), MALFORMED, ids=[m[1][:30] for m in MALFORMED])
def test_malformed_tool_turns_are_reported(turns, message):
    with pytest.raises(DatasetFormatError, match=r"row 0: " + message):
        _convert([{"conversations": turns}], FACTORY)


def test_malformed_openai_tool_calls_and_tools_are_reported():
    user = {"role": "user", "content": "q"}
    bad_calls = [[{"type": "code", "function": CALL}], [], [{"function": {"name": "f", "arguments": 3}}]]
    rows = [{"messages": [user, {"role": "assistant", "tool_calls": calls}]} for calls in bad_calls]
    rows += [{"messages": [user, {"role": "assistant", "content": "a"}], "tools": '[{"description": "x"}]'},
             {"messages": [user, {"role": "assistant", "content": "a"}], "tools": 5},
             {"messages": [user, {"role": "assistant", "tool_calls": {"function": CALL}}]},
             {"messages": [user, {"role": "assistant", "content": 5, "tool_calls": [TOOL_CALL]}]},
             {"messages": [user, {"role": "assistant", "tool_calls": [TOOL_CALL]}]}]
    with pytest.raises(DatasetFormatError) as info:
        _convert(rows, OPENAI)
    text = str(info.value)
    assert "row 0: message 1 ('assistant' turn): tool call 0: expected {\"type\": \"function\"" in text
    assert "row 1: message 1 has no 'content' key" in text  # an empty tool_calls list is no tool call
    assert "row 2: message 1 ('assistant' turn): tool call 0: 'arguments' must be an object" in text
    assert "row 3: column 'tools': tool definition 0 has no 'name'" in text
    assert "row 4: column 'tools': must be a list of tool definitions (or its JSON text), found '5'" in text
    assert "row 5: message 1 ('assistant' turn): 'tool_calls' must be a non-empty list, found {'function'" in text
    assert "row 6: message 1 content must be a string, found int" in text
    assert "row 7" not in text  # a call without content (OpenAI's null or none) is fine
    with pytest.raises(DatasetFormatError, match=r"row 0: message 1 \('function_call' turn\): an empty list of tool "
                                                 r"calls\n  row 1: message 1 has no 'value' key"):
        _convert([{"conversations": [HUMAN, {"from": "function_call", "value": "[]"}, OBSERVATION, GPT]},
                  {"conversations": [HUMAN, {"from": "function_call"}, OBSERVATION, GPT]}], FACTORY)


# The call and the answer as each template renders them after its generation prompt, written independently.
TOOL_ANSWERS = {
    "llama3.1": ['Hello.<|eot_id|>', '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                 f"{ANSWER}<|eot_id|>"],
    "qwen2.5": ["Hello.<|im_end|>\n",
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
                f"{ANSWER}<|im_end|>\n"],
    "qwen3": ["<think>\n\n</think>\n\nHello.<|im_end|>\n",  # each turn as the last message: an empty think block
              '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              "</tool_call><|im_end|>\n", f"<think>\n\n</think>\n\n{ANSWER}<|im_end|>\n"],
}


@pytest.mark.parametrize("form", ["llama-factory", "openai"])
@pytest.mark.parametrize("name", list(TOOL_ANSWERS))
def test_calls_and_answers_are_trained_in_their_inference_context(name, form):
    tokenizer = build_chat_tokenizer(CHAT_FIXTURES[name])
    conversation = _convert([FACTORY_ROW], FACTORY)[0] if form == "llama-factory" else _convert([OPENAI_ROW],
                                                                                                 OPENAI)[0]
    examples, per_turn = encode_sft(tokenizer, conversation, cutoff_len=4096, train_on_prompt=False)
    assert len(examples) == (1 if per_turn is None else 3) and (per_turn is None) == (name != "qwen3")
    turns = trained_turns(tokenizer, examples)
    assert [trained for _, trained in turns] == TOOL_ANSWERS[name]  # the tool result is never trained
    messages, indices = conversation.messages, [2, 4, 6]
    for (context, _), index in zip(turns, indices, strict=True):
        assert context == tokenizer.apply_chat_template(messages[:index], tools=conversation.tools, tokenize=False,
                                                        add_generation_prompt=True)
        assert "Current weather of a city." in context  # the tool definitions reach the template
    assert "22" in turns[2][0].split("Weather in Paris?")[-1]  # the answer's context holds the result


def test_llama31_refuses_parallel_calls_with_its_own_message():
    tokenizer = build_chat_tokenizer(CHAT_FIXTURES["llama3.1"])
    two = {**CANONICAL[4], "tool_calls": [TOOL_CALL, TOOL_CALL]}
    with pytest.raises(TemplateError, match=r"failed to render .*This model only supports single tool-calls"):
        encode_sft(tokenizer, Conversation([*CANONICAL[:4], two, *CANONICAL[5:]]), 4096, False)


@pytest.mark.parametrize(("name", "messages", "dropped"), [
    ("llama3", CANONICAL, "tool definitions or tool calls"),
    ("gpt-oss", CANONICAL, "tool definitions or tool calls or tool results"),
    ("llama3", CANONICAL[:3], "tool definitions"),  # a tools column without tool turns
])
def test_a_template_without_tool_support_is_refused(name, messages, dropped):
    tokenizer = build_chat_tokenizer(CHAT_FIXTURES[name])
    conversation = Conversation(messages, [{"type": "function", "function": WEATHER}])
    with pytest.raises(TemplateError, match=rf"does not render {dropped} \(.*\), and this conversation has them: "
                                            r".*Choose a template that supports tools with data.template"):
        encode_sft(tokenizer, conversation, 4096, False)


def test_a_pair_with_tool_turns_and_a_template_without_tools_is_refused():
    tokenizer = build_chat_tokenizer(CHAT_FIXTURES["llama3"])
    rejected = {"role": "assistant", "content": "It is 30 C in Paris."}
    pair = PreferencePair(Conversation(CANONICAL), Conversation([*CANONICAL[:-1], rejected]))
    with pytest.raises(TemplateError, match=r"does not render tool calls \(.*\), and this conversation has them: "
                                            r".*Choose a template that supports tools with data.template"):
        encode_pair(tokenizer, pair, 4096, index=0)
    assert encode_pair(build_chat_tokenizer(CHAT_FIXTURES["qwen2.5"]), pair, 4096, index=0) is not None


def test_tool_datasets_train_through_the_datamodule(tmp_path, write_dataset):
    tokenizer_dir = tmp_path / "qwen2.5"
    build_chat_tokenizer(CHAT_FIXTURES["qwen2.5"], tokenizer_dir)
    entry = {"formatting": "sharegpt", "columns": {"messages": "conversations", "system": "system", "tools": "tools"}}
    dataset_dir = write_dataset("lf", [FACTORY_ROW], entry)
    (tmp_path / "openai.jsonl").write_text(json.dumps(OPENAI_ROW) + "\n")  # inferred: OpenAI tags, tools column
    module = SFTDataModule(f"lf,{tmp_path / 'openai.jsonl'}", dataset_dir=str(dataset_dir),
                           tokenizer=str(tokenizer_dir), cutoff_len=4096)
    module.setup()
    tokenizer = module.tokenizer
    assert [example.input_ids for example in module.train_dataset] == [
        encode_sft(tokenizer, conversation, 4096, False)[0][0].input_ids
        for conversation in (_convert([FACTORY_ROW], FACTORY)[0], _convert([OPENAI_ROW], OPENAI)[0])
    ]
    for example in module.train_dataset:
        trained = [trained for _, trained in trained_turns(tokenizer, [example])]
        assert trained == TOOL_ANSWERS["qwen2.5"] and IGNORE_INDEX in example.labels
    with pytest.raises(TemplateError, match=r"dataset 'lf', file .*lf.json, row 0: the chat template does not render"):
        SFTDataModule("lf", dataset_dir=str(dataset_dir)).setup()  # the demo tokenizer's template has no tools


def test_default_tags_name_the_tool_roles():
    assert (DEFAULT_TAGS["function_tag"], DEFAULT_TAGS["observation_tag"]) == ("function_call", "observation")
