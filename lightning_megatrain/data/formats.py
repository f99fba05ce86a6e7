"""Convert alpaca / sharegpt / OpenAI-messages rows into one canonical conversation format.

Canonical form: a list of ``{"role": "system" | "user" | "assistant" | "tool", "content": str}`` where an optional
system message comes first and user/assistant turns alternate, starting with user and ending with assistant. Tool use
(``tool_calls.py``): an assistant turn may carry ``tool_calls`` instead of an answer (a sharegpt ``function_call``
turn, or an OpenAI assistant message with ``tool_calls``); it is followed by one or more ``tool`` results (sharegpt
``observation`` turns, OpenAI ``role: tool``), then by the assistant's answer or next call.
Malformed rows are collected and reported together in one :class:`DatasetFormatError` naming the file,
every bad row index and what is wrong with it, or (opt-in) dropped and counted by the caller.

A preference dataset (``ranking``, LLaMA-Factory's pairwise form) becomes :class:`PreferencePair` s: the prompt (an
alpaca row without its response, or a sharegpt conversation ending in a user turn) once followed by the ``chosen``
and once by the ``rejected`` response (alpaca: strings; sharegpt: one assistant message each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_megatrain.data.readers import Row, decode_json_cell
from lightning_megatrain.data.registry import DatasetSpec
from lightning_megatrain.data.tool_calls import (
    ToolFormatError,
    function_call_turn,
    openai_tool_calls,
    tool_definitions,
)

Message = dict[str, Any]  # role, content; tool_calls, tool_call_id, name
MAX_REPORTED_ROWS = 20


class DatasetFormatError(ValueError):
    """A dataset has rows that cannot be turned into conversations (the message names file, rows and problems)."""


class _RowError(Exception):
    """Internal: what is wrong with one row."""


@dataclass(frozen=True)
class Conversation:
    """One training example in canonical form.

    Attributes:
        messages: Canonical messages (system first if any). For ``mode="pt"`` a single user message holding the text.
        tools: Tool definitions forwarded to the chat template (``tools=``), or ``None``.
    """

    messages: list[Message]
    tools: Any = None


@dataclass(frozen=True)
class PreferencePair:
    """A prompt with a preferred and a dispreferred response.

    Attributes:
        chosen: The prompt's messages followed by the chosen assistant message.
        rejected: The same messages followed by the rejected assistant message.
    """

    chosen: Conversation
    rejected: Conversation


def _string(row: Row, column: str, what: str, *, required: bool) -> str | None:
    """Read a string cell; missing/None is an error only when ``required``."""
    if column not in row or row[column] is None:
        if required:
            raise _RowError(f"missing column '{column}' ({what})")
        return None
    value = row[column]
    if not isinstance(value, str):
        raise _RowError(f"column '{column}' ({what}) must be a string, found {type(value).__name__}")
    return value


def _alpaca(row: Row, spec: DatasetSpec, pretrain: bool) -> tuple[list[Message], str | None, Any]:
    """Alpaca row -> (turns, system from the row, tools)."""
    columns = spec.columns
    prompt = _string(row, columns["prompt"], "the prompt", required=True)
    query = _string(row, columns["query"], "the query", required=False) if columns.get("query") else None
    user = f"{prompt}\n{query}" if query else prompt
    if pretrain:
        return [{"role": "user", "content": user}], None, None
    if not columns.get("response"):
        raise _RowError("no response column is configured (a prompt-only dataset can only be used with mode='pt')")
    response = _string(row, columns["response"], "the response", required=True)
    system = _string(row, columns["system"], "the system prompt", required=False) if columns.get("system") else None
    turns: list[Message] = []
    history = decode_json_cell(row.get(columns["history"])) if columns.get("history") else None
    if history not in (None, ""):  # csv leaves an empty cell for "no history"
        if not isinstance(history, list):
            raise _RowError(f"column '{columns['history']}' must be a list of [query, response] pairs")
        for number, pair in enumerate(history):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise _RowError(f"history item {number} must be a [query, response] pair of strings, found {pair!r}")
            turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    turns += [{"role": "user", "content": user}, {"role": "assistant", "content": response}]
    return turns, system, None


def _tool_call_message(message: dict[str, Any], index: int, tags: dict[str, str], role: str) -> Message:
    """A sharegpt ``function_call`` turn or an OpenAI assistant message with ``tool_calls`` -> an assistant turn."""
    content = message.get(tags["content_tag"])
    try:
        if role == "function_call":
            calls, content = function_call_turn(content), ""
        else:
            calls = openai_tool_calls(message["tool_calls"])
    except ToolFormatError as err:
        raise _RowError(f"message {index} ({role!r} turn): {err}") from err
    if content is None:
        content = ""  # OpenAI's tool-call messages carry null; templates concatenate or test the content as a str
    if not isinstance(content, str):
        raise _RowError(f"message {index} content must be a string, found {type(content).__name__}")
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _sharegpt(row: Row, spec: DatasetSpec, pretrain: bool) -> tuple[list[Message], str | None, Any]:
    """Sharegpt / OpenAI-messages row -> (turns as listed, system from the system column, tools)."""
    columns, tags = spec.columns, spec.tags
    if columns["messages"] not in row:
        raise _RowError(f"missing column '{columns['messages']}' (the messages)")
    raw = decode_json_cell(row[columns["messages"]])
    if not isinstance(raw, list):
        raise _RowError(f"column '{columns['messages']}' must be a list of messages, found {type(raw).__name__}")
    roles = {"tool": "tool", tags["observation_tag"]: "tool", tags["function_tag"]: "function_call",
             tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["system_tag"]: "system"}
    turns: list[Message] = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _RowError(f"message {index} is a {type(message).__name__}, expected an object")
        if tags["role_tag"] not in message:
            raise _RowError(f"message {index} has no '{tags['role_tag']}' key")
        role = roles.get(message[tags["role_tag"]])
        if role is None:
            raise _RowError(f"message {index} has unknown role {message[tags['role_tag']]!r}; expected one of "
                            f"{sorted(roles)} (set 'tags' in dataset_info.json if the file uses other role names)")
        if role == "function_call" or (role == "assistant" and message.get("tool_calls")):
            if role == "function_call" and tags["content_tag"] not in message:
                raise _RowError(f"message {index} has no '{tags['content_tag']}' key")
            turns.append(_tool_call_message(message, index, tags, role))
            continue
        if tags["content_tag"] not in message:
            raise _RowError(f"message {index} has no '{tags['content_tag']}' key")
        content = message[tags["content_tag"]]
        if not isinstance(content, str):
            raise _RowError(f"message {index} content must be a string, found {type(content).__name__}")
        turn = {"role": role, "content": content}
        if role == "tool":
            turn |= {key: message[key] for key in ("tool_call_id", "name") if isinstance(message.get(key), str)}
        turns.append(turn)
    system = _string(row, columns["system"], "the system prompt", required=False) if columns.get("system") else None
    try:
        tools = tool_definitions(row.get(columns["tools"])) if columns.get("tools") else None
    except ToolFormatError as err:
        raise _RowError(f"column '{columns['tools']}': {err}") from err
    if pretrain:
        body = [turn for turn in turns if turn["role"] != "system"]
        return body[:1], None, None
    return turns, system, tools


def _kind(turn: Message) -> str:
    """``"call"`` for an assistant turn with tool calls, else the role."""
    return "call" if turn.get("tool_calls") else turn["role"]


# What may follow each kind of turn (None: the start, after an optional system prompt).
_FOLLOWS = {None: ("user",), "user": ("assistant", "call"), "assistant": ("user",), "call": ("tool",),
            "tool": ("tool", "assistant", "call")}
_NAMES = {"user": "a 'user' turn", "assistant": "an 'assistant' turn", "tool": "a tool result ('tool' / "
          "'observation')", "call": "a tool call ('function_call' / assistant 'tool_calls')"}


def _check_turns(turns: Sequence[Message]) -> None:
    """Check role order and content of a conversation (indices are positions in ``turns``).

    The order: user, then assistant (an answer or a tool call); a tool call is followed by its result(s), which are
    followed by an assistant answer or another call. The last turn is an answer or a call.

    Raises:
        _RowError: Empty conversation, misplaced system turn, two same-role turns in a row, a turn out of that
            order, no assistant turn, a trailing user turn or tool result, or an empty assistant answer.
    """
    if not turns:
        raise _RowError("empty conversation")
    previous = None
    for index, turn in enumerate(turns):
        kind = _kind(turn)
        if kind == "system":
            if index != 0:
                raise _RowError(f"message {index} is a 'system' turn; a system prompt is only allowed first")
            continue
        if kind not in _FOLLOWS[previous]:
            if previous is None:
                raise _RowError(f"message {index} is {_NAMES[kind]}; the first turn after the system prompt must be "
                                "'user'")
            if previous == kind and kind in ("user", "assistant"):
                raise _RowError(f"two '{kind}' turns in a row (messages {index - 1} and {index})")
            expected = " or ".join(_NAMES[name] for name in _FOLLOWS[previous])
            raise _RowError(f"message {index} is {_NAMES[kind]} after {_NAMES[previous]} (message {index - 1}); "
                            f"expected {expected}")
        if kind == "assistant" and not turn["content"].strip():
            raise _RowError(f"message {index} is an empty assistant response")
        previous = kind
    if previous is None:
        raise _RowError("no assistant turn to train on")
    if previous == "user":
        if not any(turn["role"] == "assistant" for turn in turns):
            raise _RowError("no assistant turn to train on")
        last = len(turns) - 1
        raise _RowError(f"conversation ends with a 'user' turn (message {last}) that has no assistant response")
    if previous == "tool":
        raise _RowError(f"conversation ends with a tool result (message {len(turns) - 1}) that has no assistant "
                        "response")


def _response_message(row: Row, spec: DatasetSpec, key: str) -> Message:
    """The ``chosen``/``rejected`` response of a preference row as an assistant message."""
    column = spec.columns.get(key)
    if spec.formatting == "alpaca":
        return {"role": "assistant", "content": _string(row, column, f"the {key} response", required=True)}
    tags = spec.tags
    message = decode_json_cell(row.get(column))
    if not isinstance(message, dict) or tags["role_tag"] not in message or tags["content_tag"] not in message:
        raise _RowError(f"column '{column}' (the {key} response) must be a message object with "
                        f"'{tags['role_tag']}' and '{tags['content_tag']}' keys, found {message!r}"[:200])
    if message[tags["role_tag"]] != tags["assistant_tag"]:
        raise _RowError(f"column '{column}' (the {key} response) has role {message[tags['role_tag']]!r}; expected "
                        f"{tags['assistant_tag']!r}")
    if not isinstance(message[tags["content_tag"]], str):
        raise _RowError(f"column '{column}' (the {key} response) content must be a string")
    return {"role": "assistant", "content": message[tags["content_tag"]]}


def _pair(row: Row, spec: DatasetSpec, default_system: str | None) -> PreferencePair:
    """Preference row -> the prompt followed by the chosen response, and by the rejected one."""
    if spec.formatting == "alpaca":  # the alpaca converter with the chosen column as the response, then cut off
        turns, system, tools = _alpaca(row, replace(spec, columns={**spec.columns, "response": spec.columns["chosen"]}),
                                       False)
        prompt = turns[:-1]
    else:
        prompt, system, tools = _sharegpt(row, spec, False)
        if prompt and prompt[-1]["role"] == "assistant":
            raise _RowError(f"column '{spec.columns['messages']}' ends with an assistant turn; in a preference row it "
                            "is the prompt and must end with the user turn that 'chosen' and 'rejected' answer")
    pair = []
    for key in ("chosen", "rejected"):
        turns = [*prompt, _response_message(row, spec, key)]
        _check_turns(turns)
        pair.append(_with_system(turns, system, default_system, tools))
    return PreferencePair(*pair)


def _with_system(turns: list[Message], system: str | None, default_system: str | None, tools: Any) -> Conversation:
    """The conversation with the row's system prompt (or ``default_system``) first, unless a turn already is one."""
    if turns[0]["role"] != "system":
        system = system or default_system
        if system:
            turns = [{"role": "system", "content": system}, *turns]
    return Conversation(turns, tools)


def _canonical(row: Row, spec: DatasetSpec, default_system: str | None, pretrain: bool) -> Conversation:
    converter = _alpaca if spec.formatting == "alpaca" else _sharegpt
    turns, system, tools = converter(row, spec, pretrain)
    if pretrain:
        if not turns or not turns[0]["content"].strip():
            raise _RowError("empty text")
        return Conversation(turns)
    _check_turns(turns)
    return _with_system(turns, system, default_system, tools)


def convert_rows(
    rows: Sequence[Row],
    spec: DatasetSpec,
    source: Path,
    *,
    default_system: str | None = None,
    mode: str = "sft",
    skipped: list[str] | None = None,
) -> list[Conversation] | list[PreferencePair]:
    """Convert every row of one file, or raise one error listing all malformed rows.

    A ``spec.ranking`` file gives :class:`PreferencePair` s (``mode`` is then not read).

    Args:
        rows: The file's rows, in file order (row indices in errors are 0-based positions in this list).
        spec: The dataset spec with ``formatting`` resolved (see ``registry.infer_spec``).
        source: The file the rows came from, named in errors.
        default_system: System prompt for conversations that bring none (row system message/column wins).
        mode: ``"sft"`` (chat conversations) or ``"pt"`` (only the prompt / first non-system message is kept).
        skipped: If given, malformed rows are dropped instead of raising, and one reason per dropped row
            (``"<file>, row <i>: <problem>"``) is appended to this list.

    Returns:
        The conversations of the rows kept, in file order.

    Raises:
        DatasetFormatError: Naming the dataset, the file, each bad row index and what is wrong (unless ``skipped``).
    """
    conversations, problems = [], []
    for index, row in enumerate(rows):
        try:
            if spec.ranking:
                conversations.append(_pair(row, spec, default_system))
            else:
                conversations.append(_canonical(row, spec, default_system, mode == "pt"))
        except _RowError as err:
            problems.append(f"row {index}: {err}")
    if skipped is not None:
        skipped += [f"{source}, {problem}" for problem in problems]
    elif problems:
        shown = "\n  ".join(problems[:MAX_REPORTED_ROWS])
        more = f"\n  ... and {len(problems) - MAX_REPORTED_ROWS} more" if len(problems) > MAX_REPORTED_ROWS else ""
        raise DatasetFormatError(
            f"dataset '{spec.name}' ({spec.formatting}), file {source}: {len(problems)} malformed row(s) of "
            f"{len(rows)}:\n  {shown}{more}"
        )
    return conversations
