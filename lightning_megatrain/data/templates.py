"""Choosing a chat template (``data.template``) and reading the end-of-turn tokens it trains.

A template is chosen by name or by file, as LLaMA-Factory's ``template:``; here a name is one of the tokenizer's own
named templates (``tokenizer.chat_template`` is a dict when it ships several, e.g. ``default`` and ``tool_use``) and a
file is any Jinja chat template (``.jinja``), which replaces the tokenizer's. The exported tokenizer carries the
template the data was encoded with (``models/export.py``).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

_ANSWER_MARK = "\ue000megatrain-answer\ue001"  # a placeholder content no template or tokenizer holds


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | None) -> str | None:
    """The Jinja text ``template`` names for ``tokenizer``.

    Args:
        tokenizer: The tokenizer whose named templates a name refers to.
        template: ``None`` (the tokenizer's default template), a path to a Jinja file, or the name of one of the
            tokenizer's named templates.

    Returns:
        The template text, or the tokenizer's default (``None`` when it has none).

    Raises:
        ValueError: ``template`` is neither an existing file nor one of the tokenizer's template names (the message
            lists the names).
    """
    own = tokenizer.chat_template
    if template is None:
        return own.get("default") if isinstance(own, dict) else own
    path = Path(template).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if isinstance(own, dict) and template in own:
        return own[template]
    names = sorted(own) if isinstance(own, dict) else []
    raise ValueError(
        f"template={template!r}: not a file, and the tokenizer has no chat template of that name (its named "
        f"templates: {names or 'none'}); pass the path to a .jinja chat template file"
    )


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Special tokens the chat template emits after an assistant answer that ends the conversation.

    The template renders ``[user, assistant]`` with a placeholder answer; the special tokens in the text after it
    (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, gpt-oss's ``<|return|>``, ...) are what an SFT model learns
    to end its turns with, so generation should stop at them. Empty without a chat template.
    """
    if not tokenizer.chat_template:
        return []
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _ANSWER_MARK}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    tail = rendered[rendered.rfind(_ANSWER_MARK) + len(_ANSWER_MARK) :]
    special = set(tokenizer.all_special_ids)
    special |= {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return list(dict.fromkeys(index for index in ids if index in special))


# Probe names: ASCII identifiers (templates write tool names into JSON and code) no real conversation holds.
_PROBE_TOOL = "megatrain_probe_definition"
_PROBE_CALL = "megatrain_probe_call"
_PROBE_RESULT = "megatrain_probe_result"
TOOL_FEATURES = ("tool definitions", "tool calls", "tool results")
_missing_by_template: dict[str, tuple[str, ...]] = {}  # template text -> what it drops (renders are pure functions)


def _renders(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict], marks: dict[str, str]):
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception:  # jinja errors and raise_exception: the template cannot render this conversation
        return set(marks)
    return {feature for feature, mark in marks.items() if mark not in text}


def missing_tool_features(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Which of :data:`TOOL_FEATURES` the tokenizer's chat template drops from its render (or fails on).

    Two probe conversations are rendered: a plain one with a tool definition (``tools=``), and one where the
    assistant calls a tool, gets its result and answers, as HF chat templates expect them (``tool_calls`` of
    ``{"type": "function", "function": {"name", "arguments"}}``, a ``role: tool`` message). A feature whose probe
    name is missing from the text, or whose render raises, is dropped. Cached per template text.
    """
    key = str(tokenizer.chat_template)
    if key not in _missing_by_template:
        function = {"name": _PROBE_TOOL, "description": "Probe.", "parameters": {"type": "object", "properties": {}}}
        tools = [{"type": "function", "function": function}]
        call = {"type": "function", "function": {"name": _PROBE_CALL, "arguments": {"x": 1}}}
        plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        used = [plain[0], {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": _PROBE_RESULT}, plain[1]]
        missing = _renders(tokenizer, plain, tools, {"tool definitions": _PROBE_TOOL})
        missing |= _renders(tokenizer, used, tools, {"tool calls": _PROBE_CALL, "tool results": _PROBE_RESULT})
        _missing_by_template[key] = tuple(feature for feature in TOOL_FEATURES if feature in missing)
    return _missing_by_template[key]
