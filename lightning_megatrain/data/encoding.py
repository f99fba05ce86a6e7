"""Tokenize conversations with the tokenizer's chat template and build labels (HF convention).

Labels are aligned with ``input_ids`` (the model's loss shifts them by one) and hold ``-100`` on every token
that is not trained. For SFT the trained tokens are those of every assistant turn: the text the template emits
between the generation prompt and the end of that turn, i.e. the content plus the end-of-turn token(s).

[Note: assistant spans]
An assistant turn ``k`` is trained in the context the template gives it at inference,
``render(messages[:k], add_generation_prompt=True)``. Two encodings, chosen per conversation by
:func:`encode_sft`:

- *One sequence* (fast path). When, for every assistant message ``k``, ``render(messages[:k],
  add_generation_prompt=True)`` and ``render(messages[:k + 1])`` are string prefixes of the full render (a
  "prefix-consistent" template: Llama 3, Qwen2.5, Gemma 3, Mistral without a system prompt, the demo template),
  the full render holds every turn in its inference context. It is tokenized segment by segment
  (prompt / assistant / prompt ...), so a token never straddles a span boundary (a boundary inside a BPE word only
  changes how that word is split).
- *One sequence per assistant turn* (fallback). Templates that rewrite earlier turns (Qwen3 and DeepSeek-R1 drop
  past reasoning, and Qwen3 gives only the last turn its ``<think></think>`` block; gpt-oss ends the last turn
  with ``<|return|>`` and earlier ones with ``<|end|>``; Phi-3.5 appends ``eos`` after the last turn; Mistral v0.3
  moves the system prompt to the last user message) render turn ``k`` one way when it is last and another way
  when later turns follow, and the model only ever generates a turn when it is last. So turn ``k`` becomes the
  sequence ``render(messages[:k], add_generation_prompt=True)`` (untrained) + the turn as the template renders
  it when it is the final message (trained). A conversation of ``n`` assistant turns costs ``n`` sequences whose
  contexts repeat (about ``n / 2`` times the tokens of one sequence); with ``train_on_prompt`` a context is trained
  in each sequence that holds it.

The fallback finds the rendered turn by prefix when ``render(messages[:k + 1])`` starts with the generation
prompt render (Qwen3, gpt-oss, Phi-3.5). Otherwise it aligns the turn by rendering placeholder contents: the
*opening* is what the prompt appends after the message before the turn, the *header* what the template renders
between that message and the turn's content.

- The header extends the opening (Mistral v0.3 with a system prompt, which moves into the last user message): the
  answer is the rest of the header, the content and the end of turn, as rendered.
- The opening extends the header by a *lead* the template never renders (DeepSeek-R1 and its distills prompt with
  ``<｜Assistant｜><think>\\n`` but render every turn, the last one included, as ``<｜Assistant｜>`` + the content
  after ``</think>``): at inference the model writes the content after the lead, so the answer is the message's
  content without the lead, then the template's end of turn. A content that does not start with the lead (an
  answer without reasoning) was never generated after that prompt: :class:`TemplateError` says so.
- Otherwise no exact span exists: :class:`TemplateError`.

Tool use: an assistant turn with ``tool_calls`` is a turn like any other, trained on the call as the template renders
it; tool results (``role: tool``) are context. Conversations with tool definitions, calls or results are refused
when the template drops them (``templates.missing_tool_features``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from lightning_megatrain.data.formats import Conversation, Message, PreferencePair
from lightning_megatrain.data.templates import missing_tool_features

IGNORE_INDEX = -100


class TemplateError(ValueError):
    """The chat template cannot be used for exact assistant-span masking."""


class NotPrefixConsistent(TemplateError):
    """The template renders an earlier turn differently once later turns follow (see [Note: assistant spans])."""


# Placeholder contents for aligning a rendered turn; private-use characters no real message or template holds.
_USER_MARK = "\ue000megatrain-user\ue001"
_ANSWER_MARK = "\ue000megatrain-answer\ue001"


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


@dataclass(frozen=True)
class PairExample:
    """A tokenized preference pair: two sequences with the same prompt tokens, each training only its response.

    Attributes:
        chosen: The prompt and the chosen response.
        rejected: The prompt and the rejected response.
        index: The pair's position in its split: its key in the reference log-probabilities a ``DPOModule``
            precomputes.
    """

    chosen: Example
    rejected: Example
    index: int

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], tools: Any, generation: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tools=tools, tokenize=False, add_generation_prompt=generation
        )
    except Exception as err:  # jinja raises its own exception types (and templates may `raise_exception`)
        raise TemplateError(f"the chat template failed to render {len(messages)} message(s): {err}") from err


def render_segments(tokenizer: PreTrainedTokenizerBase, conversation: Conversation) -> list[tuple[str, bool]]:
    """Split the rendered conversation into consecutive ``(text, is_assistant)`` segments (one sequence).

    Args:
        tokenizer: A tokenizer with a ``chat_template``.
        conversation: A canonical conversation (validated by ``formats.convert_rows``).

    Returns:
        Non-empty segments whose concatenation is the full render.

    Raises:
        NotPrefixConsistent: If the template is not prefix-consistent for this conversation
            (see [Note: assistant spans]).
        TemplateError: If the template fails to render.
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
            raise NotPrefixConsistent(
                f"the chat template is not prefix-consistent at assistant message {index}: rendering the first "
                f"{index} messages with add_generation_prompt=True ({start[-60:]!r}) or the first {index + 1} "
                f"messages ({end[-60:]!r}) does not give a prefix of the full conversation render (the template "
                "rewrites earlier turns once later ones follow)"
            )
        segments += [(full[cursor : len(start)], False), (full[len(start) : len(end)], True)]
        cursor = len(end)
    segments.append((full[cursor:], False))
    return [(text, trained) for text, trained in segments if text]


def _after(text: str, mark: str) -> int:
    """Index just past the last ``mark`` in ``text`` (-1 when absent)."""
    at = text.rfind(mark)
    return -1 if at < 0 else at + len(mark)


def render_turn(tokenizer: PreTrainedTokenizerBase, conversation: Conversation, index: int) -> tuple[str, str]:
    """``(context, answer)`` of assistant message ``index`` as the model meets it at inference.

    ``context`` is ``render(messages[:index], add_generation_prompt=True)``, the inference prompt; ``answer`` is the
    rest of ``render(messages[:index + 1])`` (header left after the generation prompt, content, end of turn), or,
    when the prompt opens the turn further than the template renders it, the content after that opening plus the
    end of turn (see [Note: assistant spans]).

    Raises:
        TemplateError: If the template fails to render, or no exact span exists (the message says why).
    """
    messages, tools = conversation.messages, conversation.tools
    context = _render(tokenizer, messages[:index], tools, generation=True)
    turn = _render(tokenizer, messages[: index + 1], tools, generation=False)
    if turn.startswith(context) and len(turn) > len(context):
        return context, turn[len(context) :]
    # Align with placeholder contents: `opening` is what follows the message before the turn in the prompt,
    # `header` what the template renders between that message and the turn's content.
    placeholder = {"role": "assistant", "content": _ANSWER_MARK}
    before = [*messages[: index - 1], {**messages[index - 1], "content": _USER_MARK}]
    prompt = _render(tokenizer, before, tools, generation=True)
    marked = _render(tokenizer, [*before, placeholder], tools, generation=False)
    content_at = marked.find(_ANSWER_MARK)
    opening = prompt[_after(prompt, _USER_MARK) :] if _after(prompt, _USER_MARK) >= 0 else None
    header = marked[_after(marked, _USER_MARK) : content_at] if content_at >= 0 else None
    answer_marked = _render(tokenizer, [*messages[:index], placeholder], tools, generation=False)
    common = next((n for n, (a, b) in enumerate(zip(turn, answer_marked)) if a != b), min(len(turn),
                                                                                     len(answer_marked)))
    aligned = opening is not None and header is not None and context.endswith(opening) \
        and answer_marked[common:].startswith(_ANSWER_MARK) and turn[common - len(header) : common] == header
    if aligned and header.startswith(opening):  # the rest of the header is trained with the content
        return context, turn[common - len(header) + len(opening) :]
    if aligned and opening.startswith(header) and not messages[index].get("tool_calls"):
        # The prompt opens the turn with `lead` (DeepSeek-R1's '<think>\n'), which the template does not render: the
        # model writes the rest of the content after it, then the end of turn the template closes it with.
        lead, closing = opening[len(header) :], answer_marked[common + len(_ANSWER_MARK) :]
        content = messages[index]["content"]
        if content.startswith(lead) and turn.endswith(closing):
            return context, content[len(lead) :] + closing
        raise TemplateError(
            f"the chat template's generation prompt ends in {lead!r}, which the model's answer continues, but "
            f"assistant message {index} does not start with it (it starts {content[:40]!r}), so its inference "
            f"context holds text the answer lacks. Start every answer with {lead!r} (for a reasoning template, the "
            "reasoning and its closing tag, e.g. '<think>\\n...\\n</think>\\n\\n'; '<think>\\n\\n</think>\\n\\n' "
            "trains an answer without reasoning), or choose another template with data.template"
        )
    raise TemplateError(
        f"the chat template's generation prompt for assistant message {index} ({context[-60:]!r}) is not how it "
        f"renders that turn ({turn[-60:]!r}), so the answer cannot be placed in its inference context exactly; "
        "choose another template with data.template"
    )


def _tokenize(
    tokenizer: PreTrainedTokenizerBase, segments: list[tuple[str, bool]], cutoff_len: int, train_on_prompt: bool
) -> Example | None:
    """Tokenize segments with their label mask, truncated to ``cutoff_len``; ``None`` when nothing is trained."""
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


def _check_tool_support(tokenizer: PreTrainedTokenizerBase, conversation: Conversation) -> None:
    """Raise when the conversation holds tool definitions, calls or results that the chat template drops."""
    used = {"tool definitions": bool(conversation.tools),
            "tool calls": any(message.get("tool_calls") for message in conversation.messages),
            "tool results": any(message["role"] == "tool" for message in conversation.messages)}
    if not any(used.values()):
        return
    dropped = [feature for feature in missing_tool_features(tokenizer) if used[feature]]
    if dropped:
        raise TemplateError(
            f"the chat template does not render {' or '.join(dropped)} (a probe conversation's are missing from its "
            f"render, or it fails on them), and this conversation has them: training on it would drop them "
            "silently. Choose a template that supports tools with data.template (a .jinja file, or the tokenizer's "
            "named template for tools, often 'tool_use'), or remove the tool turns and the tools column from the data"
        )


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, cutoff_len: int, train_on_prompt: bool
) -> Example | None:
    """Tokenize one conversation as one sequence with its label mask, truncated to ``cutoff_len`` tokens.

    Args:
        tokenizer: A tokenizer with a prefix-consistent ``chat_template``; special tokens come from the template
            text itself (``add_special_tokens=False``). :func:`encode_sft` also handles the others.
        conversation: A canonical conversation.
        cutoff_len: Keep at most this many tokens (the tail is cut).
        train_on_prompt: Train on every token instead of only the assistant turns.

    Returns:
        The example, or ``None`` when truncation left no trained token after the first position
        (the first label is never a target once the loss shifts labels).
    """
    return _tokenize(tokenizer, render_segments(tokenizer, conversation), cutoff_len, train_on_prompt)


def encode_sft(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, cutoff_len: int, train_on_prompt: bool
) -> tuple[list[Example], str | None]:
    """Tokenize one conversation for SFT: one sequence, or one per assistant turn (see [Note: assistant spans]).

    Args:
        tokenizer: A tokenizer with a ``chat_template``; special tokens come from the template text itself.
        conversation: A canonical conversation.
        cutoff_len: Keep at most this many tokens per sequence (the tail is cut).
        train_on_prompt: Train on every token instead of only the assistant turns.

    Returns:
        The examples (sequences left with nothing to train after truncation are left out) and, when the
        conversation was split per turn, the reason (the template is not prefix-consistent), else ``None``.

    Raises:
        TemplateError: If the template fails to render, drops the conversation's tool definitions, calls or results,
            or no exact span exists for a turn.
    """
    _check_tool_support(tokenizer, conversation)
    try:
        example = encode_conversation(tokenizer, conversation, cutoff_len, train_on_prompt)
        return ([] if example is None else [example]), None
    except NotPrefixConsistent as err:
        reason = str(err)
    examples = []
    for index, message in enumerate(conversation.messages):
        if message["role"] == "assistant":
            context, answer = render_turn(tokenizer, conversation, index)
            example = _tokenize(tokenizer, [(context, False), (answer, True)], cutoff_len, train_on_prompt)
            examples += [] if example is None else [example]
    return examples, reason


def encode_pair(
    tokenizer: PreTrainedTokenizerBase, pair: PreferencePair, cutoff_len: int, index: int
) -> PairExample | None:
    """Tokenize a preference pair: each response in the context the template gives it at inference.

    Each sequence is ``render(prompt, add_generation_prompt=True)`` (untrained, the same tokens in both) followed by
    the response as the template renders it when it is the last message (trained: content and end of turn), as
    :func:`render_turn` finds it; assistant turns earlier in the prompt are not trained. Each sequence is cut to
    ``cutoff_len`` tokens at its end.

    Returns:
        The pair, or ``None`` when truncation left either response without a trained token.

    Raises:
        TemplateError: If the template fails to render, drops the pair's tool definitions, calls or results, or no
            exact span exists for a response.
    """
    examples = []
    for conversation in (pair.chosen, pair.rejected):
        _check_tool_support(tokenizer, conversation)
        context, answer = render_turn(tokenizer, conversation, len(conversation.messages) - 1)
        example = _tokenize(tokenizer, [(context, False), (answer, True)], cutoff_len, train_on_prompt=False)
        if example is None:
            return None
        examples.append(example)
    return PairExample(*examples, index=index)


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
