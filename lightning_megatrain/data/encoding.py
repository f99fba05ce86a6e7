"""Tokenize conversations with the tokenizer's chat template and build labels (HF convention).

Labels are aligned with ``input_ids`` (the model's loss shifts them by one) and hold ``-100`` on every token
that is not trained. For SFT the trained tokens are those of every assistant turn: the text the template emits
between the generation prompt and the end of that turn, i.e. the content plus the end-of-turn token(s).

Assistant spans are found by rendering prefixes of the conversation: for assistant message ``k``,
``render(messages[:k], add_generation_prompt=True)`` ends where the turn starts and
``render(messages[:k + 1])`` ends where it stops. Both must be string prefixes of the full render
("prefix-consistent" template); otherwise :class:`TemplateError` is raised because exact masking is
impossible. The full render is then tokenized segment by segment (prompt / assistant / prompt ...), so a
token never straddles a span boundary; a span boundary inside a BPE word only changes how that word is split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from lightning_megatrain.data.formats import Conversation, Message

IGNORE_INDEX = -100


class TemplateError(ValueError):
    """The chat template cannot be used for exact assistant-span masking."""


@dataclass(frozen=True)
class Example:
    """One tokenized sequence.

    Attributes:
        input_ids: Token ids.
        labels: Same length as ``input_ids``; ``-100`` where no loss is taken.
    """

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], tools: Any, generation: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=generation
        )
    except Exception as err:  # jinja raises its own exception types (and templates may `raise_exception`)
        raise TemplateError(f"the chat template failed to render {len(messages)} message(s): {err}") from err


def render_segments(tokenizer: PreTrainedTokenizerBase, conversation: Conversation) -> list[tuple[str, bool]]:
    """Split the rendered conversation into consecutive ``(text, is_assistant)`` segments.

    Args:
        tokenizer: A tokenizer with a ``chat_template``.
        conversation: A canonical conversation (validated by ``formats.convert_rows``).

    Returns:
        Non-empty segments whose concatenation is the full render.

    Raises:
        TemplateError: If the template is not prefix-consistent for this conversation, or fails to render.
    """
    messages, tools = conversation.messages, conversation.tools
    full = _render(tokenizer, messages, tools, generation=False)
    segments, cursor = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:index], tools, generation=True)
        end = _render(tokenizer, messages[: index + 1], tools, generation=False)
        if not (full.startswith(start) and full.startswith(end) and cursor <= len(start) < len(end)):
            raise TemplateError(
                f"the chat template is not prefix-consistent at assistant message {index}: rendering the first "
                f"{index} messages with add_generation_prompt=True ({start[-60:]!r}) or the first {index + 1} "
                f"messages ({end[-60:]!r}) does not give a prefix of the full conversation render, so assistant "
                "tokens cannot be located exactly. Use a template that renders earlier turns the same way "
                "whatever follows them (e.g. one that does not drop or rewrite past turns)."
            )
        segments += [(full[cursor : len(start)], False), (full[len(start) : len(end)], True)]
        cursor = len(end)
    segments.append((full[cursor:], False))
    return [(text, trained) for text, trained in segments if text]


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, cutoff_len: int, train_on_prompt: bool
) -> Example | None:
    """Tokenize one conversation with its label mask, truncated to ``cutoff_len`` tokens.

    Args:
        tokenizer: A tokenizer with a prefix-consistent ``chat_template``; special tokens come from the template
            text itself (``add_special_tokens=False``).
        conversation: A canonical conversation.
        cutoff_len: Keep at most this many tokens (the tail is cut).
        train_on_prompt: Train on every token instead of only the assistant turns.

    Returns:
        The example, or ``None`` when truncation left no trained token after the first position
        (the first label is never a target once the loss shifts labels).
    """
    segments = render_segments(tokenizer, conversation)
    pieces = tokenizer([text for text, _ in segments], add_special_tokens=False)["input_ids"]
    input_ids: list[int] = []
    labels: list[int] = []
    for (_, trained), ids in zip(segments, pieces, strict=True):
        input_ids += ids
        labels += ids if (trained or train_on_prompt) else [IGNORE_INDEX] * len(ids)
    input_ids, labels = input_ids[:cutoff_len], labels[:cutoff_len]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None
    return Example(input_ids, labels)


def encode_pretrain_text(tokenizer: PreTrainedTokenizerBase, text: str, cutoff_len: int) -> list[Example]:
    """Tokenize a pretraining document as ``bos + text + eos`` (each when defined), all tokens trained.

    Documents longer than ``cutoff_len`` are split into consecutive chunks of ``cutoff_len`` tokens instead of
    being truncated; chunks shorter than 2 tokens (nothing to predict) are dropped.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    if tokenizer.eos_token_id is not None:
        ids = [*ids, tokenizer.eos_token_id]
    chunks = (ids[start : start + cutoff_len] for start in range(0, len(ids), cutoff_len))
    return [Example(chunk, list(chunk)) for chunk in chunks if len(chunk) >= 2]
