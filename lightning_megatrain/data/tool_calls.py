"""Tool calls and tool definitions, read into the form HuggingFace chat templates expect.

A tool call is ``{"type": "function", "function": {"name": str, "arguments": dict}}``, listed in an assistant
message's ``tool_calls``; a tool result is a ``{"role": "tool", "content": str}`` message; a tool definition, passed
to the template as ``tools=``, is ``{"type": "function", "function": {"name": ..., "description": ...,
"parameters": ...}}``. Published templates (Llama 3.1, Qwen2.5, Qwen3, ...) write ``arguments`` with ``tojson``, so
arguments are always a dict here.

Sources:

- LLaMA-Factory sharegpt: a ``function_call`` turn holds ``{"name": ..., "arguments": {...}}`` or a list of them,
  as JSON text; its ``tools`` column holds a JSON list of definitions, bare (``{"name": ..., "parameters": ...}``)
  or already wrapped in ``{"type": "function", "function": ...}``. Bare ones are wrapped.
- OpenAI messages: an assistant message's ``tool_calls`` list (``arguments`` is a JSON string, decoded here; ``id``
  kept), ``role: tool`` messages (``tool_call_id`` and ``name`` kept).
"""

from __future__ import annotations

import json
from typing import Any

from lightning_megatrain.data.readers import decode_json_cell

ToolCall = dict[str, Any]


class ToolFormatError(ValueError):
    """A tool call or tool definition that cannot be read (the message says what was found and what is expected)."""


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise ToolFormatError(f"{where}: 'arguments' is a string that is not JSON ({err})") from err
    if not isinstance(value, dict):
        raise ToolFormatError(f"{where}: 'arguments' must be an object (or its JSON text), found "
                              f"{type(value).__name__}")
    return value


def _call(value: Any, where: str, extra: dict[str, Any]) -> ToolCall:
    """``{"name", "arguments"}`` -> a template tool call; ``extra`` keys (an OpenAI ``id``) are kept."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        raise ToolFormatError(f'{where}: expected {{"name": "<function>", "arguments": {{...}}}}, found {value!r}')
    if "arguments" not in value:
        raise ToolFormatError(f"{where} ({value['name']!r}) has no 'arguments'")
    function = {"name": value["name"], "arguments": _arguments(value["arguments"], where)}
    return {**extra, "type": "function", "function": function}


def function_call_turn(value: Any) -> list[ToolCall]:
    """The tool calls of a sharegpt ``function_call`` turn: one call or a list of calls, as JSON text or decoded.

    Raises:
        ToolFormatError: Not JSON, an empty list, or a call without a ``name`` string or ``arguments``.
    """
    decoded = decode_json_cell(value)
    if isinstance(decoded, str):
        raise ToolFormatError(f'expected the JSON of {{"name": "<function>", "arguments": {{...}}}} or a list of '
                              f"them, found {value[:80]!r}")
    calls = decoded if isinstance(decoded, list) else [decoded]
    if not calls:
        raise ToolFormatError("an empty list of tool calls")
    return [_call(call, f"tool call {number}", {}) for number, call in enumerate(calls)]


def openai_tool_calls(value: Any) -> list[ToolCall]:
    """The ``tool_calls`` of an OpenAI assistant message (``{"id", "type": "function", "function": {...}}``).

    Raises:
        ToolFormatError: Not a non-empty list, a call whose ``type`` is not ``"function"``, or a bad ``function``.
    """
    value = decode_json_cell(value)
    if not isinstance(value, list) or not value:
        raise ToolFormatError(f"'tool_calls' must be a non-empty list, found {value!r}")
    calls = []
    for number, call in enumerate(value):
        where = f"tool call {number}"
        if not isinstance(call, dict) or call.get("type", "function") != "function" or "function" not in call:
            raise ToolFormatError(f'{where}: expected {{"type": "function", "function": {{"name": ..., '
                                  f'"arguments": ...}}}}, found {call!r}')
        calls.append(_call(call["function"], where, {"id": call["id"]} if "id" in call else {}))
    return calls


def tool_definitions(value: Any) -> list[dict[str, Any]] | None:
    """A ``tools`` cell as the list of wrapped definitions templates read; ``None`` for an empty or missing cell.

    Raises:
        ToolFormatError: Not a list (or its JSON text) of definitions with a ``name``.
    """
    decoded = decode_json_cell(value)
    if decoded in (None, "", []):
        return None
    if isinstance(decoded, dict):
        decoded = [decoded]
    if not isinstance(decoded, list):
        raise ToolFormatError(f"must be a list of tool definitions (or its JSON text), found {str(value)[:80]!r}")
    tools = []
    for number, tool in enumerate(decoded):
        wrapped = tool if isinstance(tool, dict) and tool.get("type") == "function" else {"type": "function",
                                                                                          "function": tool}
        function = wrapped.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolFormatError(f"tool definition {number} has no 'name': expected {{\"name\": ..., "
                                  f"\"description\": ..., \"parameters\": {{...}}}}, found {tool!r}")
        tools.append(wrapped)
    return tools
