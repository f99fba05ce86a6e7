"""Published chat templates: every assistant turn is trained on exactly its answer, in its inference context."""

from __future__ import annotations

import logging

import pytest
from chat_templates import CHAT_FIXTURES, DEEPSEEK_R1, DEEPSEEK_R1_FIXTURE, QWEN3, build_chat_tokenizer, trained_turns

from lightning_megatrain.data import IGNORE_INDEX, Conversation, SFTDataModule, TemplateError
from lightning_megatrain.data.encoding import encode_sft
from lightning_megatrain.data.templates import end_of_turn_ids, resolve_chat_template

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "Double it."},
    {"role": "assistant", "content": "10."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
]


@pytest.fixture(scope="module")
def chat_tokenizers():
    return {name: build_chat_tokenizer(fixture) for name, fixture in CHAT_FIXTURES.items()}


@pytest.mark.parametrize("system", [True, False])
@pytest.mark.parametrize("name", list(CHAT_FIXTURES))
def test_each_assistant_turn_is_its_answer_in_its_inference_context(chat_tokenizers, name, system):
    fixture, tokenizer = CHAT_FIXTURES[name], chat_tokenizers[name]
    messages = MESSAGES if system else MESSAGES[1:]
    examples, per_turn = encode_sft(tokenizer, Conversation(messages), cutoff_len=4096, train_on_prompt=False)
    turns = trained_turns(tokenizer, examples)
    answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    assert len(turns) == len(answers) == 3
    for (context, trained), index in zip(turns, answers, strict=True):
        assert context == tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        assert trained == fixture.answer.format(content=messages[index]["content"])
    # Mistral v0.3 puts the system prompt into the last user message: without one it is prefix-consistent
    consistent = fixture.prefix_consistent or (name == "mistral" and not system)
    assert (per_turn is None) == consistent
    assert len(examples) == (1 if consistent else 3)


def test_qwen3_past_reasoning_is_dropped_from_later_contexts(chat_tokenizers):
    tokenizer = chat_tokenizers["qwen3"]
    messages = [dict(message) for message in MESSAGES]
    messages[2]["content"] = "<think>\nAdd them.\n</think>\n\nIt is 5."
    examples, per_turn = encode_sft(tokenizer, Conversation(messages), cutoff_len=4096, train_on_prompt=False)
    assert "not prefix-consistent at assistant message 2" in per_turn
    (context_1, answer_1), (context_2, answer_2), _ = trained_turns(tokenizer, examples)
    assert answer_1 == "<think>\nAdd them.\n</think>\n\nIt is 5.<|im_end|>\n"
    assert "Add them." not in context_2 and context_2.endswith("It is 5.<|im_end|>\n<|im_start|>user\nDouble "
                                                                "it.<|im_end|>\n<|im_start|>assistant\n")
    assert answer_2 == "<think>\n\n</think>\n\n10.<|im_end|>\n"


def test_per_turn_sequences_are_truncated_and_trained_on_prompt(chat_tokenizers):
    tokenizer = chat_tokenizers["qwen3"]
    masked, _ = encode_sft(tokenizer, Conversation(MESSAGES), cutoff_len=4096, train_on_prompt=False)

    def full_labels(example):
        return masked[full.index(example)].labels
    full, _ = encode_sft(tokenizer, Conversation(MESSAGES), cutoff_len=4096, train_on_prompt=True)
    assert all(example.labels == example.input_ids for example in full)
    short = len(full[0]) + 2  # turn 1 whole, the later turns cut (their contexts grow)
    cut, _ = encode_sft(tokenizer, Conversation(MESSAGES), cutoff_len=short, train_on_prompt=False)
    kept = [example.input_ids[:short] for example in full
            if any(label != IGNORE_INDEX for label in full_labels(example)[1:short])]
    assert [example.input_ids for example in cut] == kept and len(cut[0]) == len(full[0])


@pytest.mark.parametrize("name", list(CHAT_FIXTURES))
def test_end_of_turn_tokens(chat_tokenizers, name):
    fixture, tokenizer = CHAT_FIXTURES[name], chat_tokenizers[name]
    found = tokenizer.convert_ids_to_tokens(end_of_turn_ids(tokenizer))
    assert [token for token in found if token != fixture.eos] == list(fixture.end_of_turn)


def test_data_template_from_a_file_trains_the_demo_data_per_turn(tmp_path, caplog):
    path = tmp_path / "qwen3.jinja"
    path.write_text(QWEN3)
    module = SFTDataModule("demo_sharegpt", template=str(path), cutoff_len=4096)
    assert module.tokenizer.chat_template == QWEN3
    with caplog.at_level(logging.INFO, logger="lightning_megatrain.data.datamodule"):  # tests/conftest.py: reaches
        module.setup()
    assert len(module.train_dataset) > 200  # 100 rows of >= 2 assistant turns, one sequence per turn
    assert caplog.text.count("Encoding each assistant turn as its own sequence") == 1


def test_data_template_by_name_and_unknown_names(tmp_path):
    tokenizer = build_chat_tokenizer(CHAT_FIXTURES["qwen2.5"])
    tokenizer.chat_template = {"default": CHAT_FIXTURES["qwen2.5"].template, "thinking": QWEN3}
    assert resolve_chat_template(tokenizer, "thinking") == QWEN3
    assert resolve_chat_template(tokenizer, None) == CHAT_FIXTURES["qwen2.5"].template
    with pytest.raises(ValueError, match=r"template='chatml': not a file, .*its named templates: \['default', "
                                         r"'thinking'\]"):
        resolve_chat_template(tokenizer, "chatml")
    with pytest.raises(ValueError, match=r"template='missing.jinja': not a file, .* templates: none"):
        SFTDataModule("demo_sharegpt", template="missing.jinja")
    with pytest.raises(ValueError, match=r"template=3: must be a path"):
        SFTDataModule("demo_sharegpt", template=3)


REASONED = [{**message, "content": f"<think>\nStep {index}.\n</think>\n\n{message['content']}"}
            if message["role"] == "assistant" else message for index, message in enumerate(MESSAGES)]


def test_deepseek_r1_answers_continue_the_think_prompt_in_their_inference_context():
    tokenizer = build_chat_tokenizer(DEEPSEEK_R1_FIXTURE)
    examples, per_turn = encode_sft(tokenizer, Conversation(REASONED), cutoff_len=4096, train_on_prompt=False)
    assert "not prefix-consistent at assistant message 2" in per_turn and len(examples) == 3
    turns = trained_turns(tokenizer, examples)
    answers = [index for index, message in enumerate(REASONED) if message["role"] == "assistant"]
    for (context, trained), index in zip(turns, answers, strict=True):
        assert context == tokenizer.apply_chat_template(REASONED[:index], tokenize=False, add_generation_prompt=True)
        assert context.endswith("<｜Assistant｜><think>\n")  # the published prompt: the model writes on from here
        answer = MESSAGES[index]["content"]
        assert trained == f"Step {index}.\n</think>\n\n{answer}<｜end▁of▁sentence｜>"
    # earlier turns appear in later contexts as the template renders them: answer only, reasoning dropped
    assert "Step 2." not in turns[1][0] and turns[1][0].endswith(
        "<｜Assistant｜>\n\nIt is 5.<｜end▁of▁sentence｜><｜User｜>Double it.<｜Assistant｜><think>\n")


def test_deepseek_r1_answer_without_reasoning_is_refused_naming_the_fix(tmp_path):
    tokenizer = build_chat_tokenizer(DEEPSEEK_R1_FIXTURE)
    with pytest.raises(TemplateError, match=r"generation prompt ends in '<think>\\n', which the model's answer "
                                            r"continues, but assistant message 1 does not start with it \(it starts "
                                            r"'It is 5.'\).* Start every answer with '<think>\\n'"):
        encode_sft(tokenizer, Conversation(MESSAGES[1:5]), cutoff_len=4096, train_on_prompt=False)
    path = tmp_path / "r1.jinja"
    path.write_text(DEEPSEEK_R1)
    with pytest.raises(TemplateError, match=r"dataset 'demo_sharegpt', file .*demo_sharegpt.json, row \d+: the chat "
                                            r"template's generation prompt ends in '<think>\\n'"):
        SFTDataModule("demo_sharegpt", template=str(path)).setup()
