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
